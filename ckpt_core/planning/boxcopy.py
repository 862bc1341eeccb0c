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
    each ``pitch`` bytes further, placed from byte ``dst`` of the destination, each row ``dpitch``
    bytes after the one before (0: back to back, as ``box_copies`` packs a box).

    ``depth`` > 1: that many such blocks, each ``step`` bytes of source and ``dstep`` bytes of
    destination after the one before (``merge_copies``: one layer's experts' column slices)."""
    src: int
    pitch: int
    width: int
    height: int
    dst: int
    dpitch: int = 0
    depth: int = 1
    step: int = 0
    dstep: int = 0

    def last_src(self) -> int:
        """The source's last byte."""
        return self.src + (self.depth - 1) * self.step + (self.height - 1) * self.pitch + self.width - 1

    def layers(self) -> list[Pitched]:
        """The copy as 2-D copies, one per block (itself when ``depth`` is 1)."""
        if self.depth == 1:
            return [self]
        return [Pitched(self.src + i * self.step, self.pitch, self.width, self.height, self.dst + i * self.dstep,
                        self.dpitch) for i in range(self.depth)]


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
    return sum(c.width * c.height * c.depth for c in copies)


LOOKAHEAD = 4   # runs tried as the second of a progression (one layer's gate and up slices alternate)


def merge_copies(copies: list[Pitched], pin_chunk: int = PIN_CHUNK) -> list[Pitched]:
    """The same bytes to the same places in fewer copies (each device copy is a driver call).

    Runs (one row) that continue each other in the source and the destination become one run; runs
    of one width whose source and destination advance by constant steps (one expert's slice after
    another's: a layer of many experts is a handful of copies) become one copy of evenly spaced
    rows with a destination pitch. Blocks of rows of one shape (width, height, pitches) at constant
    source and destination steps become one copy of ``depth`` blocks (one expert's column slice
    after another's: a layer's down slices are one copy, not one per expert). No merged copy's
    source crosses a multiple of ``pin_chunk`` (a pinned piece's border). The copies' destinations
    are disjoint, so their order does not matter; they come back in destination order.
    """
    deep = [c for c in copies if c.depth != 1]
    blocks = _stacks(sorted((c for c in copies if c.height != 1 and c.depth == 1), key=lambda c: c.dst), pin_chunk)
    runs = _join_runs(sorted((c for c in copies if c.height == 1 and c.depth == 1), key=lambda c: c.dst), pin_chunk)
    return sorted(deep + blocks + _progressions(runs, pin_chunk), key=lambda c: c.dst)


def _stacks(blocks: list[Pitched], chunk: int) -> list[Pitched]:
    """Blocks of one shape at constant source and destination steps, as single copies of ``depth``
    blocks: from each block not yet taken, the longest progression through one of the next few of
    its shape (in destination order), inside its pinned piece."""
    by_shape: dict[tuple[int, int, int, int], list[Pitched]] = {}
    for b in blocks:
        by_shape.setdefault((b.width, b.height, b.pitch, b.dpitch or b.width), []).append(b)
    out: list[Pitched] = []
    for group in by_shape.values():
        for a, nxt, n in _longest_progressions(group, _stack_chain, chunk):
            out.append(a if nxt is None else a._replace(depth=1 + n, step=nxt.src - a.src, dstep=nxt.dst - a.dst))
    return out


def _longest_progressions(group: list[Pitched], chain, chunk: int) -> list[tuple[Pitched, Pitched | None, int]]:
    """Greedy over ``group`` (one shape, in destination order): from each copy not yet taken, the
    longest ``chain`` through one of the next ``LOOKAHEAD`` copies not taken; ``(first, second or None,
    how many follow the first)`` per progression found (a lone copy: ``(first, None, 0)``)."""
    at = {(c.src, c.dst): i for i, c in enumerate(group)}
    used = [False] * len(group)
    out: list[tuple[Pitched, Pitched | None, int]] = []
    for i, a in enumerate(group):
        if used[i]:
            continue
        used[i] = True
        best: list[int] = []
        for j in [j for j in range(i + 1, len(group)) if not used[j]][:LOOKAHEAD]:
            found = chain(a, group[j].src - a.src, group[j].dst - a.dst, at, used, chunk)
            if len(found) > len(best):
                best = found
        for j in best:
            used[j] = True
        out.append((a, group[best[0]] if best else None, len(best)))
    return out


def _stack_chain(a: Pitched, step: int, dstep: int, at: dict, used: list[bool], chunk: int) -> list[int]:
    """The blocks (their indices) after ``a`` at ``step`` bytes of source and ``dstep`` of destination
    each, while they exist, are free and stay in ``a``'s pinned piece (the copies' destinations are
    disjoint; positive steps keep the blocks in order)."""
    if step <= 0 or dstep <= 0:
        return []
    out: list[int] = []
    k = 1
    while True:
        j = at.get((a.src + k * step, a.dst + k * dstep))
        if j is None or used[j] or a._replace(src=a.src + k * step).last_src() // chunk != a.src // chunk:
            return out
        out.append(j)
        k += 1


def _join_runs(runs: list[Pitched], chunk: int) -> list[Pitched]:
    out: list[Pitched] = []
    for r in runs:
        if out:
            a = out[-1]
            if (a.src + a.width == r.src and a.dst + a.width == r.dst
                    and a.src // chunk == (r.src + r.width - 1) // chunk):
                out[-1] = Pitched(a.src, 0, a.width + r.width, 1, a.dst)
                continue
        out.append(r)
    return out


def _progressions(runs: list[Pitched], chunk: int) -> list[Pitched]:
    """Runs of one width at constant source and destination steps, as single pitched copies: from
    each run not yet taken, the longest progression through one of the next few runs of its width."""
    by_width: dict[int, list[Pitched]] = {}
    for r in runs:
        by_width.setdefault(r.width, []).append(r)
    out: list[Pitched] = []
    for width, group in by_width.items():   # each already in destination order
        for a, b, n in _longest_progressions(group, _chain, chunk):
            out.append(a if b is None else Pitched(a.src, b.src - a.src, width, 1 + n, a.dst, b.dst - a.dst))
    return out


def _chain(a: Pitched, step: int, dstep: int, at: dict, used: list[bool], chunk: int) -> list[int]:
    """The runs (their indices) after ``a`` at ``step`` bytes of source and ``dstep`` of destination
    each, while they exist, are free and stay in ``a``'s pinned piece; rows may not overlap."""
    if step < a.width or dstep < a.width:
        return []
    out: list[int] = []
    k = 1
    while True:
        j = at.get((a.src + k * step, a.dst + k * dstep))
        if j is None or used[j] or (a.src + k * step + a.width - 1) // chunk != a.src // chunk:
            return out
        out.append(j)
        k += 1
