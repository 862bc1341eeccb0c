"""A staging area copies a bucket in runs: tensors that lie together in the PS's buffer are one copy,
and the engine still gets one tensor per name, of its dtype and shape, holding its own bytes."""

from __future__ import annotations

import random

import torch
from torch.overrides import TorchFunctionMode

from ckpt_core.wire.staging import StagingArea

DTYPES = [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int64, torch.uint8]


def _bucket(rng: random.Random, buf: torch.Tensor, count: int) -> list[tuple[str, torch.Tensor]]:
    """Views of ``buf`` as a bucket places them: item-aligned offsets, 256-aligned mostly, small gaps."""
    out, at = [], 0
    for i in range(count):
        dtype = rng.choice(DTYPES)
        k = dtype.itemsize
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(0, 3)))
        n = k
        for d in shape:
            n *= d
        at = (at + k - 1) // k * k if rng.random() < 0.5 else (at + 255) // 256 * 256
        at += rng.choice([0, 0, 0, 64, 5000]) // k * k   # now and then a hole larger than a run allows
        out.append((f"t{i}", buf[at: at + n].view(dtype).view(shape)))
        at += n
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def test_a_staged_bucket_holds_every_tensor_by_name_with_its_dtype_shape_and_bytes_and_owns_them():
    rng = random.Random(5)
    buf = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    other = torch.randn(6, 4)
    weights = _bucket(rng, buf, 200)
    weights.insert(7, ("transposed", other.t()))           # not contiguous: copied on its own
    weights.insert(50, ("empty", buf[:0].view(torch.float32).view(0, 3)))
    weights.insert(90, ("elsewhere", other[1]))            # another storage between two neighbours
    want = [(n, t.dtype, tuple(t.shape), _bytes(t)) for n, t in weights]
    area = StagingArea("v", torch.device("cpu"))
    area.add(weights)
    buf.zero_()                                            # the PS reuses its buffer for the next bucket
    other.zero_()
    (staged,) = area.buckets
    assert [(n, t.dtype, tuple(t.shape), _bytes(t)) for n, t in staged] == want
    assert area.tensors == len(weights) and area.names == {n for n, _ in weights}


class _Copies(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "copy_":
            self.copies += 1
        return func(*args, **(kwargs or {}))


def test_neighbours_in_the_buffer_are_staged_by_one_copy():
    buf = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    weights = [(f"e{i}", buf[512 * i: 512 * i + 384].view(torch.bfloat16).view(4, 48)) for i in range(100)]
    weights += [("far", buf[60000: 60064].view(torch.float32))]   # beyond the largest hole a run spans
    area = StagingArea("v", torch.device("cpu"))
    with _Copies() as mode:
        area.add(weights)
    assert mode.copies == 2
    assert all(torch.equal(s.view(torch.uint8), w.view(torch.uint8)) for (_, s), (_, w) in zip(area.buckets[0], weights))
