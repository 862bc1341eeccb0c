"""examples/vllm_update.py in a topology of several engines: who posts what, and flag errors that
must come before any wait (the driver is the reference's examples/update.py, ported)."""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import socketserver
import threading
import time
from pathlib import Path

import pytest
import torch

from support.data import fresh_tensor, want_digests
from support.engine import EngineFront, make_req_func
from support.torchrun import run_torchrun
from ckpt_core import CheckpointFormatError, ConfigError, local_device_key
from ckpt_core.engines.requests import group_handles
from ckpt_core.checkpoint.safetensors import write_file

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "vllm_update.py"
HANDLES = [(f"K{r}", f"ipc://@h{r}") for r in range(4)]


def _example():
    spec = importlib.util.spec_from_file_location("vllm_update_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_first_rank_of_each_group_posts_its_groups_handles_and_the_others_nothing():
    assert [group_handles(HANDLES, r, 2) for r in range(4)] == [HANDLES[0:2], None, HANDLES[2:4], None]
    assert [group_handles(HANDLES, r, None) for r in range(4)] == [HANDLES, None, None, None]
    assert [group_handles(HANDLES, r, 1) for r in range(4)] == [[h] for h in HANDLES]
    for bad in (0, -2, 3):
        with pytest.raises(ConfigError, match="inference groups"):
            group_handles(HANDLES, 0, bad)


def test_endpoints_and_sockets_are_one_for_all_groups_or_one_per_group():
    ex = _example()
    args = ex.parse_args(["--checkpoint-path", "x", "--inference-parallel-size", "2",
                          "--endpoint", "http://a:1,http://b:2", "--uds", "/run/one.sock"])
    assert ex.check_args(args, 4) == (2, ["http://a:1", "http://b:2"], ["/run/one.sock", "/run/one.sock"])
    args = ex.parse_args(["--checkpoint-path", "x", "--inference-parallel-size", "1", "--uds", "/a,/b"])
    assert ex.check_args(args, 2) == (1, ["http://localhost:19730"] * 2, ["/a", "/b"])
    args = ex.parse_args(["--checkpoint-path", "x", "--inference-parallel-size", "1", "--uds", "/a,/b,/c"])
    with pytest.raises(ConfigError, match="2 engine"):
        ex.check_args(args, 2)


def test_an_inference_parallel_size_that_is_not_a_divisor_of_the_world_is_an_error():
    ex = _example()
    with pytest.raises(ConfigError, match="--inference-parallel-size must be a positive divisor"):
        ex.check_args(ex.parse_args(["--checkpoint-path", "x", "--inference-parallel-size", "3"]), 4)


@pytest.mark.parametrize("ips", ["0", "-1", "1e3", "99999999999999999999"])
def test_an_inference_parallel_size_out_of_bounds_is_a_usage_error_naming_the_option(ips, capsys):
    ex = _example()
    with pytest.raises(SystemExit) as exc:
        ex.parse_args(["--checkpoint-path", "x", "--inference-parallel-size", ips])
    assert exc.value.code == 2 and "--inference-parallel-size" in capsys.readouterr().err


@pytest.mark.parametrize("state", ["missing", "empty"])
def test_a_missing_or_empty_checkpoint_directory_is_reported_before_waiting_for_the_server(tmp_path, state):
    ex = _example()
    path = tmp_path / "ckpt"
    if state == "empty":
        path.mkdir()
    t0 = time.monotonic()
    with pytest.raises((ConfigError, CheckpointFormatError), match="does not exist|no .safetensors"):
        # nobody listens on the Unix socket: waiting for it would take --ready-timeout
        ex.main(["--checkpoint-path", str(path), "--uds", str(tmp_path / "nobody.sock"), "--ready-timeout", "120"])
    assert time.monotonic() - t0 < 60, "the checkpoint error must not wait for the server (generous ceiling)"


# ---------------------------------------------------------------- the driver end to end, two engines
class _EngineHttp(http.server.BaseHTTPRequestHandler):
    """The few routes of a vLLM server the driver uses, over a Unix socket, in front of an
    EngineFront's worker processes (``server.front``)."""

    def _reply(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._reply(200 if self.path == "/health" else 404, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        if self.path.split("?")[0] == "/reset_prefix_cache":   # the client resets with ?reset_running_requests
            return self._reply(200, {"success": True})
        if self.path != "/collective_rpc" or body.get("method") != "update_weights_from_ipc":
            return self._reply(404, {"detail": "Not Found"})
        try:
            make_req_func(self.server.front.address)(list(body["args"][0].items()))
            self._reply(200, {"results": [{}] * len(self.server.front.procs)})
        except Exception as exc:
            self._reply(500, {"detail": str(exc)})

    def log_message(self, *args):
        pass


class _UnixHttp(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self):
        sock, _ = super().get_request()
        return sock, ("uds", 0)


def test_the_driver_feeds_two_engines_each_through_its_own_unix_socket(tmp_path):
    """torchrun, 2 PS ranks, --inference-parallel-size 1, --uds one socket per engine."""
    gen = torch.Generator().manual_seed(99)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shards = [{f"layer{i}.{j}": fresh_tensor((32, 16), torch.bfloat16, gen) for j in range(3)} for i in range(3)]
    for i, shard in enumerate(shards):
        write_file(str(ckpt / f"model-{i}.safetensors"), shard)
    want = want_digests(*shards)
    socks = [str(tmp_path / f"engine{g}.sock") for g in range(2)]
    fronts = [EngineFront("cpu", 1), EngineFront("cpu", 1, env={"PS_CPU_VISIBLE_DEVICES": "1"})]
    servers = []
    try:
        for sock, front in zip(socks, fronts):
            srv = _UnixHttp(sock, _EngineHttp)
            srv.front = front
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            servers.append(srv)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        run = run_torchrun([EXAMPLE, "--checkpoint-path", ckpt, "--inference-parallel-size", "1",
                            "--uds", ",".join(socks), "--device", "cpu", "--timeout", "60", "--ready-timeout", "30"],
                           nproc=2, env=env, timeout=300)
        assert run.returncode == 0, run.stderr[-4000:]
        lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
        assert sorted((x["rank"], x["group"]) for x in lines) == [(0, 0), (1, 1)], run.stdout
        keys = [local_device_key("cpu", r) for r in range(2)]
        for g, front in enumerate(fronts):
            assert front.requests == [[keys[g]]], f"engine {g} must get its own group's handle only, once"
            assert front.digests(0) == want, f"engine {g} does not hold exactly the checkpoint"
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()
        for f in fronts:
            f.close()


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint-path", "x", "--stage"], "--stage and --commit need --version"),
    (["--commit"], "--stage and --commit need --version"),
    (["--checkpoint-path", "x", "--stage", "--version", "v", "--pause", "keep"], "--stage takes the extension path"),
    (["--checkpoint-path", "x", "--stage", "--version", "v", "--path", "backend"], "--stage takes the extension path"),
    (["--checkpoint-path", "x", "--commit", "--version", "v"], "--commit without --stage moves no checkpoint"),
    (["--checkpoint-path", "x", "--save-slice-plan", "p.json"], "--save-slice-plan needs --slices"),
])
def test_stage_and_commit_flags_that_cannot_work_are_refused_before_any_wait(argv, message):
    ex = _example()
    with pytest.raises(ConfigError, match=message):
        ex.check_args(ex.parse_args(argv), 1)
    assert ex.check_args(ex.parse_args(["--commit", "--version", "v"]), 1)[0] == 1, "a commit alone needs no checkpoint"
