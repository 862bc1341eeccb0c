"""Synthetic checkpoints for the update benchmark: shapes, the split across ranks, data, checksums.

Every case is defined at full size (``scale=1``). ``--scale s`` multiplies every
matrix dimension by sqrt(s), so the byte count scales by about ``s`` while the
number of tensors (and so the per-tensor overheads) stays the same.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from ckpt_core.planning.buckets import align_up

GiB = 1 << 30
MiB = 1 << 20
ALIGN = 256

# Checksums. On a device: exact integer sums over the tensor's raw 16-bit words (8-bit for
# 1-byte dtypes), plain and position-weighted, so lost, swapped or shifted bytes all show,
# computed where the data is (no copy of 40 GiB to the host). The chunk length is a multiple
# of the modulus, so one weight vector serves every chunk; no int64 overflow below 2^31
# elements per tensor. On the host: zlib's CRC-32.
_MOD = 65521
_CHUNK = _MOD * 64
_weights: dict[str, torch.Tensor] = {}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _dim(d: int, scale: float) -> int:
    if scale == 1.0:
        return d
    return max(8, int(round(d * math.sqrt(scale) / 8)) * 8)


def _layers_for(target: int, fixed: list[TensorSpec], layer: list[TensorSpec]) -> int:
    per_layer = sum(s.nbytes for s in layer)
    return max(1, round((target - sum(s.nbytes for s in fixed)) / per_layer))


def _dense_layer(i: int, h: int, inter: int, kv: int) -> list[TensorSpec]:
    bf, p = torch.bfloat16, f"model.layers.{i}."
    shapes = [("self_attn.q_proj.weight", (h, h)), ("self_attn.q_proj.bias", (h,)),
              ("self_attn.k_proj.weight", (kv, h)), ("self_attn.k_proj.bias", (kv,)),
              ("self_attn.v_proj.weight", (kv, h)), ("self_attn.v_proj.bias", (kv,)),
              ("self_attn.o_proj.weight", (h, h)), ("mlp.gate_proj.weight", (inter, h)),
              ("mlp.up_proj.weight", (inter, h)), ("mlp.down_proj.weight", (h, inter)),
              ("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,))]
    return [TensorSpec(p + n, s, bf) for n, s in shapes]


def _moe_layer(i: int, h: int, inter: int, kv: int, experts: int) -> list[TensorSpec]:
    bf, p = torch.bfloat16, f"model.layers.{i}."
    out = [TensorSpec(p + "self_attn.q_proj.weight", (h, h), bf), TensorSpec(p + "self_attn.k_proj.weight", (kv, h), bf),
           TensorSpec(p + "self_attn.v_proj.weight", (kv, h), bf), TensorSpec(p + "self_attn.o_proj.weight", (h, h), bf),
           TensorSpec(p + "mlp.gate.weight", (experts, h), torch.float32)]   # fp32 router: mixed dtypes
    for e in range(experts):
        q = f"{p}mlp.experts.{e}."
        out += [TensorSpec(q + "gate_proj.weight", (inter, h), bf), TensorSpec(q + "up_proj.weight", (inter, h), bf),
                TensorSpec(q + "down_proj.weight", (h, inter), bf)]
    out += [TensorSpec(p + "input_layernorm.weight", (h,), bf), TensorSpec(p + "post_attention_layernorm.weight", (h,), bf)]
    return out


def _ends(h: int, vocab: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
    bf = torch.bfloat16
    return ([TensorSpec("model.embed_tokens.weight", (vocab, h), bf)],
            [TensorSpec("model.norm.weight", (h,), bf), TensorSpec("lm_head.weight", (vocab, h), bf)])


def _dense(target: int, scale: float, *, h: int, inter: int, vocab: int, kv: int) -> list[TensorSpec]:
    head, tail = _ends(h, vocab)
    layers = _layers_for(target, head + tail, _dense_layer(0, h, inter, kv))
    dims = [_dim(x, scale) for x in (h, inter, vocab, kv)]
    head, tail = _ends(dims[0], dims[2])
    body = [s for i in range(layers) for s in _dense_layer(i, dims[0], dims[1], dims[3])]
    return head + body + tail


def _moe(target: int, scale: float, *, h: int, inter: int, vocab: int, kv: int, experts: int) -> list[TensorSpec]:
    head, tail = _ends(h, vocab)
    layers = _layers_for(target, head + tail, _moe_layer(0, h, inter, kv, experts))
    hs, ins, vs, kvs = (_dim(x, scale) for x in (h, inter, vocab, kv))
    head, tail = _ends(hs, vs)
    body = [s for i in range(layers) for s in _moe_layer(i, hs, ins, kvs, experts)]
    return head + body + tail


# 7B-style dense shapes (Qwen2.5-7B: hidden 3584, MLP 18944, vocab 152064, 4 KV heads of 128).
_DENSE = dict(h=3584, inter=18944, vocab=152064, kv=512)
CASES = {
    "dense16": lambda s: _dense(16 * GiB, s, **_DENSE),
    "dense40": lambda s: _dense(40 * GiB, s, **_DENSE),
    # many small experts: ~5,200 tensors of ~1.3 MB, plus fp32 routers
    "moe8": lambda s: _moe(8 * GiB, s, h=2048, inter=320, vocab=151936, kv=512, experts=40),
    # ~19,000 tensors: 128 small experts per layer (the per-tensor cost of a Qwen3-30B-A3B-like layout at
    # scale; issue 38), plus fp32 routers
    "moe128": lambda s: _moe(16 * GiB, s, h=2048, inter=192, vocab=151936, kv=512, experts=128),
    # fixed cost: a 2-layer model of ~64 MiB
    "tiny": lambda s: _dense(64 * MiB, s, h=1024, inter=2048, vocab=8192, kv=256),
}


def build_case(name: str, scale: float) -> list[TensorSpec]:
    if name not in CASES:
        raise SystemExit(f"unknown case {name!r}; known: {', '.join(CASES)}")
    return CASES[name](scale)


def split(specs: list[TensorSpec], world: int) -> list[list[TensorSpec]]:
    """Largest first onto the least-loaded rank (every rank computes the same split); order kept per rank."""
    loads, owner = [0] * world, {}
    for s in sorted(specs, key=lambda s: -s.nbytes):
        r = min(range(world), key=lambda i: (loads[i], i))
        loads[r] += s.nbytes
        owner[s.name] = r
    return [[s for s in specs if owner[s.name] == r] for r in range(world)]


# ---------------------------------------------------------------------------------------- checksums
def _weight_vector(device: torch.device) -> torch.Tensor:
    key = str(device)
    if key not in _weights:
        _weights[key] = torch.arange(_CHUNK, dtype=torch.int64, device=device) % _MOD + 1
    return _weights[key]


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _device_parts(t: torch.Tensor) -> torch.Tensor:
    """(sum, position-weighted sum) of the raw words of ``t``, as a 2-element int64 tensor on its device."""
    flat = t.detach().reshape(-1)
    words = flat.view(torch.int16) if t.element_size() >= 2 else flat.view(torch.uint8)
    acc = torch.zeros(2, dtype=torch.int64, device=t.device)
    if words.numel() == 0:
        return acc
    w = _weight_vector(t.device)
    for a in range(0, words.numel(), _CHUNK):
        x = words[a: a + _CHUNK].to(torch.int64)
        acc[0] += x.sum()
        acc[1] += (x * w[: x.numel()]).sum()
    return acc


def _host_parts(t: torch.Tensor) -> tuple[int, int]:
    """(CRC-32, byte count) of a host tensor: zlib runs at memory speed where torch's int64 sums do not."""
    raw = _raw(t)
    return zlib.crc32(memoryview(raw.numpy()).cast("B")) if raw.numel() else 0, raw.numel()


def checksums(named: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """A checksum per tensor (device tensors: one sync at the end). Both sides of a comparison
    must hold their tensors on the same kind of device, since host and device use different sums."""
    out: dict[str, tuple[int, int]] = {}
    names, parts = [], []
    for n, t in named.items():
        if t.device.type == "cpu":
            out[n] = _host_parts(t)
        else:
            names.append(n)
            parts.append(_device_parts(t))
    if parts:
        for n, (a, b) in zip(names, torch.stack(parts).cpu().tolist()):
            out[n] = (int(a), int(b))
    return out


def free_weight_cache() -> None:
    _weights.clear()


# ---------------------------------------------------------------------------------------- source data
@dataclass
class Share:
    """One rank's share of a case: host tensors (views of one buffer) and their checksums."""
    specs: list[TensorSpec]
    buffer: torch.Tensor
    named: dict[str, torch.Tensor]
    sums: dict[str, tuple[int, int]]


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fill_random(raw: torch.Tensor, dtype: torch.dtype, gen: torch.Generator) -> None:
    """Fill a flat uint8 tensor (length a multiple of 8) with random bits, 64 at a time (fast on a CPU).
    For floating dtypes the top exponent bit is cleared: every value is finite, |x| < 2."""
    raw.view(torch.int64).random_(generator=gen)
    if dtype.is_floating_point:
        bits = 8 * dtype.itemsize
        raw.view(_INT_OF_SIZE[dtype.itemsize]).bitwise_and_(~(1 << (bits - 2)))


def materialize(specs: list[TensorSpec], device: torch.device, seed: int) -> Share:
    """Fresh random data for ``specs`` in pageable host memory and its checksums.

    On a device the data is made and checksummed there, then copied to the host (the
    engine worker checksums on the same device); on the CPU it is made in place."""
    offsets, pos = [], 0
    for s in specs:
        offsets.append(pos)
        pos += align_up(s.nbytes, ALIGN)
    buffer = torch.empty(pos, dtype=torch.uint8)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    named, parts = {}, []
    for s, off in zip(specs, offsets):
        slot = buffer[off: off + align_up(s.nbytes, ALIGN)]
        if device.type == "cpu":
            _fill_random(slot, s.dtype, gen)
        else:
            dev = torch.empty(slot.numel(), dtype=torch.uint8, device=device)
            _fill_random(dev, s.dtype, gen)
            parts.append(_device_parts(dev[: s.nbytes].view(s.dtype)))
            slot.copy_(dev)
        named[s.name] = buffer[off: off + s.nbytes].view(s.dtype).view(s.shape)
    if device.type == "cpu":
        sums = checksums(named)
    else:
        values = torch.stack(parts).cpu().tolist() if parts else []
        sums = {s.name: (int(a), int(b)) for s, (a, b) in zip(specs, values)}
    return Share(specs, buffer, named, sums)
