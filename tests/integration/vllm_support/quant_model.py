"""Tiny quantized checkpoints, written the way the quantization tools write them.

``quantize(model_dir, fmt, seeds)`` takes a tiny Llama built by ``tiny_model.py`` (its config,
tokenizer and float weights) and writes, for each seed, ``weights-{i}.safetensors`` in format
``fmt``: every linear layer of the decoder (q/k/v/o, gate/up/down) replaced by freshly random
quantized tensors under the names, dtypes and packing that vLLM's loader for that format reads;
embeddings, norms and ``lm_head`` stay float (the tools leave ``lm_head`` unquantized). The
config gets the ``quantization_config`` block those tools write.

Formats (names, shapes and packing read from vLLM 0.32's loaders; N = output, K = input size):

- ``ct-w8a8``: compressed-tensors ``int-quantized``, int8 weight per output channel
  (``weight`` int8 [N, K], ``weight_scale`` float32 [N, 1]), activations int8 per token, dynamic.
- ``ct-w4a16``: compressed-tensors ``pack-quantized``, 4-bit symmetric weight in groups of 32
  (``weight_packed`` int32 [N, K/8], eight nibbles packed along K, stored offset by 8;
  ``weight_scale`` [N, K/32]; ``weight_shape`` int64 [2]).
- ``ct-w8a16``: as ``ct-w4a16`` with 8-bit values (``weight_packed`` int32 [N, K/4], offset 128).
- ``ct-mixed``: one compressed-tensors checkpoint with two config groups, as a mixed-precision
  recipe writes it: ``ct-w8a8`` for the attention projections, ``ct-w4a16`` for the MLP.
- ``gptq``: AutoGPTQ 4-bit, group 32, no act-order (``qweight`` int32 [K/8, N] packed along K,
  ``qzeros`` int32 [K/32, N/8] holding zero-1 = 7, ``scales`` [K/32, N], ``g_idx`` int32 [K]).
- ``awq``: AutoAWQ GEMM 4-bit, group 32 (``qweight`` int32 [K, N/8] packed along N in AWQ's
  nibble order 0 2 4 6 1 3 5 7, ``qzeros`` int32 [K/32, N/8] likewise, ``scales`` [K/32, N]).
- ``fp8-block``: ``quant_method: fp8`` with 128x128 blocks (``weight`` float8_e4m3fn [N, K],
  ``weight_scale_inv`` float32 [N/128, K/128]), dynamic activations.
- ``fp8-tensor``: ``quant_method: fp8`` per tensor (``weight`` float8_e4m3fn, ``weight_scale``
  float32 scalar), dynamic activations.

Imports torch and safetensors only (runs in the project venv).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

GROUP = 32
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # nibble i of an AWQ int32 holds column _AWQ_ORDER[i] of 8

FORMATS = ("ct-w8a8", "ct-w4a16", "ct-w8a16", "ct-mixed", "gptq", "awq", "fp8-block", "fp8-tensor")
_MIXED = {"self_attn": "ct-w8a8", "mlp": "ct-w4a16"}   # ct-mixed: format of each linear by its parent
# The tiny models' shapes: every N and K a multiple of 128 (FP8 blocks; CPU WNA16 wants 32).
CONFIG_OVERRIDES = {"num_key_value_heads": 2}


def _pack(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned ``bits``-bit ``values`` packed into int32 along ``dim``, lowest bits first."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    if order is not None:
        v = v[..., list(order)]
    shifts = torch.arange(per, dtype=torch.int64) * bits
    packed = (v << shifts).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def _scales(gen: torch.Generator, shape, k: int, levels: int) -> torch.Tensor:
    """Positive scales that keep dequantized weights near the float init (std ~ 1/sqrt(K))."""
    base = 1.7 / (k ** 0.5 * levels)
    return base * (0.75 + 0.5 * torch.rand(shape, generator=gen))


def _linear(fmt: str, n: int, k: int, gen: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of one [N, K] linear layer in ``fmt`` (names relative to the layer)."""
    if fmt == "ct-w8a8":
        return {"weight": torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
                "weight_scale": _scales(gen, (n, 1), k, 127).float()}
    if fmt in ("ct-w4a16", "ct-w8a16"):
        bits = 4 if fmt == "ct-w4a16" else 8
        q = torch.randint(0, 2**bits, (n, k), generator=gen)
        return {"weight_packed": _pack(q, bits, dim=1),
                "weight_scale": _scales(gen, (n, k // GROUP), k, 2 ** (bits - 1)).to(dtype),
                "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if fmt == "gptq":
        q = torch.randint(0, 16, (k, n), generator=gen)
        return {"qweight": _pack(q, 4, dim=0),
                "qzeros": _pack(torch.full((k // GROUP, n), 7), 4, dim=1),
                "scales": _scales(gen, (k // GROUP, n), k, 8).to(dtype),
                "g_idx": (torch.arange(k, dtype=torch.int32) // GROUP)}
    if fmt == "awq":
        q = torch.randint(0, 16, (k, n), generator=gen)
        zeros = torch.randint(6, 11, (k // GROUP, n), generator=gen)
        return {"qweight": _pack(q, 4, dim=1, order=_AWQ_ORDER),
                "qzeros": _pack(zeros, 4, dim=1, order=_AWQ_ORDER),
                "scales": _scales(gen, (k // GROUP, n), k, 8).to(dtype)}
    if fmt in ("fp8-block", "fp8-tensor"):
        w = torch.randn(n, k, generator=gen) * 64
        weight = w.clamp(-448, 448).to(torch.float8_e4m3fn)
        if fmt == "fp8-block":
            scale = _scales(gen, (n // 128, k // 128), k, 1) / 64
            return {"weight": weight, "weight_scale_inv": scale.float()}
        return {"weight": weight, "weight_scale": (_scales(gen, (), k, 1) / 64).float()}
    raise ValueError(f"unknown quantized format {fmt!r}; known: {', '.join(FORMATS)}")


def _format_of(fmt: str, linear: str) -> str:
    return _MIXED[linear.split(".")[0]] if fmt == "ct-mixed" else fmt


def quantization_config(fmt: str) -> dict:
    """The ``quantization_config`` block the producing tool writes into config.json."""
    if fmt == "ct-mixed":
        groups = {}
        for i, (parent, sub) in enumerate(_MIXED.items()):
            one = quantization_config(sub)   # each group names its own format in a mixed checkpoint
            groups[f"group_{i}"] = {**one["config_groups"]["group_0"], "format": one["format"],
                                    "targets": [f"re:.*{parent}\\..*_proj$"]}
        return {**quantization_config("ct-w8a8"), "format": "mixed-precision", "config_groups": groups}
    if fmt.startswith("ct-"):
        bits = {"ct-w8a8": 8, "ct-w4a16": 4, "ct-w8a16": 8}[fmt]
        weights = {"num_bits": bits, "type": "int", "symmetric": True, "dynamic": False, "actorder": None,
                   "strategy": "channel" if fmt == "ct-w8a8" else "group",
                   "group_size": None if fmt == "ct-w8a8" else GROUP, "observer": "minmax"}
        acts = ({"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token",
                 "group_size": None, "observer": None} if fmt == "ct-w8a8" else None)
        return {"quant_method": "compressed-tensors",
                "format": "int-quantized" if fmt == "ct-w8a8" else "pack-quantized",
                "quantization_status": "compressed", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": acts, "output_activations": None,
                                              "format": None}},
                "kv_cache_scheme": None}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
                "checkpoint_format": "gptq", "damp_percent": 0.01, "static_groups": False, "true_sequential": True}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    if fmt == "fp8-tensor":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    raise ValueError(f"unknown quantized format {fmt!r}; known: {', '.join(FORMATS)}")


def quantize(model_dir: Path, fmt: str, seeds: list[int], dtype: torch.dtype = torch.bfloat16) -> list[Path]:
    """Rewrite ``model_dir``'s checkpoints as ``fmt`` (one per seed); returns the files, in seed order.

    The float tensors (embeddings, norms, ``lm_head``) of ``weights-{i}.safetensors`` are kept
    and cast to ``dtype``; ``model.safetensors`` becomes a copy of set 0, as in ``tiny_model.py``.
    """
    from safetensors.torch import load_file, save_file

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    shapes = _linear_shapes(config)
    files = []
    for i, seed in enumerate(seeds):
        src = model_dir / f"weights-{i}.safetensors"
        tensors = {n: t.to(dtype) for n, t in load_file(str(src)).items()
                   if not any(f".{lin}." in f".{n}" for lin in LINEARS)}
        gen = torch.Generator().manual_seed(seed)
        for layer in range(config["num_hidden_layers"]):
            for lin, (n, k) in shapes.items():
                prefix = f"model.layers.{layer}.{lin}"
                for name, t in _linear(_format_of(fmt, lin), n, k, gen, dtype).items():
                    tensors[f"{prefix}.{name}"] = t
        save_file(tensors, str(src), metadata={"format": "pt"})
        files.append(src)
    save_file(load_file(str(files[0])), str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return files


def _linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    h, i = config["hidden_size"], config["intermediate_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    return {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
