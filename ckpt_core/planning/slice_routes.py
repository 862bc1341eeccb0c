"""Routing by a slice plan (``planning/slices.py``): the buckets that give each engine rank only what
its loaders read, from tensors registered whole or in pieces (trainer shards), each bucket of slices
for one engine rank and its data-parallel replicas (PS rank p feeds engine rank p % T).

No torch, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from ckpt_core.errors import ConfigError
from ckpt_core.planning.boxcopy import Pitched, box_copies
from ckpt_core.planning.buckets import (
    MAX_GAP,
    PIN_CHUNK,
    SHARED,
    Bucket,
    Placement,
    Plan,
    Scatter,
    TensorMeta,
    _pack_owner,
    align_up,
    delivery_order,
    first_shared_name,
    interleave,
    pack_pieced,
)
from ckpt_core.planning.pieces import PiecedTensor, contiguous_start, group_pieces
from ckpt_core.planning.slices import Box, SlicePlan, box_extent, box_offsets, make_box


class BoxCopy(NamedTuple):
    """A host-to-bucket copy of (part of) one slice: the box ``box`` of the host tensor of ``shape``
    (a whole tensor, or a piece of one registered in pieces) whose bytes start at ``base_offset`` of
    host buffer ``base``, packed at ``offset`` of the bucket by rank ``rank`` (-1: the bucket's owner)."""
    base: int
    base_offset: int
    shape: tuple[int, ...]
    box: Box
    itemsize: int
    offset: int
    rank: int = -1

    def copies(self, pin_chunk: int = PIN_CHUNK) -> list[Pitched]:
        """This copy as pitched copies of the host buffer (``planning/boxcopy.py``), none across a
        multiple of ``pin_chunk`` of it."""
        return box_copies(self.shape, box_offsets(self.shape, self.box), box_extent(self.shape, self.box),
                          self.itemsize, base_offset=self.base_offset, dst=self.offset, pin_chunk=pin_chunk)


class Part(NamedTuple):
    """Bytes ``[offset, offset + nbytes)`` of a bucket of slices that ``rank`` stages and sends;
    ``payload``: the bytes of slices in it (the rest is alignment)."""
    rank: int
    offset: int
    nbytes: int
    payload: int


@dataclass
class SlicedBucket(Bucket):
    """A bucket of engine rank ``dest``'s slices. It reaches the PS ranks ``ranks`` only (every PS
    rank p with p % T == dest: the replicas of that engine rank), never the others. Each part is
    staged by its rank (``boxes``) and sent once; strided intersections of pieces are placed into
    their slices' layout on arrival (``scatters``)."""
    dest: int = 0
    boxes: tuple[BoxCopy, ...] = ()
    ranks: tuple[int, ...] = ()
    parts: tuple[Part, ...] = ()

    # A sliced bucket's segments are Parts: rank, offset and nbytes as a Segment's, then the payload
    # (its bytes without gaps) where a Segment has its copy runs; the paths that read runs take
    # SlicedBuckets apart (transfer/pipeline.py, p2p/update.py).
    @cached_property
    def segments(self) -> tuple[Part, ...]:  # type: ignore[override]
        return self.parts or (Part(self.owner, 0, self.nbytes, self.nbytes),)

    def reaches(self, rank: int) -> bool:
        return rank in (self.ranks or (self.dest,))


class _Copy(NamedTuple):
    """One host box that fills the box ``within`` (offsets in the slice) of extent ``extent`` of a slice."""
    rank: int
    base: int
    base_offset: int
    shape: tuple[int, ...]       # the host tensor's (the piece's own for a piece)
    offsets: tuple[int, ...]     # of the copied box in the host tensor
    within: tuple[int, ...]
    extent: tuple[int, ...]


class _Unit(NamedTuple):
    """One tensor's slice for one engine rank: what the engine is told, and the copies that fill it."""
    name: str
    dtype: str
    extent: tuple[int, ...]
    itemsize: int
    copies: tuple[_Copy, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.extent) * self.itemsize

    def strided(self) -> dict[int, int]:
        """Bytes per rank of the copies that are not one run of the slice (packed apart, then placed)."""
        out: dict[int, int] = {}
        for c in self.copies:
            if contiguous_start(self.extent, c.within, c.extent) is None:
                out[c.rank] = out.get(c.rank, 0) + math.prod(c.extent) * self.itemsize
        return out

    def need(self) -> int:
        return align_up(self.nbytes) + sum(align_up(n) for n in self.strided().values())


def replica_ranks(world: int, tp: int) -> list[tuple[int, ...]]:
    """The PS ranks each engine rank is fed through: PS rank p feeds engine rank p % tp, so a
    world of R x tp ranks feeds R replicas of a tp-rank engine (replica p // tp). ConfigError
    when ``tp`` does not divide ``world``."""
    if tp < 1 or world % tp:
        raise ConfigError(f"the slice plan has {tp} engine ranks, the parameter server {world} ranks: each PS "
                          f"rank p feeds engine rank p % {tp}, so the PS world must be a multiple of {tp}")
    return [tuple(range(t, world, tp)) for t in range(tp)]


def plan_sliced(metas_per_rank: list[list[TensorMeta]], plan: SlicePlan, bucket_bytes: int) -> Plan:
    """Buckets that give each engine rank only what its loaders read.

    PS rank p feeds engine rank p % T (T = the plan's engine ranks; the PS world is R x T ranks:
    R data-parallel replicas of the engine, replica p // T; another size is a ConfigError naming
    both). A tensor every engine rank reads whole is broadcast whole (ordinary buckets, tensors
    in pieces as in ``plan_buckets``). Every other tensor goes to each engine rank that reads it,
    as its slice (or whole, where that rank reads it whole: an expert that one rank holds under
    expert parallelism), in buckets of that engine rank's slices, each of which reaches only the
    PS ranks of that engine rank (one transfer shared by the replicas); a rank that reads nothing
    of a tensor receives none of it. A whole tensor's slices are packed per (owner, engine rank);
    a tensor registered in pieces has its slice assembled from the slice's intersections with the
    pieces, each copied by the piece's owner and placed at its offset in the slice, which arrives
    as one contiguous tensor of the slice's extent. Raises ConfigError for a checkpoint that
    differs from the one the plan was recorded for, CheckpointFormatError for pieces that do not
    tile their tensor.
    """
    groups = replica_ranks(len(metas_per_rank), len(plan.ranks))
    first_shared = first_shared_name(metas_per_rank)
    if first_shared:
        raise ConfigError(f"tensor {first_shared[0]!r} is registered on rank {first_shared[1]} and on rank "
                          f"{first_shared[2]}")
    pieced = group_pieces(metas_per_rank)
    _same_checkpoint(metas_per_rank, plan)
    whole = _read_whole(plan)
    streams: list[list[Bucket]] = []
    for owner, metas in enumerate(metas_per_rank):
        ordered = delivery_order([m for m in metas if m.box is None])
        streams.append(_pack_owner(owner, [m for m in ordered if m.name in whole], bucket_bytes))
        for rs in plan.ranks:
            units = [_whole_unit(owner, m, rs.needs[m.name]) for m in ordered
                     if m.name not in whole and m.name in rs.needs]
            streams.append(_pack_units(rs.rank, groups[rs.rank], units, bucket_bytes))
    streams.append(pack_pieced([t for t in pieced if t.name in whole], bucket_bytes))
    for rs in plan.ranks:
        units = [_pieced_unit(t, rs.needs[t.name]) for t in pieced if t.name not in whole and t.name in rs.needs]
        streams.append(_pack_units(rs.rank, groups[rs.rank], units, bucket_bytes))
    return Plan(bucket_bytes, tuple(interleave(streams)))


def sliced_sizes(metas_per_rank: list[list[TensorMeta]], plan: SlicePlan) -> tuple[int, int]:
    """``layout_sizes`` of a sliced update (``plan_sliced``'s buckets), for ``choose_layout``: (the
    largest unit a bucket must hold: a tensor every engine rank reads whole, or one engine rank's
    slice of a tensor with its scratch; the largest total one owner sends under the plan). The
    tensors in pieces count as one more owner, as in ``layout_sizes``.

    The buckets are then sized by what moves: an engine rank that receives an eighth of the
    checkpoint gets it in several buckets (so the owner's copies overlap the worker's loads), not
    in the one or two that the owner's whole share would make. The checks ``plan_sliced`` makes
    are made there, not here: a plan that does not fit these metas raises there (ConfigError)."""
    replica_ranks(len(metas_per_rank), len(plan.ranks))
    _same_checkpoint(metas_per_rank, plan)
    whole = _read_whole(plan)
    largest, totals = 0, []
    for owner, metas in enumerate(metas_per_rank):
        total = 0
        for m in metas:
            if m.box is not None:
                continue
            if m.name in whole:
                largest, total = max(largest, m.nbytes), total + align_up(m.nbytes)
                continue
            for rs in plan.ranks:
                if m.name in rs.needs:
                    need = _whole_unit(owner, m, rs.needs[m.name]).need()
                    largest, total = max(largest, need), total + need
        totals.append(total)
    pieced_total = 0
    for t in group_pieces(metas_per_rank):
        if t.name in whole:
            need = t.nbytes + t.scratch_bytes
            largest, pieced_total = max(largest, need), pieced_total + align_up(t.nbytes) + t.scratch_bytes
            continue
        for rs in plan.ranks:
            if t.name in rs.needs:
                need = _pieced_unit(t, rs.needs[t.name]).need()
                largest, pieced_total = max(largest, need), pieced_total + need
    totals.append(pieced_total)
    return largest, max(max(totals), 1)


def _read_whole(plan: SlicePlan) -> set[str]:
    """The tensors every engine rank of ``plan`` reads whole (broadcast whole)."""
    return {n for n in plan.tensors if all(n in rs.needs and not rs.needs[n] for rs in plan.ranks)}


def _same_checkpoint(metas_per_rank: list[list[TensorMeta]], plan: SlicePlan) -> None:
    have = {m.name: (m.dtype, tuple(m.shape if m.box is None else m.box[0])) for ms in metas_per_rank for m in ms}
    for name, (dtype, shape, _) in plan.tensors.items():
        if name in have and have[name] != (dtype, tuple(shape)):
            raise ConfigError(f"tensor {name!r} is {have[name][0]}{list(have[name][1])} in the checkpoint, "
                              f"{dtype}{list(shape)} in the slice plan: record the plan for this checkpoint")
    unknown = sorted(set(have) - set(plan.tensors))
    if unknown:
        raise ConfigError(f"the slice plan was recorded without {', '.join(unknown[:5])} "
                          f"({len(unknown)} tensor(s) of the checkpoint): record the plan for this checkpoint")


def _whole_unit(owner: int, m: TensorMeta, box: Box | None) -> _Unit:
    """The slice ``box`` of a whole tensor: one copy, by its owner."""
    ext = box_extent(m.shape, box)
    copy = _Copy(owner, m.base, m.base_offset, tuple(m.shape), box_offsets(m.shape, box), (0,) * len(ext), ext)
    return _Unit(m.name, m.dtype, ext, m.itemsize, (copy,))


def _pieced_unit(t: PiecedTensor, box: Box | None) -> _Unit:
    """The slice ``box`` of a tensor in pieces: one copy per piece it meets, of their intersection."""
    off, ext = box_offsets(t.shape, box), box_extent(t.shape, box)
    copies = []
    for p in t.pieces:
        lo = tuple(max(a, b) for a, b in zip(off, p.offsets))
        hi = tuple(min(a + n, b + k) for a, n, b, k in zip(off, ext, p.offsets, p.shape))
        if any(h <= a for a, h in zip(lo, hi)):
            continue
        copies.append(_Copy(p.rank, p.meta.base, p.meta.base_offset, tuple(p.shape),
                            tuple(a - o for a, o in zip(lo, p.offsets)), tuple(a - o for a, o in zip(lo, off)),
                            tuple(h - a for a, h in zip(lo, hi))))
    return _Unit(t.name, t.dtype, ext, t.itemsize, tuple(copies))


def _pack_units(dest: int, ranks: tuple[int, ...], units: list[_Unit], bucket_bytes: int) -> list[Bucket]:
    """Engine rank ``dest``'s slices, packed in order into buckets of at most ``bucket_bytes``."""
    out: list[Bucket] = []
    cur: list[_Unit] = []
    used = 0
    for u in units:
        need = u.need()
        if need > bucket_bytes:
            scratch = sum(u.strided().values())
            more = f", {scratch} more to assemble it from pieces" if scratch else ""
            raise ConfigError(f"the slice of tensor {u.name!r} for engine rank {dest} ({u.nbytes} bytes{more}) does "
                              f"not fit a bucket of {bucket_bytes} bytes; raise PS_MAX_BUCKET_SIZE_GB")
        if cur and used + need > bucket_bytes:
            out.append(_slices_bucket(dest, ranks, cur))
            cur, used = [], 0
        cur.append(u)
        used += need
    if cur:
        out.append(_slices_bucket(dest, ranks, cur))
    return out


def _slices_bucket(dest: int, ranks: tuple[int, ...], units: list[_Unit]) -> SlicedBucket:
    """Slices at aligned offsets; a copy that is one run of its slice is packed straight into place,
    a strided one after the slices (each rank's together), placed on arrival. Each rank's runs
    with nothing of another rank between them are one part."""
    placements = []
    direct: list[tuple[int, _Copy, _Unit]] = []               # (bucket offset, copy, unit)
    strided: dict[int, list[tuple[_Copy, _Unit, int]]] = {}   # rank -> (copy, unit, its place)
    pos = 0
    for u in units:
        at = align_up(pos)
        placements.append(Placement(TensorMeta(u.name, u.dtype, u.extent, u.nbytes, u.itemsize, -1, 0), at))
        for c in u.copies:
            start = contiguous_start(u.extent, c.within, c.extent)
            if start is None:
                strided.setdefault(c.rank, []).append((c, u, at))
            else:
                direct.append((at + start * u.itemsize, c, u))
        pos = at + u.nbytes
    boxes, scatters = [], []
    runs: list[list[int]] = []   # [rank, start, end, payload]
    for at, c, u in sorted(direct, key=lambda d: d[0]):
        n = math.prod(c.extent) * u.itemsize
        boxes.append(_box_copy(c, u, at))
        if runs and runs[-1][0] == c.rank and 0 <= at - runs[-1][2] <= MAX_GAP:
            runs[-1][2], runs[-1][3] = at + n, runs[-1][3] + n
        else:
            runs.append([c.rank, at, at + n, n])
    for rank in sorted(strided):
        pos = start = align_up(pos)
        for c, u, at in strided[rank]:
            boxes.append(_box_copy(c, u, pos))
            scatters.append(Scatter(pos, at, u.extent, c.within, c.extent, u.itemsize))
            pos += math.prod(c.extent) * u.itemsize
        runs.append([rank, start, pos, pos - start])
    parts = tuple(Part(r, a, b - a, n) for r, a, b, n in runs if b > a)
    owners = {p.rank for p in parts}
    return SlicedBucket(owners.pop() if len(owners) == 1 else SHARED, placements, pos, scatters=tuple(scatters),
                        dest=dest, boxes=tuple(boxes), ranks=ranks, parts=parts)


def _box_copy(c: _Copy, u: _Unit, offset: int) -> BoxCopy:
    return BoxCopy(c.base, c.base_offset, c.shape, make_box(c.shape, c.offsets, c.extent), u.itemsize, offset, c.rank)


def rank_placements(plan: Plan, rank: int) -> list[list[tuple[str, str, tuple[int, ...], int]]]:
    """What PS rank ``rank``'s worker is told of each bucket: its engine rank's slices and the whole
    tensors (a bucket of slices for another engine rank: nothing; it is not even in this rank's buffer)."""
    return [[(p.meta.name, p.meta.dtype, p.meta.shape, p.offset) for p in b.placements]
            if b.reaches(rank) else [] for b in plan.buckets]


def received_bytes(plan: Plan, rank: int) -> int:
    """Bytes of tensors and slices PS rank ``rank`` (its worker) receives under ``plan`` (per bucket:
    each bucket's payload is summed once per plan)."""
    return sum(b.payload for b in plan.buckets if b.reaches(rank))


def replica_groups(plan: Plan) -> list[tuple[int, ...]]:
    """The groups of more than one PS rank the plan's buckets of slices are broadcast in, in order of
    first use (every rank computes the same list from the same plan)."""
    seen: dict[tuple[int, ...], None] = {}
    for b in plan.buckets:
        if isinstance(b, SlicedBucket) and len(b.ranks) > 1:
            seen.setdefault(b.ranks)
    return list(seen)
