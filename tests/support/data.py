"""Test data: fresh random tensors (never zeros: a transfer that moves nothing must not pass) in
every dtype the transfers carry, and the digests an engine must hold after an update."""

from __future__ import annotations

import hashlib

import torch


def digest(t: torch.Tensor) -> str:
    """SHA-256 of the tensor's bytes, with its dtype and shape: equal only for bit-identical tensors."""
    t = t.detach().cpu().contiguous()
    sha = hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    return f"{sha}|{t.dtype}|{tuple(t.shape)}"


FAULT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


def fresh_tensor(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random data (never zeros: a transfer that moves nothing must not pass) in any dtype, float8 included."""
    x = torch.randn(shape, generator=gen) * 3
    x[x == 0] = 1.0
    return x.to(dtype)


def random_bits(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (any wire dtype: NaN and inf bit patterns included; bool as 0/1):
    what the delta encoders compare, as integers of the item size."""
    numel = 1
    for d in shape:
        numel *= d
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * size,), generator=gen, dtype=torch.uint8)
    return (raw % 2).bool().reshape(shape) if dtype == torch.bool else raw.view(dtype).reshape(shape)


def fresh_tensors(names_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], gen: torch.Generator) -> dict:
    """``fresh_tensor`` for fixed names."""
    return {name: fresh_tensor(shape, dtype, gen) for name, (shape, dtype) in names_shapes.items()}


def want_digests(*groups: dict[str, torch.Tensor]) -> dict[str, str]:
    """{tensor name: digest} of every tensor of the groups: what the engines must hold afterwards."""
    return {n: digest(t) for g in groups for n, t in g.items()}


def lin64_reference(t: torch.Tensor) -> str:
    """``ckpt_core.delta.lin64``'s digest by its definition, in plain Python (slow: small tensors): the tensor's
    bytes zero-padded to 8-byte words, word i (little-endian) times (mix(i % ROW + SEED_A) | 1) times
    (mix(i // ROW + SEED_B) | 1), summed with the size term mix((bytes << 5) | item size), mod 2**64."""
    from ckpt_core.delta import lin64 as lin

    raw, size = lin.raw_of(t)
    data = bytes(raw.cpu().numpy())
    padded = data + b"\0" * (-len(data) % 8)
    total = 0
    for i in range(len(padded) // 8):
        word = int.from_bytes(padded[8 * i: 8 * i + 8], "little")
        total += word * (lin.mix_int(i % lin.ROW + lin.SEED_A) | 1) * (lin.mix_int(i // lin.ROW + lin.SEED_B) | 1)
    total += lin.mix_int((len(data) << 5) | size)
    return f"{lin.PREFIX}{total & ((1 << 64) - 1):016x}"


def mixed_delta_bucket(seed: int = 9) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A delta bucket's tensors of three item sizes (bf16, float32, fp8): bases and new versions with one
    word in 25 flipped in its lowest bit (the batched scatter's kernels run one launch per item size)."""
    from ckpt_core.delta.encode import as_words

    gen = torch.Generator().manual_seed(seed)
    specs = [((512, 96), torch.bfloat16), ((333,), torch.float32), ((64, 64), torch.float8_e4m3fn),
             ((40, 8), torch.bfloat16)]
    bases, news = {}, {}
    for i, (shape, dtype) in enumerate(specs):
        base = torch.randn(shape, generator=gen).to(dtype)
        new = base.clone()
        flat = as_words(new)
        flat[torch.randperm(flat.numel(), generator=gen)[: flat.numel() // 25]] ^= 1
        bases[f"w{i}"], news[f"w{i}"] = base, new
    return bases, news
