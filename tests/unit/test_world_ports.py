"""A world whose rank 0 could not serve its store on the port free_port() gave, another process
holding it, is started again on another port before any test sees it; a world that fails otherwise
is not. Real processes: ``ckpt-engine serve`` ranks (support.service_world.ServiceWorld) and PS rank
processes (support.world.run_ps_world, which support.procs.run_world starts like the trainer, parity
and shards worlds, and PsWorld)."""

from __future__ import annotations

import os
import sys

import pytest
import support.ports as ports
import torch
from support.data import fresh_tensor
from support.service_world import ServiceWorld
from support.world import PsWorld, run_ps_world

pytest_plugins = ["support.port_fixtures"]   # held, picks
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PS_LOST = ("ckpt-engine serve: TransportError: rank 0: cannot reach the rendezvous store at 127.0.0.1:{port}: "
           "[Errno 98] Address already in use")


@pytest.mark.parametrize("log, lost", [
    (PS_LOST, True),
    (PS_LOST.replace("{port}", "12346"), False),   # another port
    ("TransportError: rank 1: cannot reach the rendezvous store at 127.0.0.1:{port}: connection refused", False),
    ("OSError: [Errno 98] Address already in use", False),   # not the store's
])
def test_a_lost_store_port_is_told_by_the_parameter_servers_own_words(log, lost):
    assert ports.store_lost_port(log.replace("{port}", "12345"), 12345) is lost


@pytest.mark.slow   # real serve processes, started twice
def test_a_world_whose_store_port_was_taken_starts_again_on_another_and_serves(tmp_path, held, picks, capsys):
    queued, picked, _ = picks
    queued.append(held)
    world = ServiceWorld(2, str(tmp_path))
    try:
        assert [c.get("/v1/healthz").status_code for c in world.clients] == [200, 200]
    finally:
        assert world.close() == [0, 0]
    assert len(picked) == 2 and picked[0] == held != picked[1]
    said = capsys.readouterr().err
    assert f"could not bind port {held}" in said and f"launch 2 of {ports.LAUNCHES}" in said


@pytest.mark.slow   # a real serve process
def test_a_world_failing_for_another_reason_is_not_started_again(tmp_path, picks):
    _, picked, _ = picks
    with pytest.raises(RuntimeError, match="unknown device kind 'nosuch'"):
        ServiceWorld(1, str(tmp_path), device="nosuch")
    assert len(picked) == 1


@pytest.mark.slow   # real PS rank processes, started twice
def test_a_ps_world_whose_store_port_was_taken_is_started_again_on_another_and_runs_its_script(held, picks, capsys):
    queued, picked, _ = picks
    queued.append(held)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    mine = {r: {"named_tensors": {f"w{r}": fresh_tensor((8, 4), torch.float32, gen)}} for r in range(2)}
    got = run_ps_world("cpu", 2, [("register", ("c", mine)), ("gather", "c")])   # the gather: both ranks met
    assert got == {r: [("ok", None), ("ok", None)] for r in range(2)}, got
    assert len(picked) == 2 and picked[0] == held != picked[1]
    assert f"could not bind port {held}" in capsys.readouterr().err


@pytest.mark.slow   # real PS rank processes, started twice
def test_a_ps_world_driven_step_by_step_is_started_again_when_its_store_port_was_taken(held, picks):
    queued, picked, _ = picks
    queued.append(held)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    with PsWorld("cpu", 2) as world:
        registered = world.all("register", per_rank={r: ("c", {"named_tensors": {
            f"w{r}": fresh_tensor((8, 4), torch.float32, gen)}}) for r in range(2)})
        gathered = world.all("gather", "c")   # both ranks met
        assert all(o.ok for o in [*registered.values(), *gathered.values()]), (registered, gathered)
    assert len(picked) == 2 and picked[0] == held != picked[1]


@pytest.mark.slow   # real PS rank processes
def test_a_ps_world_failing_for_another_reason_is_not_started_again(picks):
    _, picked, _ = picks
    got = run_ps_world("nosuch", 2, [])
    assert all(res[0][0] == "fatal" and "unknown device kind 'nosuch'" in res[0][1] for res in got.values()), got
    assert len(picked) == 1


SERVE_ONE = """
import os
from ckpt_core import ParameterServer
with ParameterServer(0, 1, device="cpu", master_addr="127.0.0.1"):   # MASTER_PORT: from the environment
    print("served the store on", os.environ["MASTER_PORT"])
"""


@pytest.mark.slow   # a real ParameterServer process, run twice
def test_a_ps_process_whose_master_port_was_taken_runs_again_on_another(tmp_path, held, picks, capsys):
    queued, picked, _ = picks
    queued.append(held)
    (tmp_path / "serve.py").write_text(SERVE_ONE)
    run = ports.run_with_master_port([sys.executable, tmp_path / "serve.py"], env=dict(os.environ, PYTHONPATH=ROOT),
                                     timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(picked) == 2 and picked[0] == held != picked[1]
    assert run.stdout.strip() == f"served the store on {picked[1]}"
    assert f"could not bind port {held}" in capsys.readouterr().err


@pytest.mark.slow   # a real process
def test_a_ps_process_failing_after_it_printed_is_not_run_again(tmp_path, held, picks):
    queued, picked, _ = picks
    queued.append(held)
    (tmp_path / "serve.py").write_text('print("a step ran")\n' + SERVE_ONE)
    run = ports.run_with_master_port([sys.executable, tmp_path / "serve.py"], env=dict(os.environ, PYTHONPATH=ROOT),
                                     timeout=120)
    assert run.returncode != 0 and ports.store_lost_port(run.stderr, held), run.stderr[-3000:]
    assert picked == [held], "a process that had printed was run again"


def _tcp_serve(tmp_path, **env_extra):
    import httpx
    from support.service_world import serve_healthy

    token = "t" * 32
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "CKPT_SERVICE_TOKEN": token, **env_extra}
    log = str(tmp_path / "serve.log")

    def client_of(port):
        return httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"},
                            timeout=60)

    return serve_healthy(lambda port: ["--device", "cpu", "--host", "127.0.0.1", "--port", str(port)], env, log,
                         client_of), log


@pytest.mark.slow   # real serve processes, started twice
@pytest.mark.parametrize("taken", ["http", "store"])
def test_a_serve_whose_http_or_store_port_was_taken_starts_again_on_fresh_ports(tmp_path, held, picks, capsys, taken):
    from support.service_world import stop

    queued, picked, free_port = picks
    queued += [held, free_port()] if taken == "http" else [free_port(), held]   # serve_healthy: HTTP, then store
    (proc, port), log = _tcp_serve(tmp_path)
    try:
        assert len(picked) == 4 and port == picked[2] != held and held not in picked[2:]
    finally:
        assert stop(proc) == 0, open(log).read()[-3000:]
    said = capsys.readouterr().err
    assert f"its {'HTTP' if taken == 'http' else 'store'} port {held}" in said and "launch 2 of" in said


@pytest.mark.slow   # a real serve process
def test_a_serve_failing_for_another_reason_is_not_started_again(tmp_path, picks):
    _, picked, _ = picks
    with pytest.raises(RuntimeError, match="serve exited"):
        _tcp_serve(tmp_path, CKPT_SERVICE_TOKEN="short")   # refused at start: fewer than 16 characters
    assert len(picked) == 2


@pytest.mark.slow   # real serve processes, started twice
def test_a_world_whose_metrics_port_was_taken_starts_again_on_another(tmp_path, held, picks, capsys):
    import httpx
    from support.service_world import metrics_world

    queued, picked, _ = picks
    queued.append(held)   # metrics_world's pick first; the store's (ServiceWorld's) after it
    world = metrics_world(str(tmp_path), size=1)
    try:
        assert world.metrics_port not in (held,) and world.metrics_port in picked
        assert httpx.get(f"http://127.0.0.1:{world.metrics_port}/metrics", timeout=30).status_code == 200
    finally:
        assert world.close() == [0]
    said = capsys.readouterr().err
    assert f"could not bind port {held}" in said and "metrics port" in said
