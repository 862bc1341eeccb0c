"""The HTTP service: real `ckpt-engine serve` processes (2 ranks, gloo) on Unix sockets, driven with httpx."""

import os
import stat
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
from support.data import FAULT_DTYPES, fresh_tensor, want_digests  # noqa: E402
from support.service_world import HttpEngineFront, ServiceWorld  # noqa: E402
from ckpt_core.checkpoint.safetensors import write_file  # noqa: E402

BUCKET_GB = "0.00005"   # ~52 KiB buckets: every update has several, so a slow engine is slow per bucket


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("svc"))
    w = ServiceWorld(2, tmp, extra=["--max-bucket-gib", BUCKET_GB])
    front = HttpEngineFront(2)
    w.front, w.gen = front, torch.Generator().manual_seed(1601)
    yield w
    front.close()
    codes = w.close()
    assert codes == [0, 0], f"serve processes should stop cleanly on SIGTERM: {codes}"
    assert not any(os.path.exists(s) for s in w.socks), "the socket files are removed on exit"


def _files(world, name: str) -> tuple[list[str], dict]:
    """One fresh safetensors file per rank; returns the paths and the digests the engines must hold."""
    paths, data = [], {}
    for r in range(world.size):
        ts = {f"{name}.r{r}.{i}": fresh_tensor((300 + 97 * i,), FAULT_DTYPES[i % 4], world.gen) for i in range(8)}
        p = os.path.join(world.tmp, f"{name}-{r}.safetensors")
        write_file(p, ts)
        paths.append(p)
        data.update(ts)
    return paths, want_digests(data)


def _register_and_gather(world, name: str) -> dict:
    paths, want = _files(world, name)
    got = world.all("POST", f"/v1/checkpoints/{name}/files", [{"files": [p]} for p in paths])
    assert [r.status_code for r in got] == [200, 200], [r.text for r in got]
    got = world.all("POST", f"/v1/checkpoints/{name}/gather-metas")
    assert [r.status_code for r in got] == [200, 200], [r.text for r in got]
    return want


def _update(world, name: str, **body):
    """The reference's contract: every rank's service gets the update; the one engine's request is
    posted by rank 0 only (the only rank given ``update_url``), with every rank's handles."""
    bodies = [dict({"timeout": 60}, **body) for _ in range(world.size)]
    bodies[0]["update_url"] = world.front.url
    return world.all("POST", f"/v1/checkpoints/{name}/update", bodies)


def _engines_hold(world, want: dict) -> bool:
    held = {}
    for i in range(world.size):
        held.update(world.front.engine.digests(i))
    return all(held.get(k) == v for k, v in want.items())


def test_the_unix_sockets_are_private_to_their_owner(world):
    for s in world.socks:
        st = os.stat(s)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)


def test_register_gather_and_update_deliver_every_tensor_and_show_in_status_and_metrics(world):
    want = _register_and_gather(world, "step-1")
    got = _update(world, "step-1")
    assert [r.status_code for r in got] == [200, 200], [r.text for r in got]
    assert got[0].json()["result"]["bytes"] == got[1].json()["result"]["bytes"] > 0
    assert _engines_hold(world, want), "every engine worker holds exactly the registered bytes"
    status = world.clients[1].get("/v1/status").json()
    assert status["rank"] == 1 and status["world_size"] == 2 and "step-1" in status["checkpoints"]
    assert status["running"] is None and status["last_update"]["name"] == "step-1" and status["healthy"]
    assert set(status["last_update"]["seconds"]) >= {"plan", "handshake", "pipeline", "total"}
    metas = world.clients[0].get("/v1/metas").json()
    owners = metas["checkpoints"]["step-1"]["owners"]
    assert sorted(t[0] for owner in owners for t in owner["tensors"]) == sorted(want)
    text = world.clients[0].get("/metrics").text
    assert 'ckpt_operations_total{operation="update",outcome="ok",rank="0"}' in text
    assert "ckpt_update_bytes_total" in text and 'ckpt_last_update_phase_seconds{phase="pipeline",rank="0"}' in text
    got = world.all("DELETE", "/v1/checkpoints/step-1")
    assert [r.status_code for r in got] == [200, 200]
    assert "step-1" not in world.clients[0].get("/v1/status").json()["checkpoints"]


def test_health_and_status_answer_during_a_slow_update_and_a_second_update_is_a_409(world):
    want = _register_and_gather(world, "slow")
    for i in range(2):
        world.front.engine.set_behavior(i, {"sleep_s": 0.4})
    try:
        results = {}
        t = threading.Thread(target=lambda: results.update(r=_update(world, "slow")))
        t.start()
        deadline = time.monotonic() + 60
        while True:
            running = world.clients[0].get("/v1/status").json()["running"]
            if running and running["operation"] == "update" and running["phase"] == "transfer":
                break
            assert time.monotonic() < deadline and t.is_alive(), "the update never showed up as running"
            time.sleep(0.05)
        t0 = time.monotonic()
        health = world.clients[0].get("/v1/healthz")
        second = world.clients[0].post("/v1/checkpoints/slow/update", json={"timeout": 30})
        answered = time.monotonic() - t0
        still = world.clients[0].get("/v1/status").json()["running"]
        t.join(120)
    finally:
        for i in range(2):
            world.front.engine.set_behavior(i, {})
    assert health.status_code == 200 and answered < 10, "health answers while the update runs (event loop free)"
    assert second.status_code == 409 and second.json()["error"]["type"] == "Conflict", second.text
    assert "update of 'slow' is running" in second.json()["error"]["message"]
    assert still is not None and still["checkpoint"] == "slow", "the first update was still running"
    assert 1 <= running["done"] <= running["total"] and running["total"] >= 2, running
    assert running["elapsed_s"] >= 0 and running["started_unix"] > 0
    assert [r.status_code for r in results["r"]] == [200, 200], [r.text for r in results["r"]]
    assert _engines_hold(world, want)


@pytest.mark.parametrize("route, body, code, kind, needle", [
    ("/v1/checkpoints/c/files", {"files": "not-a-list"}, 422, "ValidationError", "files"),
    ("/v1/checkpoints/c/files", {"files": ["/x"], "bogus": 1}, 422, "ValidationError", "bogus"),
    ("/v1/checkpoints/c/files", {"files": ["/nonexistent/a.safetensors"]}, 403, "Forbidden", "--allow-dir"),
    ("/v1/checkpoints/c/update", {"timeout": -1}, 422, "ValidationError", "timeout"),
    ("/v1/checkpoints/c/update", {"timeout": "soon"}, 422, "ValidationError", "timeout"),
    ("/v1/metas", ["not", "an", "object"], 422, "ValidationError", "body"),
    ("/v1/metas", {"c": [[{"name": 1}]]}, 400, "ConfigError", "format"),
])
def test_bad_requests_are_4xx_with_a_json_body_naming_the_problem(world, route, body, code, kind, needle):
    # the update is collective: its refusal is agreed by every rank, each asked (test_service_agree.py)
    got = world.all("POST", route, [body] * world.size) if route.endswith("/update") else \
        [world.clients[0].post(route, json=body)]
    for resp in got:
        assert resp.status_code == code, resp.text
        err = resp.json()["error"]
        assert err["type"] == kind and needle in err["message"], err


def test_a_missing_file_inside_the_allowed_directory_is_a_400_naming_it(world):
    missing = os.path.join(world.tmp, "missing.safetensors")
    resp = world.clients[0].post("/v1/checkpoints/c/files", json={"files": [missing]})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "ConfigError", resp.text
    assert missing in resp.json()["error"]["message"]


def test_an_update_of_an_unregistered_checkpoint_is_a_404_on_every_rank(world):
    got = world.all("POST", "/v1/checkpoints/never/update", [{"timeout": 30}] * world.size)   # collective
    for resp in got:
        assert resp.status_code == 404 and resp.json()["error"]["type"] == "CheckpointNotFoundError", resp.text
        assert "never" in resp.json()["error"]["message"]


def test_a_hostile_checkpoint_file_is_a_422_naming_the_file_and_nothing_is_registered(world):
    bad = os.path.join(world.tmp, "hostile.safetensors")
    with open(bad, "wb") as f:
        f.write((10 ** 12).to_bytes(8, "little") + b"{}")
    resp = world.clients[0].post("/v1/checkpoints/hostile/files", json={"files": [bad]})
    assert resp.status_code == 422 and resp.json()["error"]["type"] == "CheckpointFormatError", resp.text
    assert bad in resp.json()["error"]["message"]
    assert "hostile" not in world.clients[0].get("/v1/status").json()["checkpoints"]


def test_misuse_of_a_registered_checkpoint_is_a_400(world):
    _register_and_gather(world, "misuse")
    try:
        for body, needle in (({"inference_group_ranks": [5]}, "outside this world"),):
            for resp in world.all("POST", "/v1/checkpoints/misuse/update", [body] * world.size):
                assert resp.status_code == 400 and resp.json()["error"]["type"] == "ConfigError", resp.text
                assert needle in resp.json()["error"]["message"]
    finally:
        world.all("DELETE", "/v1/checkpoints/misuse")


def test_an_engine_failure_is_a_502_on_every_rank_carrying_the_rank_and_traceback_and_the_next_update_works(world):
    want = _register_and_gather(world, "fails")
    world.front.engine.set_behavior(1, {"fail_bucket": 0})
    try:
        got = _update(world, "fails")
    finally:
        world.front.engine.set_behavior(1, {})
    for resp in got:
        assert resp.status_code == 502, resp.text
        err = resp.json()["error"]
        assert err["type"] == "RemoteWorkerError" and err["rank"] == 1, err
        assert "injected engine failure at bucket 0" in err["remote_traceback"]
        assert "--- remote traceback ---" not in err["message"], "the traceback is in remote_traceback only"
    status = world.clients[0].get("/v1/status").json()
    assert status["last_error"]["type"] == "RemoteWorkerError" and status["failures"] >= 1
    assert 'ckpt_operation_failures_total{error="RemoteWorkerError",operation="update",rank="0"}' in \
        world.clients[0].get("/metrics").text
    got = _update(world, "fails")
    assert [r.status_code for r in got] == [200, 200], [r.text for r in got]
    assert _engines_hold(world, want)


def test_the_openapi_schema_lists_the_reference_routes(world):
    paths = world.clients[0].get("/openapi.json").json()["paths"]
    for p in ("/v1/checkpoints/{name}/files", "/v1/checkpoints/{name}", "/v1/checkpoints/{name}/gather-metas",
              "/v1/checkpoints/{name}/update", "/v1/healthz", "/v1/metas", "/v1/status", "/metrics"):
        assert p in paths, p
    assert set(paths["/v1/metas"]) == {"get", "post"}


def _metric(text: str, name: str, **labels) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_metrics_and_logs_say_what_each_rank_moved_when_and_which_checkpoint(world):
    before = [_metric(c.get("/metrics").text, "ckpt_update_bytes_total", rank=r) or 0.0
              for r, c in enumerate(world.clients)]
    want = _register_and_gather(world, "observed")
    t0 = time.time()
    got = _update(world, "observed")
    assert [r.status_code for r in got] == [200, 200], [r.text for r in got]
    results = [r.json()["result"] for r in got]
    texts = [c.get("/metrics").text for c in world.clients]
    moved = [_metric(t, "ckpt_update_bytes_total", rank=r) - before[r] for r, t in enumerate(texts)]
    assert moved == [res["h2d_bytes"] for res in results] and all(m > 0 for m in moved), moved
    assert sum(moved) == results[0]["bytes"], "a sum over ranks counts each model byte once"
    statuses = [c.get("/v1/status").json() for c in world.clients]
    for r, (text, status) in enumerate(zip(texts, statuses)):
        assert _metric(text, "ckpt_last_success_timestamp_seconds", operation="update", rank=r) >= t0 - 1
        assert _metric(text, "ckpt_checkpoint_info", checkpoint="observed", rank=r, weight_version="") == 1
        assert _metric(text, "ckpt_registered_bytes", rank=r) == status["registered_bytes"] > 0
        assert _metric(text, "ckpt_healthy", rank=r) == 1
        assert status["last_success_unix"]["update"] >= t0 - 1
    with open(world.logs[0]) as f:
        log = f.read()
    registered = world.clients[0].get("/v1/status").json()["last_register"]["bytes"]
    assert f"phase=update checkpoint=observed outcome=started bytes={registered}" in log, log[-3000:]
    assert "phase=register checkpoint=observed outcome=ok bytes=-" not in log
    assert f"phase=register checkpoint=observed outcome=ok bytes={registered} " in log, log[-3000:]
    assert _engines_hold(world, want)
    world.all("DELETE", "/v1/checkpoints/observed")


def test_a_slice_plan_the_posting_rank_cannot_record_fails_every_rank_naming_it_and_the_next_update_works(world):
    """``slices: true`` with an engine that cannot record a plan (this front is not vLLM): the rank
    that asked it says why, every rank's update fails with it before anything moves (no rank waits
    for a plan that never comes), the engines keep what they held, and a whole update then works."""
    want = _register_and_gather(world, "sliced")
    requests = world.front.requests
    t0 = time.monotonic()
    got = _update(world, "sliced", slices=True)
    assert time.monotonic() - t0 < 30, "both ranks failed at once, not at the update's timeout"
    assert [r.status_code for r in got] == [400, 400], [r.text for r in got]
    for r in got:
        err = r.json()["error"]
        assert err["type"] == "ConfigError" and "no slice plan to share: rank 0: RemoteWorkerError" in err["message"]
    assert world.front.requests == requests + 1, "only the recording was asked of the engine"
    held = {k for i in range(world.size) for k in world.front.engine.digests(i)}
    assert not held & set(want), "nothing of the failed update reached an engine"
    assert [r.status_code for r in _update(world, "sliced")] == [200, 200]
    assert _engines_hold(world, want)
    world.all("DELETE", "/v1/checkpoints/sliced")
    for bad in world.all("POST", "/v1/checkpoints/x/update", [{"slices": True, "engine": "sglang"}] * world.size):
        assert bad.status_code == 422 and "slices does not apply to engine='sglang'" in bad.text


def test_the_operators_ckpt_slices_0_turns_a_sliced_request_into_a_whole_update_said_once(tmp_path):
    """``CKPT_SLICES=0`` on the service: a request for slices updates whole tensors (the engine here
    could not even record a plan), its result carries no slice figures, and the log says why, once."""
    w = ServiceWorld(2, str(tmp_path), env={"CKPT_SLICES": "0"})
    front = HttpEngineFront(2)
    w.front, w.gen = front, torch.Generator().manual_seed(1602)
    try:
        for step in ("off-1", "off-2"):
            want = _register_and_gather(w, step)
            got = _update(w, step, slices=True)
            assert [r.status_code for r in got] == [200, 200], [r.text for r in got]
            assert all("slices" not in r.json()["result"] for r in got)
            assert _engines_hold(w, want)
    finally:
        front.close()
        assert w.close() == [0, 0]
    for log in w.logs:
        with open(log) as f:
            assert f.read().count("slices were asked for, but CKPT_SLICES=0 turns them off") == 1


def _documented_metas() -> dict:
    """The JSON example under docs/operations.md's "The metas document"."""
    import json
    import re
    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "operations.md")).read()
    section = text[text.index("### The metas document"):]
    return json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))


def _shape(value):
    """Keys and types, not values: a dict's keys (a checkpoint name stands for any), a list of alike
    items as one, a row of unlike items item by item."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        shapes = [_shape(v) for v in value]
        return ["list of", shapes[0]] if shapes and all(s == shapes[0] for s in shapes) else shapes
    return type(value).__name__


def test_get_v1_metas_serves_the_document_operations_md_shows_and_post_takes_it_back(world):
    documented = _documented_metas()
    _register_and_gather(world, "metas-doc")
    served = world.clients[0].get("/v1/metas").json()
    try:
        assert served["checkpoints"]["metas-doc"]["owners"][1]["rank"] == 1, "every owner rank is listed"
        doc_ckpt = next(iter(documented["checkpoints"].values()))
        assert _shape({**documented, "checkpoints": None}) == _shape({**served, "checkpoints": None})
        assert _shape(doc_ckpt) == _shape(served["checkpoints"]["metas-doc"]), (doc_ckpt, served)
        got = world.all("POST", "/v1/metas", [served] * world.size)
        assert [r.status_code for r in got] == [200, 200], [r.text for r in got]
        bad = world.clients[0].post("/v1/metas", json={**served, "format": "someone-else/metas"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "ConfigError", bad.text
    finally:
        world.all("DELETE", "/v1/checkpoints/metas-doc")


def test_an_idle_connection_stays_open_longer_than_http_clients_keep_theirs(world):
    # httpx keeps an idle connection 5 s by default, as uvicorn kept one: a client's request leaving about 5 s
    # after the last answer could meet the service closing it ("server disconnected" on that rank, the others
    # waiting in the update's collective). The service keeps idle connections longer than that.
    import socket

    def ask(sock) -> bytes:
        sock.sendall(b"GET /v1/healthz HTTP/1.1\r\nHost: ps\r\n\r\n")
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = sock.recv(65536)
            assert chunk, "the service closed the connection"
            got += chunk
        head, _, body = got.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        while len(body) < length:
            body += sock.recv(65536)
        return head.split(b"\r\n")[0]

    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(world.socks[0])
        assert ask(sock).startswith(b"HTTP/1.1 200")
        time.sleep(6.5)   # past httpx's and uvicorn's default 5 s
        assert ask(sock).startswith(b"HTTP/1.1 200")
