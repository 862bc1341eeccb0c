"""The service's answers are bounded and in one format: real `ckpt-engine serve` processes (2 ranks, gloo)
on Unix sockets, one test per promise of docs/operations.md ("Errors", "Status")."""

import json
import os
import time

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
from support.data import FAULT_DTYPES, fresh_tensor  # noqa: E402
from support.service_world import metrics_world  # noqa: E402

from ckpt_core.checkpoint.safetensors import write_file  # noqa: E402
from ckpt_core.planning.capacity import host_memory_available  # noqa: E402

PEER_TIMEOUT_S = 2.0
BOUND = 64 * 1024   # no answer of the service, nor any status after it, is larger than this


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("answers"))
    w = metrics_world(tmp, env={"CKPT_HEARTBEAT_S": "0.2", "CKPT_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S)})
    w.gen = torch.Generator().manual_seed(2608)
    yield w
    assert w.close() == [0, 0]


def _file(world, name: str) -> str:
    path = os.path.join(world.tmp, f"{name}.safetensors")
    write_file(path, {f"{name}.{i}": fresh_tensor((257 + i,), FAULT_DTYPES[i % 4], world.gen) for i in range(4)})
    return path


def test_a_huge_files_list_gets_a_small_answer_and_leaves_status_small(world):
    names = [os.path.join(world.tmp, f"{'n' * 180}-{i}.safetensors") for i in range(98_000)]   # ~20 MB of names
    resp = world.clients[0].post("/v1/checkpoints/big/files", json={"files": names})
    assert resp.status_code == 422 and resp.json()["error"]["type"] == "ValidationError", resp.text[:500]
    assert len(resp.content) < BOUND, len(resp.content)
    within = names[:9_000]   # within the list's bound: every name is read, the answer still small
    resp = world.clients[0].post("/v1/checkpoints/big/files", json={"files": within})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "ConfigError", resp.text[:500]
    assert len(resp.content) < BOUND, len(resp.content)
    status = world.clients[0].get("/v1/status")
    assert len(status.content) < BOUND and status.json()["last_error"]["type"] == "ConfigError"


def test_a_deeply_nested_header_is_a_422_not_a_500(world):
    body = b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path = os.path.join(world.tmp, "deep.safetensors")
    with open(path, "wb") as f:
        f.write(len(body).to_bytes(8, "little") + body)
    resp = world.clients[0].post("/v1/checkpoints/deep/files", json={"files": [path]})
    assert resp.status_code == 422 and resp.json()["error"]["type"] == "CheckpointFormatError", resp.text[:500]
    assert "nested" in resp.json()["error"]["message"]


@pytest.mark.parametrize("method, path, code, kind", [
    ("GET", "/v1/nowhere", 404, "NotFound"),
    ("GET", "/docs", 404, "NotFound"),
    ("GET", "/redoc", 404, "NotFound"),
    ("PUT", "/v1/status", 405, "MethodNotAllowed"),
    ("GET", "/v1/checkpoints/x/update", 405, "MethodNotAllowed"),
])
def test_unknown_routes_and_methods_answer_the_documented_error_body(world, method, path, code, kind):
    resp = world.clients[0].request(method, path)
    assert resp.status_code == code, resp.text
    assert set(resp.json()) == {"error"} and resp.json()["error"]["type"] == kind, resp.text
    assert path in resp.json()["error"]["message"]


def test_the_schema_is_served_and_no_page_loads_a_public_cdn(world):
    assert world.clients[0].get("/openapi.json").status_code == 200
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert "cdn" not in world.clients[0].get(path).text.lower()


@pytest.mark.parametrize("url", ["not a url", "file:///etc/passwd", "ftp://127.0.0.1/collective_rpc",
                                 "http://user:pw@127.0.0.1:1/collective_rpc"])
def test_a_bad_update_url_is_a_400_before_any_collective(world, url):
    world.all("POST", "/v1/checkpoints/u/files", [{"files": [_file(world, f"u{r}")]} for r in range(2)])
    try:
        got = world.all("POST", "/v1/checkpoints/u/update", [{"update_url": url, "timeout": 30}] * 2)
        for resp in got:
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["type"] == "ConfigError" and "update_url" in resp.json()["error"]["message"]
        assert world.clients[0].get("/v1/status").json()["running"] is None
    finally:
        world.all("DELETE", "/v1/checkpoints/u")


def test_an_update_with_no_body_takes_the_defaults(world):
    got = world.all("POST", "/v1/checkpoints/not-registered/update")   # no body at all
    for resp in got:
        assert resp.status_code == 404 and resp.json()["error"]["type"] == "CheckpointNotFoundError", resp.text


def test_last_error_has_its_time_and_status_and_a_later_success_clears_it(world):
    t0 = time.time()
    missing = os.path.join(world.tmp, "missing.safetensors")
    assert world.clients[1].post("/v1/checkpoints/e/files", json={"files": [missing]}).status_code == 400
    err = world.clients[1].get("/v1/status").json()["last_error"]
    assert err["type"] == "ConfigError" and err["operation"] == "register" and err["checkpoint"] == "e"
    assert err["status"] == 400 and t0 <= err["at_unix"] <= time.time()
    assert world.clients[1].post("/v1/checkpoints/e/files", json={"files": [_file(world, "e")]}).status_code == 200
    status = world.clients[1].get("/v1/status").json()
    assert status["last_error"] is None and status["last_success_unix"]["register"] >= err["at_unix"]
    assert world.clients[1].delete("/v1/checkpoints/e").status_code == 200


def test_a_checkpoint_larger_than_host_memory_is_refused_up_front(world):
    avail = host_memory_available()
    assert avail, "this test needs /proc/meminfo"
    n = ((2 * avail) // 4) * 4   # a sparse file: its header declares twice the host's memory
    header = json.dumps({"w": {"dtype": "F32", "shape": [n // 4], "data_offsets": [0, n]}}).encode()
    path = os.path.join(world.tmp, "huge.safetensors")
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + n)
    try:
        t0 = time.monotonic()
        resp = world.clients[0].post("/v1/checkpoints/huge/files", json={"files": [path]})
        assert resp.status_code == 400 and resp.json()["error"]["type"] == "ConfigError", resp.text
        assert "GiB of new host memory" in resp.json()["error"]["message"]
        assert time.monotonic() - t0 < 30, "refused before anything was allocated or read"
        status = world.clients[0].get("/v1/status").json()
        assert "huge" not in status["checkpoints"] and status["healthy"]
    finally:
        os.unlink(path)


def test_a_collective_posted_to_one_rank_says_whom_it_waits_for(world):
    world.all("POST", "/v1/checkpoints/w/files", [{"files": [_file(world, f"w{r}")]} for r in range(2)])
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=world.socks[0]), base_url="http://ps", timeout=120) as c:
            import threading
            box = {}
            t = threading.Thread(target=lambda: box.update(r=c.post("/v1/checkpoints/w/gather-metas")))
            t.start()
            deadline, running = time.monotonic() + PEER_TIMEOUT_S + 20, None
            while time.monotonic() < deadline:
                running = world.clients[0].get("/v1/status").json()["running"]
                if running and running.get("waiting_for"):
                    break
                time.sleep(0.2)
            assert running and running["operation"] == "gather" and running["waiting_for"] == [1], running
            with open(world.logs[0]) as f:
                assert "waiting for rank(s) [1]" in f.read()
            late = world.clients[1].post("/v1/checkpoints/w/gather-metas")   # the peer joins: both finish
            t.join(120)
        assert late.status_code == 200 and box["r"].status_code == 200, (late.text, box["r"].text)
        assert world.clients[0].get("/v1/status").json()["running"] is None
    finally:
        world.all("DELETE", "/v1/checkpoints/w")


def test_metrics_are_also_on_an_opt_in_localhost_port_per_rank(world):
    for r in range(2):
        text = httpx.get(f"http://127.0.0.1:{world.metrics_port + r}/metrics", timeout=30).text
        assert f'ckpt_healthy{{rank="{r}"}} 1.0' in text and "ckpt_registered_bytes" in text, text[:2000]
    from ckpt_core.ops.sockets import listening_sockets
    ports = {p: a for a, p in listening_sockets(world.procs[0].pid)}
    assert ports.get(world.metrics_port) == "127.0.0.1", ports


def test_client_mistakes_are_rejections_logged_as_warnings_not_failures(world):
    missing = os.path.join(world.tmp, "also-missing.safetensors")
    assert world.clients[0].post("/v1/checkpoints/m/files", json={"files": [missing]}).status_code == 400
    text = world.clients[0].get("/metrics").text
    assert 'ckpt_operations_total{operation="register",outcome="rejected",rank="0"}' in text
    assert 'ckpt_operation_failures_total{error="ConfigError"' not in text
    with open(world.logs[0]) as f:
        lines = [ln for ln in f if "checkpoint=m " in ln and "outcome=rejected" in ln]
    assert lines and " WARNING " in lines[-1] and " ERROR " not in lines[-1], lines
