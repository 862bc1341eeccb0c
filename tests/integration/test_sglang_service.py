"""The operator service drives SGLang: a controller talks HTTP only, to `ckpt-engine serve --wire stock`.

Chain under test: httpx on the service's Unix socket -> a real ``ckpt-engine serve --wire stock
--device cpu`` process (one rank) -> its ParameterServer on the stock wire -> ``SglangClient``
posting ``/update_weights_from_ipc`` into SGLang's real FastAPI app -> SGLang's weight-update
managers and checkpoint-engine extension -> the stock ``checkpoint_engine.worker`` (PyPI 0.4.2)
-> SGLang's real ``Qwen2ForCausalLM.load_weights`` (see sglang_support/engine.py for what is
stood in on CPU). Every SGLang parameter is compared bit for bit with the pushed checkpoint.
"""

from __future__ import annotations

import json
import os
import socket
import threading

import pytest

pytest.importorskip("fastapi")
from support.ports import free_port  # noqa: E402
from support.service_world import ServiceWorld  # noqa: E402
from sglang_support.fixtures import ready_engine, write_checkpoint  # noqa: E402

BUCKET_GB = str(100_000 / (1 << 30))   # ~100 KiB buckets: the 0.4 MB model travels in several, over 2 slots


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-svc")
    with ready_engine(root) as eng:
        yield eng, root


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("svc-stock"))
    # the operator allows the checkpoints' directory and the one engine socket the uds test posts over
    w = ServiceWorld(1, tmp, extra=["--wire", "stock", "--max-bucket-gb", BUCKET_GB,
                                    "--engine-uds", os.path.join(tmp, "sglang.sock")],
                     env={"PS_NUM_SLOTS": "2"}, allow_dirs=(str(tmp_path_factory.getbasetemp()),))
    yield w
    assert w.close() == [0], "the service stops cleanly on SIGTERM"


def _register(service, name: str, ckpt) -> None:
    files = sorted(str(p) for p in ckpt.glob("*.safetensors"))
    for path in (f"/v1/checkpoints/{name}/files", f"/v1/checkpoints/{name}/gather-metas"):
        resp = service.clients[0].post(path, json={"files": files} if path.endswith("files") else None)
        assert resp.status_code == 200, resp.text


def _update(service, name: str, url: str, **body):
    return service.clients[0].post(f"/v1/checkpoints/{name}/update",
                                   json=dict(engine="sglang", update_url=url, timeout=120, **body))


def _holds(eng, want: dict) -> list[str]:
    """Names of SGLang parameters that differ from ``want`` (every parameter must be covered)."""
    params = eng.state()["params"]
    assert params.keys() == want.keys(), "every parameter of the model is covered"
    return [n for n in want if params[n] != want[n]]


def test_the_service_updates_every_sglang_parameter_and_a_second_checkpoint_switches(engine, service):
    eng, root = engine
    assert service.clients[0].get("/v1/status").json()["wire"] == "stock"
    before, flushes = eng.state()["params"], eng.state()["flushes"]
    for seed, version in ((11, "v1"), (12, "v2")):
        ckpt, want = write_checkpoint(root / f"svc-{seed}", seed=seed)
        _register(service, f"step-{seed}", ckpt)
        resp = _update(service, f"step-{seed}", eng.url, weight_version=version)
        assert resp.status_code == 200, resp.text
        assert resp.json()["result"]["buckets"] >= 4, resp.json()
        assert not _holds(eng, want), f"step {seed}: SGLang's parameters differ from the pushed checkpoint"
        assert eng.state()["weight_version"] == version
        assert eng.state()["flushes"] > flushes, "flush_cache defaults to true"
        flushes = eng.state()["flushes"]
        assert service.clients[0].delete(f"/v1/checkpoints/step-{seed}").status_code == 200
    assert all(before[n] != want[n] for n in want), "the start weights already equalled the checkpoint"
    status = service.clients[0].get("/v1/status").json()
    assert status["updates"] >= 2 and status["running"] is None


def test_a_refusing_sglang_url_is_a_typed_5xx_and_the_next_update_succeeds(engine, service):
    eng, root = engine
    ckpt, want = write_checkpoint(root / "svc-refused", seed=13)
    _register(service, "refused", ckpt)
    before = eng.state()["params"]
    resp = _update(service, "refused", f"http://127.0.0.1:{free_port()}", weight_version="never")
    assert resp.status_code == 502, resp.text
    err = resp.json()["error"]
    # the remote text (naming the route: the update's first call, which opens SGLang's weight-update
    # session) is in remote_traceback, the message says where it failed
    assert err["type"] == "RemoteWorkerError" and "/begin_weight_update" in (
        err["message"] + (err.get("remote_traceback") or "")), err
    assert eng.state()["params"] == before and eng.state()["weight_version"] != "never", "nothing was loaded"
    assert service.clients[0].get("/v1/healthz").status_code == 200
    # slices on the stock wire: refused by the service before any engine is asked (SGLang's receiver has no boxes)
    resp = service.clients[0].post("/v1/checkpoints/refused/update", json={"slices": True})
    assert resp.status_code == 400 and "slices need a parameter server speaking our own wire" in resp.text, resp.text
    resp = _update(service, "refused", eng.url, weight_version="after-refusal")
    assert resp.status_code == 200, resp.text
    assert not _holds(eng, want) and eng.state()["weight_version"] == "after-refusal"
    assert service.clients[0].delete("/v1/checkpoints/refused").status_code == 200


def test_a_model_sglang_cannot_reload_is_a_400_config_error_and_nothing_is_loaded(engine, service):
    """The service's SGLang update carries the client's precheck: a served model of FP8 per tensor
    (its config.json, read where /model_info says) is refused before anything moves, as a 400
    ConfigError naming the rank, the server keeps its weights, and the next update works."""
    eng, root = engine
    config = root / "model" / "config.json"
    saved = config.read_text()
    ckpt, want = write_checkpoint(root / "svc-fp8", seed=15)
    _register(service, "fp8", ckpt)
    before = eng.state()["params"]
    try:
        config.write_text(json.dumps({**json.loads(saved), "quantization_config": {
            "quant_method": "fp8", "activation_scheme": "dynamic"}}))
        resp = _update(service, "fp8", eng.url, weight_version="never")
    finally:
        config.write_text(saved)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "ConfigError" and "refused on rank(s) [0]" in err["message"] \
        and "FP8 per tensor" in err["message"], err
    assert eng.state()["params"] == before and eng.state()["weight_version"] != "never", "nothing was loaded"
    resp = _update(service, "fp8", eng.url, weight_version="after-fp8-refusal")
    assert resp.status_code == 200, resp.text
    assert not _holds(eng, want) and eng.state()["weight_version"] == "after-fp8-refusal"
    assert service.clients[0].delete("/v1/checkpoints/fp8").status_code == 200


class _UnixToTcp:
    """A Unix socket forwarding every connection to a TCP port (SGLang serves TCP only)."""

    def __init__(self, path: str, port: int):
        self.path, self.port = path, port
        self.connections = 0
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            upstream = socket.create_connection(("127.0.0.1", self.port), timeout=60)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()
        os.unlink(self.path)


def test_uds_reaches_sglang_over_a_unix_socket_with_flush_cache_off(engine, service, tmp_path):
    eng, root = engine
    ckpt, want = write_checkpoint(root / "svc-uds", seed=14)
    _register(service, "uds", ckpt)
    flushes = eng.state()["flushes"]
    proxy = _UnixToTcp(os.path.join(service.tmp, "sglang.sock"), eng.port)   # the socket --engine-uds allows
    try:
        # the host is not resolvable: only the unix socket can lead to the server
        resp = _update(service, "uds", "http://sglang.invalid/update_weights_from_ipc", uds=proxy.path,
                       weight_version="over-uds", flush_cache=False)
        assert resp.status_code == 200, resp.text
        assert proxy.connections >= 1
    finally:
        proxy.close()
    assert not _holds(eng, want) and eng.state()["weight_version"] == "over-uds"
    assert eng.state()["flushes"] == flushes, "flush_cache=false reached SGLang: no cache flush"
    assert service.clients[0].delete("/v1/checkpoints/uds").status_code == 200


def test_engine_sglang_on_a_native_wire_service_is_refused_and_bad_fields_are_422(tmp_path):
    w = ServiceWorld(1, str(tmp_path))
    try:
        c = w.clients[0]
        assert c.get("/v1/status").json()["wire"] == "native"
        resp = c.post("/v1/checkpoints/x/update", json={"engine": "sglang", "update_url": "http://127.0.0.1:1"})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["type"] == "ConfigError" and "--wire stock" in err["message"], err
        for body, field in (({"engine": "trtllm"}, "engine"), ({"weight_version": "v1"}, "weight_version"),
                            ({"engine": "vllm", "flush_cache": False}, "flush_cache"),
                            ({"engine": "sglang", "weight_version": 7}, "weight_version")):
            resp = c.post("/v1/checkpoints/x/update", json=body)
            assert resp.status_code == 422, (body, resp.text)
            assert resp.json()["error"]["type"] == "ValidationError" and field in resp.json()["error"]["message"]
        schema = c.get("/openapi.json").json()["components"]["schemas"]["UpdateRequest"]["properties"]
        assert schema["engine"]["enum"] == ["vllm", "sglang"] and schema["engine"]["default"] == "vllm"
        assert {"weight_version", "flush_cache"} <= schema.keys()
        assert c.get("/v1/healthz").status_code == 200
    finally:
        assert w.close() == [0]
