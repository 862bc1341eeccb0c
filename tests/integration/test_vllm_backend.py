"""The `ckpt` weight-transfer backend, found through our `vllm.general_plugins` entry point.

The server is started with `--weight-transfer-config '{"backend": "ckpt"}'`, without our worker
extension, and listens on a Unix socket only; updates go through vLLM's own routes
(/start_weight_update, /update_weights, /finish_weight_update). The model ties lm_head to
embed_tokens: vLLM's reload alone leaves the tied lm_head's CPU-packed copy stale. Needs
CKPT_VLLM_PYTHON, and this repo installed in that venv (scripts/vllm_env.sh does it) so the
entry point is visible.
"""

import pytest

from ckpt_core.errors import RemoteWorkerError
from vllm_support.fixtures import (MAX_TOKENS, broken_copy, push, push_parts, split_copy, start_server,  # noqa: F401
                                   tiny_tied_model, vllm_python)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server(vllm_python, tiny_tied_model, tmp_path_factory):
    where = tmp_path_factory.mktemp("vllm-backend")
    srv = start_server(vllm_python, tiny_tied_model, where, extension=False, backend="ckpt", uds=where / "vllm.sock")
    try:
        yield srv
    finally:
        srv.stop()


def test_updates_through_the_native_routes_equal_the_hf_reference_and_switch(server, tiny_tied_model):
    for weights in tiny_tied_model.weights:
        push(server, [weights], path="backend")
        assert server.client.last_report.path == "backend"
        assert server.complete(tiny_tied_model.prompts, MAX_TOKENS) == tiny_tied_model.reference(weights)


def test_a_missing_tensor_fails_through_the_backend_and_the_server_keeps_serving(server, tiny_tied_model, tmp_path):
    tensor = "model.layers.1.mlp.gate_proj.weight"
    broken = broken_copy(tiny_tied_model.weights[1], tmp_path / "broken.safetensors", drop=tensor)
    with pytest.raises(RemoteWorkerError, match=f"nothing arrived for {tensor}"):
        push(server, [broken], path="backend")
    assert server.client.healthy()
    assert all(len(c) == MAX_TOKENS for c in server.complete(tiny_tied_model.prompts, MAX_TOKENS))
    push(server, [tiny_tied_model.weights[0]], path="backend")  # the next /start_weight_update works
    assert server.complete(tiny_tied_model.prompts, MAX_TOKENS) == tiny_tied_model.reference(tiny_tied_model.weights[0])


def test_the_extension_path_is_refused_clearly_when_the_server_lacks_the_extension(server, tiny_tied_model):
    with pytest.raises(RemoteWorkerError, match="update_weights_from_ipc"):
        push(server, [tiny_tied_model.weights[0]], path="extension", timeout=30)


def completions(server, model):
    return server.complete(model.prompts, MAX_TOKENS)


def _serves(server, model, weights):
    """The server is alive and still answers exactly from ``weights``."""
    assert server.alive() and server.client.healthy()
    assert completions(server, model) == model.reference(weights)


@pytest.mark.parametrize("handles", [{"CPU-not-this-machine-7": "ipc://@nobody"}, {}],
                         ids=["foreign-device-key", "no-handles"])
def test_an_update_refused_before_the_receive_leaves_the_old_weights_serving(server, tiny_tied_model, handles):
    model, client = tiny_tied_model, server.client
    push(server, [model.weights[0]], path="backend")
    client._post("/start_weight_update")
    with pytest.raises(RemoteWorkerError):
        client._post("/update_weights", {"update_info": {"zmq_handles": handles, "timeout_s": 30}})
    _serves(server, model, model.weights[0])   # this request killed the engine before
    push(server, [model.weights[1]], path="backend")
    _serves(server, model, model.weights[1])


def test_init_weight_transfer_engine_sets_the_timeout_and_refuses_a_bad_one(server, tiny_tied_model):
    model = tiny_tied_model
    push(server, [model.weights[0]], path="backend", init_info={"timeout_s": 60})
    assert "init" in server.client.last_report.seconds
    _serves(server, model, model.weights[0])
    with pytest.raises(RemoteWorkerError, match="timeout_s must be positive"):
        server.client._post("/init_weight_transfer_engine", {"init_info": {"timeout_s": -1}})
    push(server, [model.weights[1]], path="backend")
    _serves(server, model, model.weights[1])


def test_one_checkpoint_over_two_updates_equals_the_reference(server, tiny_tied_model, tmp_path):
    model = tiny_tied_model
    push(server, [model.weights[0]], path="backend")
    parts = split_copy(model.weights[1], tmp_path)
    push_parts(server, [[p] for p in parts], path="backend", pause="wait")
    assert not server.client.is_paused()
    _serves(server, model, model.weights[1])


def test_a_tensor_sent_twice_in_one_weight_update_is_refused_before_it_is_loaded(server, tiny_tied_model):
    model = tiny_tied_model
    push(server, [model.weights[0]], path="backend")
    with pytest.raises(RemoteWorkerError, match="sends .* again: .* already received in this weight update"):
        push_parts(server, [[model.weights[1]], [model.weights[1]]], path="backend", pause="wait")
    assert not server.client.is_paused()
    # Before, the repeat was written into the live weights, then failed with a shape error. Now
    # the session is aborted (layers the first part completed hold its weights): push again.
    assert server.alive() and all(len(c) == MAX_TOKENS for c in completions(server, model))
    push(server, [model.weights[0]], path="backend")
    _serves(server, model, model.weights[0])


def test_after_a_failed_finish_the_next_update_starts(server, tiny_tied_model, tmp_path):
    model = tiny_tied_model
    push(server, [model.weights[0]], path="backend")
    tensor = "model.layers.0.mlp.down_proj.weight"
    first, second = split_copy(model.weights[1], tmp_path)
    holder = first if tensor in _names(first) else second
    broken = broken_copy(holder, tmp_path / "broken.safetensors", drop=tensor)
    parts = [[broken], [second]] if holder is first else [[first], [broken]]
    with pytest.raises(RemoteWorkerError, match=f"nothing arrived for {tensor}"):
        push_parts(server, parts, path="backend", pause="wait")
    assert not server.client.is_paused()
    assert server.alive() and all(len(c) == MAX_TOKENS for c in completions(server, model))
    push(server, [model.weights[0]], path="backend")   # /start_weight_update was refused here before
    _serves(server, model, model.weights[0])


def _names(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return set(f.keys())
