"""A real vLLM on a GPU: after every update the engine equals a cold load, byte for byte.

The offline engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), started with
dummy weights and our worker extension; a one-rank CUDA ParameterServer in the same process pushes
checkpoints A, B, A, B through ``llm.collective_rpc("update_weights_from_ipc", ...)`` (the call
``/collective_rpc`` makes). After each update every parameter, buffer and derived kernel tensor
(``ckpt_state_digests``) must equal a cold load of that checkpoint in the same vLLM (computed in
a subprocess by tests/integration/vllm_support/cold_load.py), and greedy tokens must equal the
cold load's. Models (each quantized here from random bf16 weights):

- ``qwen2-bf16``, ``qwen3_moe-bf16``: the checkpoint as trained;
- ``*-fp8-block``: 128x128 blocks, ``quant_method: fp8`` with ``weight_scale_inv`` (DeepSeek/Qwen3 FP8);
- ``qwen2-fp8-tensor``: ``quant_method: fp8`` with one ``weight_scale`` per tensor;
- ``qwen2-fp8-channel``: compressed-tensors ``float-quantized``, a ``weight_scale`` per output channel;
- ``qwen2-fp8-online``: a bf16 checkpoint into ``quantization="fp8"``: the engine quantizes each
  update as it does a cold load.

The cold loads of all cases start at once in subprocesses (three at a time) while the updated
engines run here, one case after the other. Needs CUDA and vLLM (a GPU build, e.g. 0.26 with
CUDA 13); skipped without either, with the reason.

    PYTHONPATH=<folder with vLLM>:<repo> NCCL_NVLS_ENABLE=0 python -m pytest -q tests/gpu/test_vllm_gpu.py
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_vllm._stage_polls import llm_rpc, prepare_staged, wait_staged

pytestmark = [pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
SUPPORT = REPO / "tests" / "integration" / "vllm_support"
EXTENSION = "ckpt_vllm.worker.VllmColocateWorkerExtension"
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_USE_DEEP_GEMM": "0",
              "NCCL_NVLS_ENABLE": "0", "HF_HUB_OFFLINE": "1"}
# vllm.LLM arguments of both engines, the updated one and the cold loads.
# A fixed 256 MiB KV cache: several engines share the GPU (cold loads run beside the updated engine).
ENGINE_KWARGS = {"gpu_memory_utilization": 0.15, "max_model_len": 256, "enforce_eager": True, "dtype": "bfloat16",
                 "seed": 0, "kv_cache_memory_bytes": 256 << 20}
MAX_TOKENS = 12
# With the default (bf16) KV cache, vLLM 0.26 leaves the attention layers' KV scales at their
# dummy-start values (a cold load sets 1.0; no checkpoint here carries them). The attention backend
# reads them only for an FP8 KV cache, which these engines do not use (asserted below), and the
# greedy tokens equal the cold load's. Every other tensor must be equal.
UNUSED_WITH_BF16_KV = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale", "<_k_scale_cpu>", "<_v_scale_cpu>")
# The MoE cases first: the engines share this process, and vLLM creates its expert-parallel group
# only when the first engine of a process is an MoE model (a later MoE engine fails without it).
CASES = ["qwen3_moe-bf16", "qwen3_moe-fp8-block", "qwen2-bf16", "qwen2-fp8-block", "qwen2-fp8-tensor",
         "qwen2-fp8-channel", "qwen2-fp8-online"]
if os.environ.get("CKPT_GPU_VLLM_CASES"):   # a comma-separated subset, e.g. to rerun one case
    CASES = [c for c in CASES if c in os.environ["CKPT_GPU_VLLM_CASES"].split(",")]
COLD_AT_ONCE = 3


def _requirements() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs a GPU build of vLLM importable (e.g. PYTHONPATH=<folder with vLLM>:<repo>; docs/vllm.md)")


@pytest.fixture(scope="module")
def engine_env():
    _requirements()
    saved = {k: os.environ.get(k) for k in ENGINE_ENV}
    os.environ.update(ENGINE_ENV)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _tiny_model():
    spec = importlib.util.spec_from_file_location("tiny_model", SUPPORT / "tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_case(case: str, out: Path, seed: int) -> tuple[Path, list[Path], dict]:
    """The model directory, its two checkpoints (A, B) and the engine's extra arguments for ``case``."""
    family, kind = case.split("-", 1)
    overrides = {}
    if kind in ("fp8-block", "fp8-channel", "fp8-tensor"):
        # Block FP8 needs every output partition a multiple of 128: k/v of 2 heads x 64, MoE
        # intermediate 128; the others share the shapes.
        overrides = {"num_key_value_heads": 2}
        if family == "qwen3_moe":
            overrides["moe_intermediate_size"] = 128
    _tiny_model().build(out, seed, variants=2, family=family, overrides=overrides)
    weights = [out / "weights-0.safetensors", out / "weights-1.safetensors"]
    for w in weights:
        convert_checkpoint(w, kind)
    config = json.loads((out / "config.json").read_text())
    if kind in QUANT_CONFIGS:
        config["quantization_config"] = QUANT_CONFIGS[kind]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "model.safetensors").unlink()   # dummy start: the directory needs no weights of its own
    return out, weights, ({"quantization": "fp8"} if kind == "fp8-online" else {})


QUANT_CONFIGS = {
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]},
    "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"},
    "fp8-channel": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                  "dynamic": True}}}},
}


def _quantized(name: str) -> bool:
    """The linear layers of the decoder (attention, MLP, experts and the MoE router: vLLM 0.26
    builds Qwen3-MoE's ``mlp.gate`` with the model's quantization); not norms or embeddings."""
    return (name.endswith("_proj.weight") or name.endswith(".mlp.gate.weight")) and ".layers." in name


def convert_checkpoint(path: Path, kind: str) -> None:
    """Rewrite ``path`` (float32 as saved) in the format of ``kind``, experts one tensor each."""
    import torch
    from safetensors.torch import load_file, save_file

    out = {}
    for name, t in per_expert(load_file(str(path))).items():
        if not t.is_floating_point():
            out[name] = t
        elif kind.startswith("fp8-") and kind != "fp8-online" and _quantized(name):
            q, scale = QUANTIZERS[kind](t)
            suffix = "weight_scale_inv" if kind == "fp8-block" else "weight_scale"
            out[name], out[name.removesuffix("weight") + suffix] = q, scale
        else:
            out[name] = t.to(torch.bfloat16)
    save_file(out, str(path))


def per_expert(tensors: dict) -> dict:
    """Experts one tensor each (``...experts.3.gate_proj.weight``), as Qwen3-MoE checkpoints ship;
    transformers 5 saves them fused (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            base, half = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :half].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, half:].contiguous()
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def quantize_block(w, block: int = 128):
    """(float8_e4m3fn weight, float32 ``weight_scale_inv`` [ceil(N/128), ceil(K/128)]): w ~= q * scale."""
    import torch

    n, k = w.shape
    nb, kb = math.ceil(n / block), math.ceil(k / block)
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32)
    padded[:n, :k] = w.float()
    tiles = padded.view(nb, block, kb, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    q = (tiles / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), scale.contiguous()


def quantize_tensor(w):
    """(float8_e4m3fn weight, float32 scalar ``weight_scale``): one scale for the tensor."""
    import torch

    scale = (w.float().abs().amax() / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    return (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.reshape(())


def quantize_channel(w):
    """(float8_e4m3fn weight, float32 ``weight_scale`` [N, 1]): one scale per output channel."""
    import torch

    scale = (w.float().abs().amax(dim=1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    return (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.contiguous()


QUANTIZERS = {"fp8-block": quantize_block, "fp8-tensor": quantize_tensor, "fp8-channel": quantize_channel}


def cold_reference(model_dir: Path, weights: list[Path], prompts, engine_kwargs: dict) -> dict:
    """Digests and greedy tokens of a cold load of each checkpoint (a subprocess, engines in turn)."""
    env = {**os.environ, **ENGINE_ENV,
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    gpu = [] if engine_kwargs.get("device") == "cpu" else ["--gpu"]
    proc = subprocess.run([sys.executable, str(SUPPORT / "cold_load.py"), *gpu, "--model", str(model_dir),
                           "--dtype", "bfloat16", "--engine-kwargs",
                           json.dumps({k: v for k, v in engine_kwargs.items() if k != "device"}),
                           "--prompts", json.dumps(prompts), "--max-tokens", str(MAX_TOKENS),
                           "--weights", *map(str, weights)], capture_output=True, text=True, env=env, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"cold_load.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def differences(engine: list[dict], cold: list[dict]) -> list[str]:
    out = []
    for rank, (got, want) in enumerate(zip(engine, cold)):
        for name in sorted(set(got) | set(want)):
            if got.get(name) != want.get(name) and not name.endswith(UNUSED_WITH_BF16_KV):
                out.append(f"rank {rank}: {name}: {got.get(name, 'absent')[:2]} vs cold {want.get(name, 'absent')[:2]}")
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def release_engines() -> None:
    """Drop what an earlier in-process engine left in this process before the next one starts: vLLM keeps
    its parallel groups per process and a new engine reuses them, so a MoE engine after a dense one finds
    no expert-parallel group (vLLM 0.26: ``AssertionError: expert parallel group is not initialized``).
    The tests ``del`` their engine before they end; this frees it and its groups."""
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


class Prepared:
    """A case's model, checkpoints, prompts and its cold load, computed in the background."""

    def __init__(self, case: str, where: Path, pool):
        self.case = case
        self.seed = int(os.environ.get("CKPT_TEST_SEED") or random.randrange(1, 2**31 - 4))
        self.model_dir, self.weights, extra = build_case(case, where / "model", self.seed)
        self.engine_kwargs = {**ENGINE_KWARGS, **extra}
        rng = random.Random(self.seed)
        self.prompts = [[rng.randrange(2, 380) for _ in range(n)] for n in (5, 17, 120)]
        self._cold = pool.submit(cold_reference, self.model_dir, self.weights, self.prompts, self.engine_kwargs)

    @property
    def cold(self) -> dict:
        return self._cold.result()

    def engine(self):
        from vllm import LLM

        release_engines()
        llm = LLM(model=str(self.model_dir), load_format="dummy", worker_extension_cls=EXTENSION,
                  **{k: v for k, v in self.engine_kwargs.items() if v is not None})
        assert llm.llm_engine.vllm_config.cache_config.cache_dtype in ("auto", "bfloat16"), \
            "the KV-scale buffers are only unused with an unquantized KV cache"
        return llm


@pytest.fixture(scope="module")
def prepared(engine_env, tmp_path_factory):
    """Every case built at once and its cold loads started, three at a time, in subprocesses."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=COLD_AT_ONCE) as pool:
        cases = {c: Prepared(c, tmp_path_factory.mktemp(c), pool) for c in CASES}
        for c in cases.values():
            print(f"{c.case} seed: {c.seed} (set CKPT_TEST_SEED={c.seed} to reproduce)")
        yield cases


def push(ps, llm, name: str, files: list[str], **kwargs) -> list:
    """One update of ``files`` through the worker extension (``kwargs`` to its RPC); the workers' replies."""
    replies: list = []
    ps.register_checkpoint(name, files=files)
    try:
        ps.gather_metas(name)
        ps.update(name, lambda handles: replies.extend(llm.collective_rpc(
            "update_weights_from_ipc", args=(dict(handles),), kwargs={"timeout": 300, **kwargs})))
    finally:
        ps.unregister_checkpoint(name)
    llm.reset_prefix_cache()
    return replies


def new_ps(**kwargs):
    from ckpt_core import ParameterServer

    return ParameterServer(rank=0, world_size=1, device="cuda", master_addr="127.0.0.1", master_port=_free_port(),
                           **kwargs)


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_to_b_to_a_to_b_each_update_equals_a_cold_load(prepared, case):
    p = prepared[case]
    llm = p.engine()
    cold = p.cold
    dummy = llm.collective_rpc("ckpt_state_digests")
    assert differences(dummy, cold["digests"][str(p.weights[0])]), "the digests cannot tell a dummy start"
    with new_ps() as ps:
        for step, index in enumerate([0, 1, 0, 1]):
            push(ps, llm, f"{case}-{step}", [str(p.weights[index])])
            differ = differences(llm.collective_rpc("ckpt_state_digests"), cold["digests"][str(p.weights[index])])
            assert not differ, f"{case} step {step} (weights-{index}): differs from a cold load:\n" + "\n".join(differ)
            assert _greedy(llm, p.prompts) == cold["tokens"][str(p.weights[index])]
    del llm


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen3_moe-bf16", "qwen3_moe-fp8-block", "qwen2-bf16"])
def test_direct_updates_equal_a_cold_load_and_copy_every_verbatim_tensor(prepared, case):
    """``direct=True`` (docs/vllm.md, Direct full updates): A records the map, then B, A, B go direct,
    each equal to a cold load. In bf16 every layer is expected verbatim (unquantized linears, norms,
    embeddings; the Triton MoE experts keep the checkpoint layout): every tensor is copied, no layer
    reloaded. FP8 block with the engine's settings here (no DeepGEMM: the CUTLASS block linear kernel and
    the Triton FP8 MoE backend, which keep weights and scales as loaded, ``_quant_verbatim.py``) too."""
    p = prepared[case]
    llm = p.engine()
    cold = p.cold
    with new_ps() as ps:
        for step, index in enumerate([0, 1, 0, 1]):
            (reply,) = push(ps, llm, f"{case}-direct-{step}", [str(p.weights[index])], direct=True)
            fig = reply["direct"]
            print(f"{case} step {step}: {json.dumps(fig)[:1500]}")
            assert fig["path"] == ("reload" if step == 0 else "direct"), fig
            differ = differences(llm.collective_rpc("ckpt_state_digests"), cold["digests"][str(p.weights[index])])
            assert not differ, f"{case} direct step {step}: differs from a cold load:\n" + "\n".join(differ)
            assert _greedy(llm, p.prompts) == cold["tokens"][str(p.weights[index])]
            if step == 0:
                recorded = fig["map"]
            else:
                assert fig["reload_tensors"] == 0 and fig["reloaded_layers"] == 0, \
                    f"{case}: groups reloaded: {recorded['why_reloaded']}"
    del llm


def delta_versions(base: Path, out: Path, density: float = 0.02, seed: int = 0) -> list[Path]:
    """Two versions after ``base``: v1 with ``density`` of every bf16 (and FP8 e4m3) tensor's elements moved
    by one ulp (the lowest bit flipped: an optimizer step at a small rate; never into an FP8 NaN), v2 with
    layer 0's tensors moved again."""
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(base))
    files = []
    for step, chosen in ((1, lambda n: True), (2, lambda n: ".layers.0." in n)):
        for name, t in tensors.items():
            if t.dtype == torch.bfloat16 and chosen(name) and t.numel():
                k = max(1, int(t.numel() * density))
                t.reshape(-1).view(torch.int16)[torch.randperm(t.numel(), generator=gen)[:k]] ^= 1
            elif t.dtype == torch.float8_e4m3fn and chosen(name) and t.numel():   # FP8 block weights
                k = max(1, int(t.numel() * density))
                b = t.reshape(-1).view(torch.uint8)
                at = torch.randperm(t.numel(), generator=gen)[:k]
                flipped = b[at] ^ 1
                keep = (flipped & 0x7F) != 0x7F   # never make a NaN (e4m3fn: S.1111.111)
                b[at[keep]] = flipped[keep]
        files.append(out / f"delta-v{step}.safetensors")
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(files[-1]))
    return files


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen2-bf16", "qwen3_moe-bf16", "qwen2-fp8-online", "qwen3_moe-fp8-block"])
def test_deltas_equal_a_cold_load_scattering_the_verbatim_layers(prepared, case, tmp_path):
    """Deltas into the GPU engine (docs/deltas.md): A whole with ``deltas``, then v1 (2 % of every tensor
    changed) and v2 (layer 0 only) as deltas, each equal to a cold load of that version in digests and
    greedy tokens. In bf16 the engine holds the linears, embeddings and norms verbatim: changed elements
    are scattered into them on the device; FP8 online quantizes each linear, so those layers are reloaded;
    FP8 block keeps its FP8 weights and scales as loaded (with the kernels picked here): scattered too."""
    p = prepared[case]
    files = delta_versions(p.weights[0], tmp_path, seed=p.seed)
    cold = cold_reference(p.model_dir, files, p.prompts, p.engine_kwargs)   # while nothing else runs here
    llm = p.engine()
    with new_ps() as ps:
        names = ["dA", "dv1", "dv2"]
        for i, (name, path) in enumerate(zip(names, [p.weights[0], *files])):
            ps.register_checkpoint(name, files=[str(path)], base=names[i - 1] if i else None)
            ps.gather_metas(name)
            replies: list = []
            result = ps.update(name, lambda handles: replies.extend(llm.collective_rpc(
                "update_weights_from_ipc", args=(dict(handles),),
                kwargs={"timeout": 300, "deltas": True, "version": name})), delta=bool(i))
            llm.reset_prefix_cache()
            want = p.cold if i == 0 else cold
            key = str(path)
            differ = differences(llm.collective_rpc("ckpt_state_digests"), want["digests"][key])
            assert not differ, f"{case} {name}: differs from a cold load:\n" + "\n".join(differ)
            assert _greedy(llm, p.prompts) == want["tokens"][key], f"{case} {name}: greedy tokens differ"
            fig = replies[0]["delta"]
            if i == 0:
                print(f"{case} {name}: map {json.dumps(fig.get('map'))[:800]}")
                continue
            ps_fig = result["delta"]
            print(f"{case} {name}: {ps_fig['changed_elements']} of {ps_fig['elements']} elements, payload "
                  f"{ps_fig['payload_bytes']} of {ps_fig['full_bytes']} bytes; worker: {fig['scattered']} scattered, "
                  f"{len(fig['reloaded_layers'])} layers reloaded in {fig['reload_s']:.3f} s, apply "
                  f"{fig['apply_s']:.3f} s, verify {fig['verify_s']:.3f} s")
            assert 0 < ps_fig["payload_bytes"] < ps_fig["full_bytes"], ps_fig
            assert fig["scattered"] > 0, f"{case} {name}: nothing scattered ({fig})"
            if case in ("qwen2-bf16", "qwen3_moe-fp8-block"):
                assert not fig["reloaded_layers"], f"{case} {name}: layers reloaded: {fig['reloaded_layers']}"
            if case == "qwen2-fp8-online":
                assert fig["reloaded_layers"], f"{case} {name}: quantized layers must be reloaded ({fig})"
    del llm


SCALE = "model.layers.0.self_attn.k_proj.weight_scale_inv"


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.slow
def test_a_missing_scale_is_refused_and_a_skipped_one_is_seen(prepared, tmp_path, monkeypatch):
    """FP8 block. (1) A checkpoint without one layer's scale is refused naming it; that layer keeps
    its previous weights, the engine serves, and a complete push is then equal to a cold load.
    (2) Mutation: a worker that skips that scale with the completeness check off leaves the
    engine different from a cold load, and the digest comparison names the layer's scale."""
    from safetensors.torch import load_file, save_file

    from ckpt_core.errors import CkptError
    from ckpt_vllm._reload import ReloadSession

    if "qwen2-fp8-block" not in prepared:
        pytest.skip("qwen2-fp8-block is not among CKPT_GPU_VLLM_CASES")
    p = prepared["qwen2-fp8-block"]
    llm = p.engine()
    cold_a, cold_b = (p.cold["digests"][str(w)] for w in p.weights)
    fused = "model.layers.0.self_attn.qkv_proj."
    with new_ps() as ps:
        push(ps, llm, "a", [str(p.weights[0])])
        assert not differences(llm.collective_rpc("ckpt_state_digests"), cold_a)
        partial = tmp_path / "without-scale.safetensors"
        tensors = load_file(str(p.weights[1]))
        assert SCALE in tensors
        save_file({k: v for k, v in tensors.items() if k != SCALE}, str(partial))
        with pytest.raises(CkptError) as err:
            push(ps, llm, "b-without-scale", [str(partial)])
        assert SCALE in str(err.value), err.value
        after = llm.collective_rpc("ckpt_state_digests")[0]
        kept = {n: d for n, d in after.items() if n.startswith(fused)}
        assert kept and all(d == cold_a[0][n] for n, d in kept.items()), "the refused layer was changed"
        assert _greedy(llm, p.prompts)   # still serving
        push(ps, llm, "b", [str(p.weights[1])])
        assert not differences(llm.collective_rpc("ckpt_state_digests"), cold_b)

        original_load = ReloadSession.load
        monkeypatch.setattr(ReloadSession, "load",
                            lambda self, weights: original_load(self, [(n, t) for n, t in weights if n != SCALE]))
        monkeypatch.setattr(ReloadSession, "check_complete", lambda self: None)
        push(ps, llm, "a-skipping-scale", [str(p.weights[0])])
        differ = differences(llm.collective_rpc("ckpt_state_digests"), cold_a)
        assert any(d.startswith(f"rank 0: {fused}weight_scale_inv") for d in differ), differ
    del llm


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen2-fp8-block", "qwen3_moe-bf16"])
def test_staged_in_device_and_pinned_host_memory_then_committed_equals_a_cold_load(prepared, case):
    """Stage B with a device limit of half of it (the rest in pinned host memory): the engine
    still equals a cold load of A; commit: it equals B's; the staging memory is freed. Then A
    staged wholly on the device and committed."""
    import torch

    if case not in prepared:
        pytest.skip(f"{case} is not among CKPT_GPU_VLLM_CASES")
    p = prepared[case]
    llm = p.engine()
    cold = [p.cold["digests"][str(w)] for w in p.weights]
    size = p.weights[1].stat().st_size

    def stage(index, version, device_bytes):
        with new_ps(max_bucket_gb=size / 4 / 2**30) as ps:   # several buckets: some on the device, some not
            name = f"stage-{version}"
            ps.register_checkpoint(name, files=[str(p.weights[index])])
            ps.gather_metas(name)
            started = []
            ps.update(name, lambda handles: started.extend(llm.collective_rpc(
                "update_weights_from_ipc", args=(dict(handles),),
                kwargs={"timeout": 300, "stage": version, "stage_device_bytes": device_bytes})))
            ps.unregister_checkpoint(name)
        assert started[0]["state"] == "running", started   # the worker receives on a thread of its own
        return staged_result(llm, version)

    with new_ps() as ps:
        push(ps, llm, "a", [str(p.weights[0])])
    staged = stage(1, "b", size // 2)
    assert staged["device_bytes"] > 0 and staged["host_bytes"] > 0, staged
    assert not differences(llm.collective_rpc("ckpt_state_digests"), cold[0]), "a stage changed the live weights"
    assert _greedy(llm, p.prompts) == p.cold["tokens"][str(p.weights[0])]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()   # the staging area's device part is still held here
    committed = llm.collective_rpc("commit_staged_weights", args=("b",))[0]
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    assert after <= before - staged["device_bytes"] + (64 << 10), f"the staging area was not freed: {before} -> {after}"
    llm.reset_prefix_cache()
    assert committed["version"] == "b"
    assert not differences(llm.collective_rpc("ckpt_state_digests"), cold[1])
    assert _greedy(llm, p.prompts) == p.cold["tokens"][str(p.weights[1])]
    staged = stage(0, "a2", 1 << 40)
    assert staged["host_bytes"] == 0
    llm.collective_rpc("commit_staged_weights", args=("a2",))
    llm.reset_prefix_cache()
    assert not differences(llm.collective_rpc("ckpt_state_digests"), cold[0])
    assert llm.collective_rpc("ckpt_weight_versions")[0]["live"] == "a2"
    print(f"{case}: staged {staged['bytes']} bytes; commit {committed['seconds']}")
    del llm


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen3_moe-bf16", "qwen2-bf16", "qwen2-fp8-block"])
def test_a_prepared_stage_leaves_the_live_model_alone_and_its_commit_equals_a_cold_load(prepared, case):
    """Stage B, prepare it (kernel format, layer by layer, between engine steps): every live
    tensor, buffer and linear layer's output still equal a cold load of A; the commit then
    equals a cold load of B. bf16 Qwen2 must come out prepared (its commit one device copy);
    where a model is not prepared, the reason is printed and the commit reloads."""
    if case not in prepared:
        pytest.skip(f"{case} is not among CKPT_GPU_VLLM_CASES")
    p = prepared[case]
    llm = p.engine()
    cold = [p.cold["digests"][str(w)] for w in p.weights]
    with new_ps() as ps:
        push(ps, llm, "a", [str(p.weights[0])])
        ps.register_checkpoint("b", files=[str(p.weights[1])])
        ps.gather_metas("b")
        ps.update("b", lambda handles: llm.collective_rpc(
            "update_weights_from_ipc", args=(dict(handles),),
            kwargs={"timeout": 300, "stage": "b", "stage_device_bytes": 1 << 40}))
        ps.unregister_checkpoint("b")
    staged_result(llm)

    def live_unchanged(states):
        assert not differences(llm.collective_rpc("ckpt_state_digests"), cold[0]), \
            f"a preparing step changed the live model: {states[0]}"
    states, steps = prepare_staged(llm_rpc(llm), "b", 1 << 20, 300.0, each_step=live_unchanged)
    state = states[0]
    assert not differences(llm.collective_rpc("ckpt_state_digests"), cold[0]), "preparing changed the live model"
    assert _greedy(llm, p.prompts) == p.cold["tokens"][str(p.weights[0])]
    if case == "qwen2-bf16":
        assert state["state"] == "prepared", state
    committed = llm.collective_rpc("commit_staged_weights", args=("b",))[0]
    llm.reset_prefix_cache()
    assert not differences(llm.collective_rpc("ckpt_state_digests"), cold[1])
    assert _greedy(llm, p.prompts) == p.cold["tokens"][str(p.weights[1])]
    assert (committed.get("path") == "prepared") == (state["state"] == "prepared"), (state, committed)
    print(f"{case}: prepare {state} in {steps} steps; commit {committed.get('path', 'reload')} {committed['seconds']}")
    del llm


def staged_result(llm, version: str = "b", timeout: float = 120.0) -> dict:
    return wait_staged(llm_rpc(llm), version, timeout, where="the offline engine", poll_s=0.01)[0]


def stage_file(llm, file: Path, version: str) -> dict:
    """Stage ``file`` as ``version`` (wholly in device memory) through a one-rank CUDA PS; the stage's result."""
    with new_ps() as ps:
        ps.register_checkpoint(version, files=[str(file)])
        ps.gather_metas(version)
        ps.update(version, lambda handles: llm.collective_rpc(
            "update_weights_from_ipc", args=(dict(handles),),
            kwargs={"timeout": 300, "stage": version, "stage_device_bytes": 1 << 40}))
    return staged_result(llm, version)


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.slow
def test_a_prepared_commit_of_an_incomplete_stage_is_refused_and_the_next_complete_one_equals_a_cold_load(
        prepared, tmp_path):
    """Issue 33, item 3. An engine cold-loaded from A (no update yet: its first stage has no live
    layout to be checked against) stages B without k_proj (fused qkv_proj half-written), then B
    without a whole layer (down_proj), each prepared one layer group per call: the preparation
    says ``refused`` naming the tensor, the commit raises CheckpointFormatError, and the engine
    still equals the cold load of A byte for byte (and answers like it). Then B, complete and
    prepared over several calls, commits prepared and equals a cold load of B (the q/k/v biases
    of the layers prepared first included)."""
    from safetensors.torch import load_file, save_file
    from vllm import LLM

    case = "qwen2-bf16"
    if case not in prepared:
        pytest.skip(f"{case} is not among CKPT_GPU_VLLM_CASES")
    p = prepared[case]
    cold = [p.cold["digests"][str(w)] for w in p.weights]
    tokens_a = p.cold["tokens"][str(p.weights[0])]
    spec = importlib.util.spec_from_file_location("cold_load", SUPPORT / "cold_load.py")
    cold_load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cold_load)
    release_engines()
    llm = LLM(model=str(cold_load.checkpoint_dir(p.model_dir, p.weights[0], tmp_path)), load_format="auto",
              worker_extension_cls=EXTENSION, **{k: v for k, v in p.engine_kwargs.items() if v is not None})
    assert not differences(llm.collective_rpc("ckpt_state_digests"), cold[0]), "the engine did not start as A"
    tensors = load_file(str(p.weights[1]))
    for version, drop in (("without-k", "model.layers.0.self_attn.k_proj.weight"),
                          ("without-down", "model.layers.1.mlp.down_proj.weight")):
        broken = tmp_path / f"{version}.safetensors"
        save_file({n: t for n, t in tensors.items() if n != drop}, str(broken))
        stage_file(llm, broken, version)   # accepted: a first stage has no layout to be compared with
        states, steps = prepare_staged(llm_rpc(llm), version, 1, 300.0)
        assert states[0]["state"] == "refused" and drop in states[0]["reason"], states[0]
        with pytest.raises(Exception) as refused:   # CheckpointFormatError, as the offline engine passes it on
            llm.collective_rpc("commit_staged_weights", args=(version,))
        assert f"cannot commit version {version!r}" in str(refused.value) and drop in str(refused.value), refused.value
        differ = differences(llm.collective_rpc("ckpt_state_digests"), cold[0])
        assert not differ, "a refused prepared commit changed the engine:\n" + "\n".join(differ)
        assert _greedy(llm, p.prompts) == tokens_a
        assert llm.collective_rpc("ckpt_weight_versions")[0]["staged"] is None, "the refused stage was kept"
        print(f"{version}: refused after {steps} preparing call(s): {states[0]['reason']}")
    stage_file(llm, p.weights[1], "b")
    states, steps = prepare_staged(llm_rpc(llm), "b", 1, 300.0)
    assert states[0]["state"] == "prepared" and steps > 2, (states[0], steps)
    committed = llm.collective_rpc("commit_staged_weights", args=("b",))[0]
    llm.reset_prefix_cache()
    assert committed.get("path") == "prepared", committed
    differ = differences(llm.collective_rpc("ckpt_state_digests"), cold[1])
    assert not differ, "a prepared commit over several calls differs from a cold load of B:\n" + "\n".join(differ)
    assert _greedy(llm, p.prompts) == p.cold["tokens"][str(p.weights[1])]
    del llm


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.slow
def test_the_native_backend_path_equals_a_cold_load(prepared):
    """vLLM's own routes (init_weight_transfer_engine, start/update/finish_weight_update) with our
    ``ckpt`` backend, registered in this process (the engine core runs in it): A, B, A, each equal
    to a cold load; an update split over two PS updates (one weight update) too."""
    from safetensors.torch import load_file, save_file

    from ckpt_vllm.plugin import register
    from vllm import LLM

    case = "qwen2-bf16" if "qwen2-bf16" in prepared else next(iter(prepared))
    p = prepared[case]
    assert register()
    release_engines()
    llm = LLM(model=str(p.model_dir), load_format="dummy", worker_extension_cls=EXTENSION,
              weight_transfer_config={"backend": "ckpt"},
              **{k: v for k, v in p.engine_kwargs.items() if v is not None})
    llm.init_weight_transfer_engine({"init_info": {"timeout_s": 300}})
    cold = [p.cold["digests"][str(w)] for w in p.weights]

    def backend_push(ps, name, files, *, first=True, last=True):
        ps.register_checkpoint(name, files=files)
        try:
            ps.gather_metas(name)
            if first:
                llm.start_weight_update()
            ps.update(name, lambda handles: llm.update_weights(
                {"update_info": {"zmq_handles": dict(handles), "check_complete": last}}))
            if last:
                llm.finish_weight_update()
        finally:
            ps.unregister_checkpoint(name)
        llm.reset_prefix_cache()

    with new_ps() as ps:
        for step, index in enumerate([0, 1, 0]):
            backend_push(ps, f"backend-{step}", [str(p.weights[index])])
            differ = differences(llm.collective_rpc("ckpt_state_digests"), cold[index])
            assert not differ, f"backend step {step}: differs from a cold load:\n" + "\n".join(differ)
            assert _greedy(llm, p.prompts) == p.cold["tokens"][str(p.weights[index])]
        tensors = load_file(str(p.weights[1]))
        names = sorted(tensors)
        parts = []
        for i in range(2):
            parts.append(p.weights[1].parent / f"part-{i}.safetensors")
            save_file({n: tensors[n] for n in names[i::2]}, str(parts[-1]))
        backend_push(ps, "backend-part-0", [str(parts[0])], last=False)
        backend_push(ps, "backend-part-1", [str(parts[1])], first=False)
        assert not differences(llm.collective_rpc("ckpt_state_digests"), cold[1])
    print(f"{case}: the native backend path equals a cold load (A, B, A, and B in two PS updates)")
    del llm


def _greedy(llm, prompts):
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_the_fp8_block_quantizer_round_trips_within_fp8_precision():
    """Runs anywhere (CPU): the checkpoint the FP8 case pushes is a faithful block-FP8 encoding."""
    import torch

    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale.shape == (2, 3)
    back = q.float() * scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert torch.allclose(back, w, rtol=0.07, atol=1e-3)


def test_the_per_tensor_and_per_channel_quantizers_round_trip_within_fp8_precision():
    import torch

    w = torch.randn(96, 200, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_tensor(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == ()
    assert torch.allclose(q.float() * scale, w, rtol=0.07, atol=2e-3)
    q, scale = quantize_channel(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (96, 1)
    assert torch.allclose(q.float() * scale, w, rtol=0.07, atol=1e-3)


def test_fused_experts_are_split_one_tensor_per_expert():
    import torch

    gate_up = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)
    down = torch.arange(2 * 3 * 3, dtype=torch.float32).reshape(2, 3, 3)
    out = per_expert({"model.layers.0.mlp.experts.gate_up_proj": gate_up,
                      "model.layers.0.mlp.experts.down_proj": down, "model.norm.weight": torch.ones(3)})
    assert sorted(out) == sorted(["model.norm.weight"] + [f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"
                                                          for e in range(2) for p in ("gate", "up", "down")])
    assert torch.equal(out["model.layers.0.mlp.experts.1.up_proj.weight"], gate_up[1, 3:])
    assert torch.equal(out["model.layers.0.mlp.experts.0.down_proj.weight"], down[0])
