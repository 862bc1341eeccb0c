"""The requester against a small scripted HTTP server (no vLLM needed): routes, errors, timeouts, UDS."""

import http.server
import json
import socket
import socketserver
import threading
import time

import pytest

from ckpt_core.errors import ClosedError, ConfigError, RemoteWorkerError, TransportError, UpdateTimeoutError
from ckpt_vllm import VllmClient
from vllm_support.server import free_port


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict = {}  # (method, path) -> (status, body or callable, delay)
    calls: list = []

    def _serve(self, method):
        path = self.path.split("?")[0]
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.calls.append((method, self.path, body))
        status, reply, delay = self.routes.get((method, path), (404, {"detail": "Not Found"}, 0))
        time.sleep(delay)
        data = json.dumps(reply(body) if callable(reply) else reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._serve("GET")

    def do_POST(self):
        self._serve("POST")

    def log_message(self, *args):
        pass


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self):
        sock, _ = super().get_request()
        return sock, ("uds", 0)  # BaseHTTPRequestHandler wants a (host, port) address


OK_ROUTES = {
    ("GET", "/health"): (200, {}, 0),
    ("POST", "/collective_rpc"): (200, lambda b: {"results": [{"device_key": "K", "seen": b}]}, 0),
    ("POST", "/reset_prefix_cache"): (200, {"success": True}, 0),
    ("POST", "/start_weight_update"): (200, {"message": "ok"}, 0),
    ("POST", "/update_weights"): (200, {"message": "ok"}, 0),
    ("POST", "/finish_weight_update"): (200, {"message": "ok"}, 0),
    ("POST", "/pause"): (200, {"status": "paused"}, 0),
    ("POST", "/resume"): (200, {"status": "resumed"}, 0),
}


@pytest.fixture
def fake(request, tmp_path):
    _Handler.routes, _Handler.calls = dict(OK_ROUTES), []
    if getattr(request, "param", "tcp") == "uds":
        sock = str(tmp_path / "s.sock")
        srv, client = _UnixServer(sock, _Handler), VllmClient(uds=sock, timeout=5)
    else:
        port = free_port()
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Handler)
        client = VllmClient(f"http://127.0.0.1:{port}", timeout=5)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield client
    finally:
        client.close()
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("fake", ["tcp", "uds"], indirect=True)
def test_the_extension_path_calls_collective_rpc_then_resets_the_prefix_cache(fake):
    report = fake.update([("K", "ipc://@h")], path="extension", timeout=7)
    assert [c[1] for c in _Handler.calls] == ["/collective_rpc", "/reset_prefix_cache?reset_running_requests=true"]
    body = _Handler.calls[0][2]
    # vLLM's executor waits 60 s past the workers' own deadline (EXECUTOR_MARGIN_S): a worker that times
    # out still answers this call, not the next one
    assert body == {"method": "update_weights_from_ipc", "args": [{"K": "ipc://@h"}], "kwargs": {"timeout": 7.0},
                    "timeout": 67.0}
    assert report.workers[0]["device_key"] == "K"
    assert set(report.seconds) == {"update", "reset_prefix_cache", "total"} and fake.last_report is report


def test_the_backend_path_uses_the_native_routes_in_order_inside_a_pause(fake):
    fake.update({"K": "ipc://@h"}, path="backend", pause="wait")
    assert [c[1] for c in _Handler.calls] == ["/pause?mode=wait", "/start_weight_update", "/update_weights",
                                              "/finish_weight_update", "/reset_prefix_cache?reset_running_requests=true", "/resume"]
    assert _Handler.calls[2][2]["update_info"]["zmq_handles"] == {"K": "ipc://@h"}


def test_a_worker_failure_becomes_a_remote_worker_error_with_the_server_text_and_still_resumes(fake):
    _Handler.routes[("POST", "/collective_rpc")] = (500, {"error": {"message": "tensor 'x' missing"}}, 0)
    with pytest.raises(RemoteWorkerError, match="HTTP 500: tensor 'x' missing"):
        fake.update({"K": "h"}, pause="abort")
    assert _Handler.calls[-1][1] == "/resume"


def test_a_missing_route_says_dev_mode_is_needed(fake):
    del _Handler.routes[("POST", "/collective_rpc")]
    with pytest.raises(ConfigError, match="VLLM_SERVER_DEV_MODE=1"):
        fake.collective_rpc("anything")


def test_a_silent_server_times_out_naming_the_call(fake):
    _Handler.routes[("POST", "/update_weights")] = (200, {}, 2.0)
    with pytest.raises(UpdateTimeoutError, match="/update_weights"):
        fake._post("/update_weights", {}, timeout=0.5)


def test_nothing_listening_is_a_transport_error_and_wait_ready_gives_up_in_time():
    with VllmClient(f"http://127.0.0.1:{free_port()}", connect_timeout=1) as client:
        assert not client.healthy()
        with pytest.raises(TransportError):
            client.collective_rpc("x", timeout=1)
        t0 = time.monotonic()
        with pytest.raises(UpdateTimeoutError, match="not ready within 1 s"):
            client.wait_ready(timeout=1, interval=0.1)
        assert time.monotonic() - t0 < 5
        with pytest.raises(TransportError, match="went away"):
            client.wait_ready(timeout=30, interval=0.1, alive=lambda: False)


def test_connect_timeout_bounds_a_connection_the_server_never_accepts():
    # A listening socket whose accept queue is full: the kernel drops further SYNs, so connect hangs.
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fillers = []
    for _ in range(4):
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", port))
        fillers.append(c)
    try:
        with VllmClient(f"http://127.0.0.1:{port}", connect_timeout=0.5) as client:
            t0 = time.monotonic()
            with pytest.raises(UpdateTimeoutError, match=r"no connection within 0.5 s \(connect_timeout\)"):
                client.collective_rpc("x", timeout=20)
            assert time.monotonic() - t0 < 5, "connect_timeout was not applied to the request"
    finally:
        for c in fillers + [srv]:
            c.close()


def test_wait_ready_returns_once_health_answers(fake):
    assert fake.wait_ready(timeout=5) < 5


def test_bad_arguments_and_use_after_close_raise_clear_errors(fake):
    with pytest.raises(ConfigError, match="path must be one of"):
        fake.update({}, path="p2p")
    with pytest.raises(ConfigError, match="pause mode"):
        fake.pause("later")
    fake.close()
    fake.close()
    with pytest.raises(ClosedError):
        fake.collective_rpc("x")


def test_healthy_gives_up_after_one_timeout_not_two(fake):
    _Handler.routes[("GET", "/health")] = (200, {}, 1.5)
    assert not fake.healthy(timeout=0.5)
    assert [c[1] for c in _Handler.calls] == ["/health"], "a timed-out /health was sent again"


def test_a_failing_resume_never_hides_the_update_error(fake):
    _Handler.routes[("POST", "/update_weights")] = (500, {"error": {"message": "worker died"}}, 0)
    _Handler.routes[("POST", "/resume")] = (500, {"error": {"message": "resume broke"}}, 0)
    with pytest.raises(RemoteWorkerError, match="worker died") as info:
        fake.update({"K": "h"}, path="backend", pause="wait")
    assert any("resume" in n and "resume broke" in n for n in info.value.__notes__)


def test_a_refused_prefix_cache_reset_fails_the_update_loudly(fake):
    _Handler.routes[("POST", "/reset_prefix_cache")] = (200, {"success": False}, 0)
    with pytest.raises(RemoteWorkerError, match="refused to reset its prefix cache"):
        fake.ensure_prefix_cache_reset(timeout=0.5)
    assert len([c for c in _Handler.calls if c[1].startswith("/reset_prefix_cache")]) >= 2


def test_a_checkpoint_over_several_updates_needs_the_backend_and_a_pause(fake):
    with pytest.raises(ConfigError, match="needs path='backend'"):
        fake.update({"K": "h"}, path="extension", finish=False, pause="wait")
    with pytest.raises(ConfigError, match="needs a pause"):
        fake.update({"K": "h"}, path="backend", finish=False)
    fake.update({"K": "h"}, path="backend", finish=False, pause="keep")
    fake.update({"K": "h"}, path="backend", start=False, pause="keep")
    assert [c[1].split("?")[0] for c in _Handler.calls] == [
        "/pause", "/start_weight_update", "/update_weights", "/update_weights", "/finish_weight_update",
        "/reset_prefix_cache", "/resume"]
    assert [c[2]["update_info"]["check_complete"] for c in _Handler.calls if c[1] == "/update_weights"] == [False, False]


def test_a_later_part_the_workers_refused_resumes_and_leaves_the_weight_update_ended_by_them(fake):
    """The workers answered the failed /update_weights: each ended vLLM's weight update itself
    (transfer_engine.py), so the client does not post /finish_weight_update (it would fail on every
    worker); it resumes generation."""
    fake.update({"K": "h"}, path="backend", finish=False, pause="keep")
    _Handler.routes[("POST", "/update_weights")] = (500, {"error": {"message": "part 2 broke"}}, 0)
    _Handler.calls.clear()
    with pytest.raises(RemoteWorkerError, match="part 2 broke"):
        fake.update({"K": "h"}, path="backend", start=False, finish=False, pause="keep")
    assert [c[1].split("?")[0] for c in _Handler.calls] == ["/update_weights", "/resume"]
