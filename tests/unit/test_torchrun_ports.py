"""support.torchrun launches a torchrun world again, on another port, when the port free_port() gave
it was taken before its agent bound its store, and only then: a rank's own failure, one naming the
port and EADDRINUSE included, is returned as it came. Real torchrun, one CPU rank (gloo)."""

from __future__ import annotations

import os
import sys

import pytest
import support.ports as ports
import support.torchrun as torchrun

pytest_plugins = ["support.port_fixtures"]   # held, picks
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT)

MEET = """
import os
import torch.distributed as dist
dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} met at port {os.environ['MASTER_PORT']}", flush=True)
dist.destroy_process_group()
"""
# a rank that serves a store of its own on the agent's port (torch would ignore the failure under the agent's
# store): the agent holds the port, so the rank fails with the agent's own message for a lost port, before it
# printed anything
SERVE_AGENTS_PORT = """
import os
import torch.distributed as dist
del os.environ["TORCHELASTIC_USE_AGENT_STORE"]
dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 1, is_master=True)
"""

AGENT_LOST = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
              "address. port: {port}, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")


def _script(tmp_path, text: str) -> str:
    path = tmp_path / "rank.py"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("returncode, stderr, ran, lost", [
    (1, AGENT_LOST, False, True),
    (0, AGENT_LOST, False, False),                                  # it succeeded
    (1, AGENT_LOST, True, False),                                   # the script printed: a rank ran
    (1, AGENT_LOST + "\nChildFailedError:\nrank.py FAILED", False, False),   # a rank failed
    (1, AGENT_LOST.replace("{port}", "12346"), False, False),      # another port was lost, not the store's
    (1, "ValueError: bad --endpoint", False, False),
])
def test_a_lost_store_port_is_told_by_the_whole_signature(returncode, stderr, ran, lost):
    assert torchrun.store_port_lost(returncode, stderr.replace("{port}", "12345"), 12345, ran=ran) is lost


@pytest.mark.slow   # a real torchrun (a few seconds each launch)
def test_a_world_whose_store_port_was_taken_is_launched_again_on_another_and_runs_there(
        tmp_path, held, picks, capsys):
    queued, picked, _ = picks
    queued.append(held)
    run = torchrun.run_torchrun([_script(tmp_path, MEET)], nproc=1, timeout=120, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(picked) == 2 and picked[0] == held != picked[1]
    assert run.stdout.strip() == f"rank 0 met at port {picked[1]}"
    said = capsys.readouterr().err
    assert f"could not bind port {held}" in said and f"launch 2 of {ports.LAUNCHES}" in said


@pytest.mark.slow   # a real torchrun (a few seconds each launch)
def test_a_rank_failing_on_the_store_port_itself_is_not_launched_again(tmp_path, picks, capsys):
    _, picked, _ = picks
    run = torchrun.run_torchrun([_script(tmp_path, SERVE_AGENTS_PORT)], nproc=1, timeout=120, env=ENV)
    assert run.returncode != 0 and not run.stdout.strip()
    assert "EADDRINUSE" in run.stderr and f"port: {picked[0]}" in run.stderr, run.stderr[-3000:]
    assert len(picked) == 1, "a rank's own failure was taken for a lost store port"
    assert "could not bind" not in capsys.readouterr().err


@pytest.mark.slow   # a real torchrun (a few seconds each launch)
def test_a_world_losing_its_port_every_time_returns_the_last_launchs_failure(tmp_path, held, picks, monkeypatch):
    queued, picked, _ = picks
    monkeypatch.setattr(ports, "LAUNCHES", 2)
    queued.extend([held, held])
    run = torchrun.run_torchrun([_script(tmp_path, MEET)], nproc=1, timeout=120, env=ENV)
    assert picked == [held, held]
    assert run.returncode != 0 and torchrun.store_port_lost(run.returncode, run.stderr, held, ran=False)


@pytest.mark.slow   # a real torchrun (a few seconds each launch)
def test_a_world_started_in_the_background_is_launched_again_when_its_store_port_was_taken(
        tmp_path, held, picks, capsys):
    queued, picked, _ = picks
    queued.append(held)
    out, err = tmp_path / "out", tmp_path / "err"
    proc = torchrun.start_torchrun([_script(tmp_path, MEET)], nproc=1, out=out, err=err, env=ENV)
    assert proc.wait(timeout=120) == 0, err.read_text()[-3000:]
    assert len(picked) == 2 and picked[0] == held != picked[1]
    assert out.read_text().strip() == f"rank 0 met at port {picked[1]}"
    assert "EADDRINUSE" not in err.read_text(), "the first launch's output was kept"
    assert f"could not bind port {held}" in capsys.readouterr().err


@pytest.mark.slow   # a real torchrun (a few seconds each launch)
def test_a_background_rank_failing_on_the_store_port_itself_is_not_launched_again(tmp_path, picks):
    _, picked, _ = picks
    log = tmp_path / "log"
    proc = torchrun.start_torchrun([_script(tmp_path, SERVE_AGENTS_PORT)], nproc=1, out=log, env=ENV)
    assert proc.wait(timeout=120) != 0
    assert len(picked) == 1, "a rank's own failure was taken for a lost store port"
    assert "EADDRINUSE" in log.read_text() and "ChildFailedError" in log.read_text()


def test_the_command_is_torchrun_on_one_node_meeting_at_the_loopback_port():
    assert torchrun.torchrun_cmd(2, 4321, ["s.py", 7], python="py") == [
        "py", "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", "4321", "s.py", "7"]
    assert torchrun.torchrun_cmd(1, 1, [])[0] == sys.executable
