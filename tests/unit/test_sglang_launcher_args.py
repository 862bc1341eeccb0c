"""`python -m ckpt_sglang.update` on plain bad input, as `ckpt-engine` (tests/unit/test_cli_fuzz.py): every
number bounded and checked by argparse (exit 2 naming the flag), and the torchrun re-exec never starts
more processes than the host has CPUs (`--inference-parallel-size 100000` started 100000)."""

from __future__ import annotations

import pytest

from ckpt_sglang import update

BASE = ["--checkpoint-path", "/nonexistent"]


@pytest.mark.parametrize("flag, value", [
    ("--inference-parallel-size", "100000"), ("--inference-parallel-size", "0"), ("--timeout", "nan"),
    ("--timeout", "1e308"), ("--ready-timeout", "-1"), ("--sleep-time", "inf"), ("--sleep-time", "1e300"),
    ("--stage-device-gib", "1e308"), ("--stage-device-gib", "-1"), ("--timeout", "0"),
])
def test_a_number_out_of_bounds_is_a_usage_error_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as info:
        update.parse_args([*BASE, flag, value])
    assert info.value.code == 2 and flag in capsys.readouterr().err


def test_numbers_within_bounds_are_taken():
    args = update.parse_args([*BASE, "--inference-parallel-size", "4", "--timeout", "1e7", "--sleep-time", "0",
                              "--stage-device-gib", "0"])
    assert (args.inference_parallel_size, args.timeout, args.sleep_time, args.stage_device_gib) == (4, 1e7, 0, 0)


def test_the_torchrun_re_exec_starts_no_more_processes_than_cpus(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(update.os, "cpu_count", lambda: 2)
    started = []
    # the seam that starts torchrun (a child process that SIGTERM reaches): nothing is started here
    monkeypatch.setattr(update, "run_torchrun", lambda cmd: started.append(cmd) or 0)
    assert update.main([*BASE, "--inference-parallel-size", "4"]) == 2
    assert started == [] and "--inference-parallel-size 4" in capsys.readouterr().err
    assert update.main([*BASE, "--inference-parallel-size", "2"]) == 0 and len(started) == 1
    assert "--nproc-per-node=2" in started[0]


def test_via_chooses_how_a_plain_update_loads_and_is_refused_with_stage_or_commit(monkeypatch, capsys):
    from ckpt_core.errors import ConfigError

    assert update.parse_args(BASE).via == "auto" and update.parse_args([*BASE, "--via", "loader"]).via == "loader"
    with pytest.raises(SystemExit) as info:
        update.parse_args([*BASE, "--via", "disk"])
    assert info.value.code == 2 and "--via" in capsys.readouterr().err
    update.check_args(update.parse_args([*BASE, "--via", "ipc", "--inference-parallel-size", "1"]), 1)
    for extra in (["--stage", "--weight-version", "v"], ["--commit", "--weight-version", "v"]):
        with pytest.raises(ConfigError, match="--via chooses how a plain update loads"):
            update.check_args(update.parse_args([*BASE, "--via", "loader", *extra]), 1)


def test_the_launcher_passes_via_to_the_client_none_for_auto():
    class Client:
        def __init__(self):
            self.calls = []

        def update(self, handles, **kwargs):
            self.calls.append(kwargs["via"])
            return kwargs["via"]

        def check_reloadable(self):
            pass

    for via, sent in (("auto", None), ("loader", "loader"), ("ipc", "ipc")):
        client, reports = Client(), []
        req = update.make_req_func(client, 0, 1, update.parse_args([*BASE, "--via", via]), reports)
        req([("GPU-0", "ipc://@x")])
        assert client.calls == [sent] and reports == [sent]
