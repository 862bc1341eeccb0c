"""Pure planning of tensors registered in pieces (FSDP2/TP shards, ``TensorShard`` boxes).

A piece is a box of a tensor: the ``TensorMeta`` of its local bytes carries ``box =
(global_shape, offsets)``. The ranks' pieces of one name must tile the tensor exactly (no
overlap, no gap, one dtype, one global shape); :func:`group_pieces` checks that on the
gathered metas, so every rank reaches the same verdict without talking, and groups them.

Plain data in, plain data out: no torch, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from ckpt_core.errors import CheckpointFormatError

if TYPE_CHECKING:   # buckets.py imports this module
    from ckpt_core.planning.buckets import TensorMeta


class Piece(NamedTuple):
    rank: int
    meta: TensorMeta             # the owner's (its ``shape`` is the box's extent; its ``box`` is set)
    offsets: tuple[int, ...]
    start: int | None            # ``contiguous_start`` of the box: None for a strided piece

    @property
    def shape(self) -> tuple[int, ...]:
        return self.meta.shape


@dataclass(frozen=True)
class PiecedTensor:
    """One tensor of the checkpoint as the ranks' pieces make it up."""
    name: str
    dtype: str
    shape: tuple[int, ...]       # the global shape
    itemsize: int
    pieces: tuple[Piece, ...]    # in row-major order of their first element
    scratch_bytes: int = 0       # bytes of its strided pieces (broadcast packed, then placed)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def contiguous_start(shape, offsets, extent) -> int | None:
    """The element index where a box starts if its elements are one contiguous run of the
    row-major tensor, else None. A box is contiguous when, past its first dimension of extent
    other than 1, it spans every later dimension whole (a range of rows is the usual case)."""
    n = len(shape)
    k = 0
    while k < n and extent[k] == 1:
        k += 1
    for i in range(k + 1, n):
        if extent[i] != shape[i]:
            return None
    start, stride = 0, 1
    for i in range(n - 1, -1, -1):
        start += offsets[i] * stride
        stride *= shape[i]
    return start


def piece_key(name: str, offsets) -> str:
    """A piece's name where whole tensors use theirs (P2P digests): ``name@o0,o1,...``."""
    return f"{name}@{','.join(str(o) for o in offsets)}"


def meta_key(meta) -> str:
    return meta.name if meta.box is None else piece_key(meta.name, meta.box[1])


def group_pieces(metas_per_rank: list[list]) -> list[PiecedTensor]:
    """Every pieced tensor, checked to tile exactly; in order of first appearance (rank by rank).

    Raises ``CheckpointFormatError`` naming the tensor and the ranks for a whole tensor of the
    same name as pieces, a dtype or global-shape disagreement, a box outside the tensor, two
    overlapping boxes, or a gap.
    """
    found: dict[str, list[Piece]] = {}
    whole: dict[str, int] = {}
    for rank, metas in enumerate(metas_per_rank):
        for m in metas:
            if m.box is not None:
                found.setdefault(m.name, []).append(Piece(rank, m, m.box[1], None))   # start: _check_tiling
            else:
                whole.setdefault(m.name, rank)
    out = []
    for name, pieces in found.items():
        if name in whole:
            raise CheckpointFormatError(f"registered whole on rank {whole[name]} and in pieces on rank(s) "
                                        f"{sorted({p.rank for p in pieces})}", tensor=name)
        out.append(_check_tiling(name, pieces))
    return out


def _check_tiling(name: str, pieces: list[Piece]) -> PiecedTensor:
    first = pieces[0]
    shape, dtype = _box(first)[0], first.meta.dtype
    ndim = len(shape)
    live = []
    for p in pieces:
        if p.meta.dtype != dtype:
            raise CheckpointFormatError(f"pieces disagree on the dtype: {dtype} on rank {first.rank}, "
                                        f"{p.meta.dtype} on rank {p.rank}", tensor=name)
        if _box(p)[0] != shape:
            raise CheckpointFormatError(f"pieces disagree on the global shape: {list(shape)} on rank {first.rank}, "
                                        f"{list(_box(p)[0])} on rank {p.rank}", tensor=name)
        ext = p.meta.shape
        if len(p.offsets) != ndim or len(ext) != ndim or not all(
                0 <= p.offsets[d] and p.offsets[d] + ext[d] <= shape[d] for d in range(ndim)):
            raise CheckpointFormatError(f"rank {p.rank}'s piece at offsets {list(p.offsets)} of extent "
                                        f"{list(ext)} lies outside the global shape {list(shape)}", tensor=name)
        if p.meta.nbytes:
            live.append(Piece(p.rank, p.meta, p.offsets, contiguous_start(shape, p.offsets, ext)))
    total = math.prod(shape)
    runs = [(p.start, p) for p in live if p.start is not None]
    if len(runs) == len(live):   # runs of the flat tensor (rows): a 1-D check suffices
        runs.sort(key=lambda r: r[0])
        live = [p for _, p in runs]
        _runs_tile(name, runs, shape, [p.rank for p in pieces])
    else:
        live.sort(key=lambda p: p.offsets)
        _no_overlap(name, live)
    covered = sum(math.prod(p.shape) for p in live)
    if covered != total:
        raise CheckpointFormatError(f"the pieces of rank(s) {sorted({p.rank for p in pieces})} cover {covered} of "
                                    f"its {total} elements (global shape {list(shape)}): a piece is missing",
                                    tensor=name)
    scratch = sum(p.meta.nbytes for p in live if p.start is None)
    return PiecedTensor(name, dtype, shape, first.meta.itemsize, tuple(live), scratch)


def _runs_tile(name: str, runs: list[tuple[int, Piece]], shape, ranks: list[int]) -> None:
    """Contiguous pieces (first element, piece) sorted by their first element: each must start where the
    previous ended (an overlap names both ranks; a gap is reported by the caller's element count)."""
    end, prev = 0, None
    for start, p in runs:
        if prev is not None and start < end:   # the first starts at >= 0 = end
            raise CheckpointFormatError(
                f"the pieces of rank {prev.rank} (offsets {list(prev.offsets)}, extent {list(prev.shape)}) and rank "
                f"{p.rank} (offsets {list(p.offsets)}, extent {list(p.shape)}) overlap", tensor=name)
        end, prev = start + math.prod(p.shape), p


def _no_overlap(name: str, live: list[Piece]) -> None:
    """A sweep along dimension 0: only boxes whose row ranges meet are compared."""
    active: list[Piece] = []
    for p in live:
        lo = p.offsets[0] if p.offsets else 0
        active = [a for a in active if not a.offsets or a.offsets[0] + a.shape[0] > lo]
        for a in active:
            if all(ao < po + pe and po < ao + ae for ao, ae, po, pe in zip(a.offsets, a.shape, p.offsets, p.shape)):
                raise CheckpointFormatError(
                    f"the pieces of rank {a.rank} (offsets {list(a.offsets)}, extent {list(a.shape)}) and rank "
                    f"{p.rank} (offsets {list(p.offsets)}, extent {list(p.shape)}) overlap", tensor=name)
        active.append(p)


def _box(p: Piece) -> tuple:
    """The piece's (global shape, offsets): set on every meta that group_pieces hands out as a piece."""
    box = p.meta.box
    if box is None:
        raise CheckpointFormatError(f"rank {p.rank}'s piece has no box (global shape, offsets)", tensor=p.meta.name)
    return box
