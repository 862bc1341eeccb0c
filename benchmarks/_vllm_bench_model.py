"""Checkpoints for the real-vLLM benchmark: a config and fresh random weights, and device checksums.

The tensor names and shapes come from transformers' own model class built on the meta device, so
they are what a Hugging Face checkpoint of that architecture holds. Weights are written once per
(shape, seed) as safetensors shards; a marker file lets a second run reuse them.
"""

from __future__ import annotations

import json
import os

import torch

SHARD_BYTES = 2 << 30
SEED = 1234
SHAPES = {
    # Qwen2-7B dimensions: 7.6 B parameters, 14.19 GiB in bf16.
    "7b": ("Qwen2Config", dict(architectures=["Qwen2ForCausalLM"], hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                               max_position_embeddings=4096, tie_word_embeddings=False)),
    "tiny": ("Qwen2Config", dict(architectures=["Qwen2ForCausalLM"], hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512,
                                 tie_word_embeddings=False)),
    "moe": ("Qwen3MoeConfig", dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                   num_experts=8, num_experts_per_tok=2, vocab_size=2048, decoder_sparse_step=1,
                                   max_position_embeddings=512, tie_word_embeddings=False)),
    # Many tensors (issue 38): a Qwen3-MoE layout with 128 experts in each of 12 layers, 4,719 tensors
    # (4,608 of them experts' projections), 2.3 GiB in bf16.
    "moe4k": ("Qwen3MoeConfig", dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=1024, intermediate_size=2048,
                                     moe_intermediate_size=256, num_hidden_layers=12, num_attention_heads=16,
                                     num_key_value_heads=4, head_dim=64, num_experts=128, num_experts_per_tok=8,
                                     vocab_size=8192, decoder_sparse_step=1, max_position_embeddings=512,
                                     tie_word_embeddings=False)),
}
MARKER = ".ckpt-bench-shape"


def checkpoint_files(directory: str) -> list[str]:
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors"))


FORMATS = ("bf16", "fp8-block")
# What a block-FP8 checkpoint (DeepSeek-V3, Qwen3-FP8) says in its config.json.
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}


def make_checkpoint(shape: str, directory: str, *, seed: int = SEED, fmt: str = "bf16") -> dict:
    """Write ``shape``'s config.json and random weights into ``directory`` (reused when present).

    ``fmt="fp8-block"`` stores the decoder's linear weights as float8_e4m3fn with a float32
    ``weight_scale_inv`` per 128x128 block (embeddings, norms and lm_head stay bf16). A MoE's router
    (``mlp.gate``) is quantized too: vLLM builds it with the model's quantization (``GateLinear``), so a
    checkpoint with a bf16 router and no ``weight_scale_inv`` is not one vLLM can load.
    """
    import transformers
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: one of {', '.join(FORMATS)}")
    cls_name, kwargs = SHAPES[shape]
    config = getattr(transformers, cls_name)(**kwargs, torch_dtype="bfloat16")
    if fmt == "fp8-block":
        config.quantization_config = FP8_BLOCK_CONFIG
    key = json.dumps({"shape": shape, "seed": seed, "config": kwargs, "format": fmt, "router": "fp8"}, sort_keys=True)
    marker = os.path.join(directory, MARKER)
    if os.path.exists(marker) and open(marker).read() == key:
        files = checkpoint_files(directory)
        return {"tensors": _count(files), "bytes": sum(os.path.getsize(f) for f in files), "reused": True}
    os.makedirs(directory, exist_ok=True)
    for f in os.listdir(directory):
        os.unlink(os.path.join(directory, f))
    config.save_pretrained(directory)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    specs = _per_expert([(n, tuple(p.shape)) for n, p in model.state_dict().items()])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    shard, size, n, total, count = {}, 0, 0, 0, 0
    for name, shp in specs:
        t = _random(name, shp, gen, device)
        pieces = {name: t}
        if fmt == "fp8-block" and _quantized(name):
            q, scale = quantize_block(t)
            pieces = {name: q, name.removesuffix("weight") + "weight_scale_inv": scale}
        for k, v in pieces.items():
            shard[k] = v.cpu()
            size += shard[k].nbytes
            total += shard[k].nbytes
            count += 1
        if size >= SHARD_BYTES:
            n += 1
            save_file(shard, os.path.join(directory, f"model-{n:05d}.safetensors"), metadata={"format": "pt"})
            shard, size = {}, 0
    if shard:
        n += 1
        save_file(shard, os.path.join(directory, f"model-{n:05d}.safetensors"), metadata={"format": "pt"})
    with open(marker, "w") as f:
        f.write(key)
    return {"tensors": count, "bytes": total, "reused": False}


def _per_expert(specs: list[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
    """Experts one tensor each, as Qwen3-MoE checkpoints ship them (transformers 5 models hold
    them fused: ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I])."""
    out = []
    for name, shape in specs:
        if name.endswith("experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            out += [(f"{base}{e}.{p}_proj.weight", (shape[1] // 2, shape[2]))
                    for e in range(shape[0]) for p in ("gate", "up")]
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix("down_proj")
            out += [(f"{base}{e}.down_proj.weight", tuple(shape[1:])) for e in range(shape[0])]
        else:
            out.append((name, shape))
    return out


def quantize_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale [ceil(N/128), ceil(K/128)]) with w ~= q * scale per block."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    tiles = padded.view(nb, block, kb, block)
    fmax = torch.finfo(torch.float8_e4m3fn).max
    scale = (tiles.abs().amax(dim=(1, 3)) / fmax).clamp(min=1e-12)
    q = (tiles / scale[:, None, :, None]).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), scale.contiguous()


def _quantized(name: str) -> bool:
    """The weights a block-FP8 checkpoint stores in FP8: the decoder's linears and a MoE's router."""
    return (name.endswith("_proj.weight") or name.endswith(".mlp.gate.weight")) and ".layers." in name


def _random(name: str, shape, gen, device) -> torch.Tensor:
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if name.endswith("norm.weight"):
        t = 1.0 + 0.05 * t
    else:
        t = 0.02 * t
    return t.to(torch.bfloat16)


def _count(files: list[str]) -> int:
    from safetensors import safe_open
    n = 0
    for f in files:
        with safe_open(f, "pt") as h:
            n += len(list(h.keys()))
    return n


@torch.no_grad()
def checksums(model: torch.nn.Module) -> dict[str, list]:
    """Every parameter and buffer of ``model``: [dtype, shape, two 64-bit sums of its bytes] computed on its device.

    The second sum weights each 8-byte word by an odd multiple of its position, so moved, swapped or
    changed bytes change it; equal bytes give equal sums.
    """
    out = {}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        if name in out:
            continue
        out[name] = [str(t.dtype).replace("torch.", ""), list(t.shape), *_sums(t)]
    return out


def _sums(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return 0, 0
    b = t.detach().contiguous().view(-1).view(torch.uint8)
    pad = (-b.numel()) % 8
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    w = b.view(torch.int64)
    weights = torch.arange(w.numel(), device=w.device, dtype=torch.int64).mul_(2).add_(1)
    return int(w.sum()), int((w * weights).sum())
