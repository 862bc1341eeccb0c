"""SglangClient against what a server offers: weight-update sessions found by probing, models that
SGLang cannot reload refused before anything is posted.

A small HTTP server plays the SGLang routes involved (the real ones run in
tests/integration/test_sglang_update.py on CPU with SGLang 0.5.23, and in
tests/gpu/test_sglang_gpu.py with 0.5.17 on a GPU); it records every call in order.
"""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from ckpt_core.errors import ConfigError, RemoteWorkerError
from ckpt_sglang import SglangClient
from ckpt_sglang._server import reload_problem

FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
FP8_TENSOR = {"quant_method": "fp8", "activation_scheme": "dynamic"}


def _ct(num_bits: int, kind: str, strategy: str) -> dict:
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": num_bits, "type": kind, "strategy": strategy}}}}


@pytest.mark.parametrize("config, server, refused", [
    (None, None, None),
    ({}, None, None),
    (FP8_BLOCK, None, None),
    (FP8_BLOCK, "fp8", None),                    # --quantization fp8 on a block-FP8 checkpoint: its blocks
    (FP8_TENSOR, None, "FP8 per tensor"),
    (None, "fp8", "online FP8"),                 # a bf16 checkpoint quantized by the server
    ({"quant_method": "w8a8_int8"}, None, "'w8a8_int8'"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, None, "'modelopt'"),
    (_ct(8, "float", "channel"), None, "8-bit float weights per channel"),
    (_ct(8, "int", "tensor"), None, "8-bit int weights per tensor"),
    (_ct(4, "int", "group"), None, None),        # not named: not verified, not refused
    ({"quant_method": "gptq", "bits": 4}, None, None),
], ids=["bf16", "empty", "fp8-block", "fp8-block-flag", "fp8-tensor", "fp8-online", "w8a8-int8", "modelopt",
        "ct-fp8-channel", "ct-int8-tensor", "ct-w4a16", "gptq"])
def test_the_formats_sglang_cannot_reload_are_named_and_the_others_pass(config, server, refused):
    got = reload_problem(config, server)
    if refused is None:
        assert got is None
    else:
        assert refused in got and "cannot equal a cold load" in got and "nothing was updated" in got


class _Sglang(http.server.BaseHTTPRequestHandler):
    """``sessions``: whether /begin_weight_update and /end_weight_update exist; ``ipc``: the status
    /update_weights_from_ipc answers; ``model_path``: what /model_info says."""
    calls: list = []
    sessions, ipc, model_path = True, 200, "/nonexistent"
    info: dict = {}   # merged into /server_info's answer
    health = 200

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        type(self).calls.append(("GET", self.path))
        if self.path == "/model_info":
            return self._answer(200, {"model_path": type(self).model_path})
        if self.path == "/server_info":
            return self._answer(200, {"custom_weight_loader": [], "tp_size": 1, "dp_size": 1, "quantization": None,
                                      **type(self).info})
        if self.path == "/health":
            return self._answer(type(self).health, {})
        self._answer(404, {"detail": "Not Found"})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        type(self).calls.append(("POST", self.path))
        if self.path in ("/begin_weight_update", "/end_weight_update") and not type(self).sessions:
            return self._answer(404, {"detail": "Not Found"})
        status = type(self).ipc if self.path == "/update_weights_from_ipc" else 200
        self._answer(status, {"success": status == 200, "message": "ok" if status == 200 else "load failed"})

    def log_message(self, *a):
        pass


@pytest.fixture
def server():
    _Sglang.calls, _Sglang.sessions, _Sglang.ipc, _Sglang.model_path = [], True, 200, "/nonexistent"
    _Sglang.info, _Sglang.health = {}, 200
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sglang)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def _posts() -> list[str]:
    return [path for method, path in _Sglang.calls if method == "POST"]


def test_each_update_loads_inside_a_session_where_the_server_has_one(server):
    with SglangClient(server, timeout=10) as client:
        for _ in range(2):
            report = client.update({"GPU-0": "ipc://@x"})
            assert list(report.seconds)[:3] == ["begin", "update", "end"]
    assert _posts() == ["/begin_weight_update", "/update_weights_from_ipc", "/end_weight_update"] * 2


def test_a_server_without_sessions_is_probed_once_and_then_updated_as_before(server):
    _Sglang.sessions = False
    with SglangClient(server, timeout=10) as client:
        client.update({"GPU-0": "ipc://@x"})
        report = client.update({"GPU-0": "ipc://@x"})
    assert _posts() == ["/begin_weight_update", "/update_weights_from_ipc", "/update_weights_from_ipc"]
    assert "begin" not in report.seconds and "end" not in report.seconds


def test_a_failed_load_still_closes_the_session_and_reports_the_servers_answer(server):
    _Sglang.ipc = 400
    with SglangClient(server, timeout=10) as client, pytest.raises(RemoteWorkerError, match="load failed"):
        client.update({"GPU-0": "ipc://@x"})
    assert _posts() == ["/begin_weight_update", "/update_weights_from_ipc", "/end_weight_update"]


def test_a_model_sglang_cannot_reload_is_refused_before_anything_is_posted(server, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "quantization_config": FP8_TENSOR}))
    _Sglang.model_path = str(tmp_path)
    with SglangClient(server, timeout=10) as client:
        req_func = client.req_func(weight_version="v1")
        with pytest.raises(ConfigError, match="cannot be updated in place: the model is FP8 per tensor"):
            req_func.precheck()
        with pytest.raises(ConfigError, match="FP8 per tensor"):
            req_func({"GPU-0": "ipc://@x"})
    assert _posts() == [], "nothing may be posted to a server that cannot reload its model"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "quantization_config": FP8_BLOCK}))
    with SglangClient(server, timeout=10) as client:
        client.req_func().precheck()   # block FP8 reloads


LOADER = {"custom_weight_loader": ["ckpt_sglang.staging.load"]}
WAITS = {"checkpoint_engine_wait_weights_before_ready": True}


@pytest.mark.parametrize("info, health, want", [
    ({}, 200, "ipc"),                                  # no loader of ours
    (LOADER, 200, "loader"),
    ({**LOADER, "dp_size": 2}, 200, "ipc"),            # SGLang's tensor route needs dp_size 1
    ({**LOADER, **WAITS}, 503, "ipc"),                 # still waiting for its first weights
    ({**LOADER, **WAITS}, 200, "loader"),              # /health 200: the first weights came
], ids=["no-loader", "loader", "dp2", "waiting", "served"])
def test_auto_takes_our_loader_where_the_server_runs_it_and_has_its_first_weights(server, info, health, want):
    _Sglang.info, _Sglang.health = info, health
    with SglangClient(server, timeout=10) as client:
        assert client.route() == want and client.route("ipc") == "ipc"


def test_after_its_first_ipc_update_a_waiting_server_is_updated_through_our_loader(server):
    _Sglang.info, _Sglang.health = {**LOADER, **WAITS}, 503
    with SglangClient(server, timeout=10) as client:
        assert client.route() == "ipc"
        report = client.update({"GPU-0": "ipc://@x"})
        assert report.path == "ipc" and client.route() == "loader", "a successful IPC update marks the first weights"
    assert _posts() == ["/begin_weight_update", "/update_weights_from_ipc", "/end_weight_update"]


def test_via_is_checked_and_loader_needs_our_loader_on_the_server(server):
    with SglangClient(server, timeout=10) as client:
        with pytest.raises(ConfigError, match="via must be one of"):
            client.update({"GPU-0": "ipc://@x"}, via="tensor")
        with pytest.raises(ConfigError, match="was not started with --custom-weight-loader ckpt_sglang.staging.load"):
            client.update({"GPU-0": "ipc://@x"}, via="loader")
    assert _posts() == [], "a refused route posted something"


def test_auto_takes_the_ipc_route_when_the_server_info_cannot_be_read(server):
    with SglangClient("http://127.0.0.1:9", timeout=5) as client:
        assert client.route() == "ipc"
