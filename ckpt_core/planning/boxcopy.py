"""A box of a host tensor as a few pitched (2-D) copies, cut where the host memory's pinning is.

A slice that an engine rank reads (``planning/slices.py``) is a box of a row-major checkpoint
tensor: contiguous (a run of rows), or strided (columns of a row-parallel layer, one expert's
rows of a fused tensor). The owner copies it from host memory into a packed device bucket.
A strided host-to-device copy through torch goes through a pageable temporary (a gather on
the CPU, then a pageable copy); a pitched copy (``cudaMemcpy2D``) reads the pinned rows at the
link's rate. And host regions are pinned in ``PIN_CHUNK`` pieces: CUDA refuses one copy whose
source spans two pinned ranges ("invalid argument"), so no copy here crosses a piece's border.

Pure: the copies are planned here, a device backend issues them (``DeviceBackend.copy_pitched``).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

from ckpt_core.planning.buckets import PIN_CHUNK


class Pitched(NamedTuple):
    """``height`` rows of ``width`` bytes, the first at byte ``src`` of the host buffer and the next
    each ``pitch`` bytes further, packed at byte ``dst`` of the destination (rows back to back)."""
    src: int
    pitch: int
    width: int
    height: int
    dst: int


def byte_dims(shape, offsets, extent, itemsize: int) -> tuple[int, list[tuple[int, int]]]:
    """The box as bytes: (byte offset of its first element, [(size, stride)] per dimension, in
    bytes, innermost last), with dimensions of size 1 dropped and dimensions that follow each
    other in memory merged; the innermost has stride 1 (a run of contiguous bytes)."""
    shape = list(shape) or [1]
    extent = list(extent) or [1]
    offsets = list(offsets) or [0]
    strides = [itemsize * math.prod(shape[i + 1:]) for i in range(len(shape))]
    start = sum(o * s for o, s in zip(offsets, strides))
    dims: list[tuple[int, int]] = [(itemsize, 1)]
    for n, s in zip(reversed(extent), reversed(strides)):
        if n == 1:
            continue
        size, stride = dims[0]
        if s == size * stride:     # this dimension continues the one inside it
            dims[0] = (n * size, stride)
        else:
            dims.insert(0, (n, s))
    return start, dims


def box_copies(shape, offsets, extent, itemsize: int, *, base_offset: int = 0, dst: int = 0,
               pin_chunk: int = PIN_CHUNK) -> list[Pitched]:
    """The pitched copies that pack the box (``offsets``, ``extent``) of the row-major tensor of
    ``shape`` whose bytes start at ``base_offset`` of a host buffer, at ``dst`` of the destination;
    none crosses a multiple of ``pin_chunk`` of the buffer (a pinned piece's border)."""
    if math.prod(extent or (1,)) == 0:
        return []
    start, dims = byte_dims(shape, offsets, extent, itemsize)
    width = dims[-1][0]
    if len(dims) == 1:
        rows = [(base_offset + start, 0, 1)]          # one contiguous run
    else:
        height, pitch = dims[-2]
        outer = dims[:-2]
        rows = [(base_offset + start + sum(i * s for i, (_, s) in zip(idx, outer)), pitch, height)
                for idx in itertools.product(*(range(n) for n, _ in outer))]
    out: list[Pitched] = []
    at = dst
    for src, pitch, height in rows:
        out += _cut(src, pitch, width, height, at, pin_chunk)
        at += width * height
    return out


def _cut(src: int, pitch: int, width: int, height: int, dst: int, chunk: int) -> list[Pitched]:
    """One block of rows, cut so that no copy's source crosses a multiple of ``chunk``."""
    out: list[Pitched] = []
    i = 0
    while i < height:
        row = src + i * pitch
        end = (row // chunk + 1) * chunk          # the border after this row's first byte
        if row + width > end:                     # the row itself crosses: pieces of one row
            a, b, d = row, row + width, dst + i * width
            while a < b:
                c = min(b, (a // chunk + 1) * chunk)
                out.append(Pitched(a, 0, c - a, 1, d))
                d += c - a
                a = c
            i += 1
            continue
        fit = height - i if pitch == 0 else min(height - i, (end - width - row) // pitch + 1)
        out.append(Pitched(row, pitch if fit > 1 else 0, width, fit, dst + i * width))
        i += fit
    return out


def copied_bytes(copies: list[Pitched]) -> int:
    return sum(c.width * c.height for c in copies)
