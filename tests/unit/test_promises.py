"""README promises that had no test of their own (issue 14's mutation audit): the NCCL error
defaults, the device-kind entry point, the shared pool's reuse, split_checkpoint_files, and
request_inference_to_update against a real HTTP server."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch

from ckpt_core import split_checkpoint_files
from ckpt_core.transfer.collectives import NCCL_ERROR_ENV, nccl_error_defaults
from ckpt_core.checkpoint.host import SharedPool
from ckpt_core.checkpoint.safetensors import write_file
from ckpt_core.devices import get_backend
from ckpt_core.errors import CheckpointFormatError, ConfigError, RemoteWorkerError, TransportError
from support.procs import pythonpath


# -- NCCL error-handling defaults ------------------------------------------------------------------
def test_nccl_error_defaults_are_set_when_absent_and_user_values_win(monkeypatch):
    for key in NCCL_ERROR_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")          # the user's choice
    nccl_error_defaults()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


# -- the ckpt_core.devices entry point ------------------------------------------------------------
PLUGIN = '''
from ckpt_core.devices.cpu import CpuBackend

class FakeNpu(CpuBackend):
    kind = "fakenpu"

def make():
    return FakeNpu()
'''


def test_a_plugin_package_adds_a_device_kind_through_the_entry_point(tmp_path):
    """A real installed-package layout (dist-info with entry_points.txt) on sys.path of a fresh process."""
    import subprocess
    (tmp_path / "fake_npu_plugin.py").write_text(PLUGIN)
    info = tmp_path / "fake_npu_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-npu-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[ckpt_core.devices]\nfakenpu = fake_npu_plugin:make\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("from ckpt_core.devices import available_kinds, get_backend, default_kind\n"
            "print(available_kinds(), get_backend('fakenpu').kind, default_kind())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=pythonpath(tmp_path, root)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["['cpu',", "'cuda',", "'fakenpu']", "fakenpu", "fakenpu"], out.stdout


# -- the shared pool ----------------------------------------------------------------------------------
def test_the_shared_pool_reuses_its_memory_and_refuses_a_second_holder():
    pool = SharedPool(get_backend("cpu"))
    try:
        first = pool.acquire("step-1", 3 << 20, 0)
        ptr = first.tensor.data_ptr()
        with pytest.raises(ConfigError, match="held by checkpoint 'step-1'"):
            pool.acquire("step-2", 1 << 20, 0)
        pool.give_back("step-1")
        again = pool.acquire("step-2", 2 << 20, 0)          # smaller: the same memory
        assert again is first and again.tensor.data_ptr() == ptr
        pool.give_back("step-2")
        bigger = pool.acquire("step-3", 8 << 20, 0)         # larger: grown, the old region released
        assert bigger.nbytes >= 8 << 20 and first.tensor is None
    finally:
        pool.close()
    assert pool.regions == []


def test_a_delta_chain_alternates_between_two_pool_regions_and_nothing_else_takes_a_second():
    pool = SharedPool(get_backend("cpu"))
    try:
        a = pool.acquire("A", 3 << 20, 0)
        for beside in (None, "Z"):   # no base, or a base that holds no region: one region, as before
            with pytest.raises(ConfigError, match="held by checkpoint 'A'"):
                pool.acquire("X", 1 << 20, 0, beside=beside)
        b = pool.acquire("B", 3 << 20, 0, beside="A")
        assert b is not a and pool.nbytes == a.nbytes + b.nbytes and pool.free_bytes == 0
        with pytest.raises(ConfigError, match="held by checkpoints 'A', 'B'"):
            pool.acquire("C", 3 << 20, 0, beside="B")       # at most two regions
        pool.give_back("A")
        assert pool.free_bytes == a.nbytes
        c = pool.acquire("C", 2 << 20, 0, beside="B")       # A's memory, now free
        assert c is a and pool.nbytes == a.nbytes + b.nbytes
        pool.give_back("B")
        pool.release_free()                                 # what unregister(force=True) does
        assert pool.regions == [c] and b.tensor is None and c.tensor is not None
    finally:
        pool.close()
    assert pool.regions == []


# -- split_checkpoint_files ---------------------------------------------------------------------------
def _shards(tmp_path, n: int) -> list[str]:
    names = []
    for i in range(n):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        write_file(str(tmp_path / name), {f"w{i}": torch.randn(50 * (i + 1))})
        names.append(name)
    return names


@pytest.mark.parametrize("world", [1, 2, 3])
def test_plain_shards_without_an_index_are_split_exactly_once(tmp_path, world):
    names = _shards(tmp_path, 5)
    (tmp_path / "notes.txt").write_text("not a shard")
    shares = [split_checkpoint_files(str(tmp_path), r, world) for r in range(world)]
    flat = [os.path.basename(p) for s in shares for p in s]
    assert sorted(flat) == sorted(names) and len(flat) == len(set(flat))
    assert shares == [split_checkpoint_files(str(tmp_path), r, world) for r in range(world)], "deterministic"


def test_an_index_naming_a_missing_file_is_a_format_error(tmp_path):
    names = _shards(tmp_path, 2)
    weight_map = {"w0": names[0], "w1": names[1], "w2": "model-00003-of-00003.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointFormatError, match="missing files") as info:
        split_checkpoint_files(str(tmp_path), 0, 2)
    assert "model-00003-of-00003.safetensors" in str(info.value)


# -- request_inference_to_update against a real HTTP server -------------------------------------------
class _Engine(BaseHTTPRequestHandler):
    status = 200
    reset = (200, b"{}")   # the answer to POST /reset_prefix_cache
    bodies: list = []

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
        type(self).bodies.append((self.path, body))
        status, text = (self.status, b"{}" if self.status == 200 else b"Traceback: engine exploded")
        if self.path.startswith("/reset_prefix_cache"):
            status, text = self.reset
        self.send_response(status)
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)

    def log_message(self, *args):
        pass


@pytest.fixture
def engine():
    _Engine.bodies, _Engine.status, _Engine.reset = [], 200, (200, b"{}")
    server = HTTPServer(("127.0.0.1", 0), _Engine)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}/collective_rpc"
    server.shutdown()
    server.server_close()


def test_request_inference_to_update_posts_the_handles_to_collective_rpc(engine):
    from ckpt_core import request_inference_to_update
    _, url = engine
    handles = {"CPU-x-0": "ipc://@ckpt-a-0", "CPU-x-1": "ipc://@ckpt-a-1"}
    request_inference_to_update(url, handles, timeout=30, reset_prefix_cache=False)
    # vLLM's executor deadline outlasts the workers' own (600 s by default): replies it stops reading
    # at its deadline would answer the next call (issue 33, item 4)
    assert _Engine.bodies == [("/collective_rpc", {"method": "update_weights_from_ipc", "args": [handles],
                                                   "timeout": 660.0})]


@pytest.mark.parametrize("status", [404, 405])
def test_an_engine_without_a_prefix_cache_route_gets_a_warning_once_not_a_failed_update(engine, status, caplog):
    """The weights were loaded by /collective_rpc: a missing reset route must not fail the update
    (it did: RemoteWorkerError after the engine held the new weights)."""
    from ckpt_core import request_inference_to_update
    _, url = engine
    _Engine.reset = (status, b'{"detail": "Not Found"}')
    with caplog.at_level(logging.DEBUG, logger="ckpt_core"):
        for _ in range(2):
            request_inference_to_update(url, {"k": "h"}, timeout=30)
    assert [p for p, _ in _Engine.bodies] == ["/collective_rpc", "/reset_prefix_cache?reset_running_requests=true"] * 2
    said = [r for r in caplog.records if "/reset_prefix_cache" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING, logging.DEBUG], "one warning per engine, then debug"
    assert f"HTTP {status}" in said[0].getMessage() and url.rsplit("/", 1)[0] in said[0].getMessage()


@pytest.mark.parametrize("reset, error", [
    ((200, b'{"success": false}'), "refused to reset its prefix cache"),   # it answered and refused
    ((500, b"Traceback: reset exploded"), "HTTP 500"),
    ((200, b"not json"), None),    # a 2xx without a verdict (was a raw JSONDecodeError)
    ((200, b"[]"), None),          # (was an AttributeError)
])
def test_a_reset_the_engine_answered_is_read_and_a_refusal_is_a_typed_error(engine, reset, error):
    from ckpt_core import request_inference_to_update
    _, url = engine
    _Engine.reset = reset
    if error is None:
        request_inference_to_update(url, {"k": "h"}, timeout=30)
    else:
        with pytest.raises(RemoteWorkerError, match=error):
            request_inference_to_update(url, {"k": "h"}, timeout=30)


def test_request_inference_to_update_turns_an_engine_error_and_no_engine_into_typed_errors(engine):
    from ckpt_core import request_inference_to_update
    server, url = engine
    _Engine.status = 500
    with pytest.raises(RemoteWorkerError, match="HTTP 500") as info:
        request_inference_to_update(url, {"k": "h"}, timeout=30, reset_prefix_cache=False)
    assert "engine exploded" in info.value.remote_traceback
    port = server.server_address[1]
    server.shutdown()
    server.server_close()
    with pytest.raises(TransportError, match="Connection refused"):
        request_inference_to_update(f"http://127.0.0.1:{port}/collective_rpc", {"k": "h"}, timeout=5,
                                    reset_prefix_cache=False)
