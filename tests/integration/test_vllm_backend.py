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
from vllm_support.fixtures import MAX_TOKENS, broken_copy, push, start_server, tiny_tied_model, vllm_python  # noqa: F401

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
