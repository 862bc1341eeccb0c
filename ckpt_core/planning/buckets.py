"""Pure planning: how the tensors of every rank are packed into buckets.

Plain data in, plain data out; no torch, no I/O. All ranks run the same
function on the same gathered metas and so agree on the plan without talking.

A bucket belongs to one owner rank, whose host memory holds its bytes. Inside
a bucket each tensor gets an offset. Where consecutive tensors sit next to each
other in one host buffer, they keep their relative position, so the owner's
host-to-device copy of a bucket is a handful of large copies ("runs") rather
than one per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple, TypeVar

from ckpt_core.errors import ConfigError
from ckpt_core.planning.pieces import Piece, PiecedTensor, group_pieces, piece_key

ALIGN = 256          # offset alignment of a tensor placed on its own in a bucket
_T = TypeVar("_T")
PIN_CHUNK = 512 << 20   # host regions are pinned in pieces of this size, at offsets that are multiples of it
MAX_GAP = 4096       # largest hole between neighbours that we copy rather than close


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class TensorMeta(NamedTuple):
    """One tensor as a rank describes it: ``base``/``base_offset`` locate its bytes in that rank's host memory.

    A NamedTuple, not a dataclass: gather_metas builds thousands of them per call.
    """
    name: str
    dtype: str           # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]
    nbytes: int
    itemsize: int
    base: int            # id of the host buffer on the owner rank
    base_offset: int     # byte offset in that buffer
    # A piece of a tensor registered in pieces (``planning/pieces.py``): (global shape, offsets of
    # the box); ``shape``/``nbytes`` are then the piece's own. None: the whole tensor.
    box: tuple | None = None


@dataclass(frozen=True)
class Placement:
    meta: TensorMeta
    offset: int          # byte offset inside the bucket


@dataclass(frozen=True)
class CopyRun:
    """One contiguous host -> bucket copy on the owner rank."""
    base: int
    base_offset: int
    offset: int
    nbytes: int


def split_at_pin_chunks(run: CopyRun) -> list[CopyRun]:
    """Host regions are pinned in PIN_CHUNK pieces and one device copy may not span two pinned
    ranges (CUDA then refuses it or falls back to a pageable copy): cut the run at the boundaries."""
    out = []
    a, end = run.base_offset, run.base_offset + run.nbytes
    while a < end:
        b = min(end, (a // PIN_CHUNK + 1) * PIN_CHUNK)
        out.append(CopyRun(run.base, a, run.offset + (a - run.base_offset), b - a))
        a = b
    return out or [run]


def merge_runs(runs) -> list[CopyRun]:
    """Merge consecutive copies whose host and bucket positions advance together."""
    out: list[CopyRun] = []
    for r in runs:
        if out:
            last = out[-1]
            if (last.base == r.base and r.base_offset - last.base_offset == r.offset - last.offset
                    and r.base_offset >= last.base_offset + last.nbytes):
                out[-1] = CopyRun(last.base, last.base_offset, last.offset, r.base_offset + r.nbytes - last.base_offset)
                continue
        out.append(r)
    return out


@dataclass(frozen=True)
class Segment:
    """Bytes ``[offset, offset + nbytes)`` of a bucket that ``rank`` stages (``runs``, cut at
    PIN_CHUNK boundaries) and broadcasts."""
    rank: int
    offset: int
    nbytes: int
    runs: tuple[CopyRun, ...]


@dataclass(frozen=True)
class Scatter:
    """A strided piece: broadcast packed at ``src``, then copied on every rank into its box of the
    whole tensor at ``dst`` (global ``shape``, box ``offsets`` and ``extent``, ``itemsize`` bytes
    per element)."""
    src: int
    dst: int
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    extent: tuple[int, ...]
    itemsize: int


class PieceSpan(NamedTuple):
    """Where one rank's piece lands in a bucket as broadcast (before strided pieces are placed)."""
    rank: int
    key: str             # ``pieces.piece_key``: what its owner's digest is published under
    offset: int
    nbytes: int


SHARED = -1   # the owner of a bucket filled by several ranks (its ``segments`` say who sends what)


@dataclass
class Bucket:
    owner: int
    placements: list[Placement] = field(default_factory=list)   # what the engine worker sees
    nbytes: int = 0
    shared: tuple[Segment, ...] | None = None   # set for a bucket of pieces (owner SHARED)
    scatters: tuple[Scatter, ...] = ()
    spans: tuple[PieceSpan, ...] = ()           # a bucket of pieces: each piece as broadcast

    @cached_property
    def copy_runs(self) -> tuple[CopyRun, ...]:
        """``runs()`` cut at PIN_CHUNK boundaries of their host region, computed once (plans are
        cached and staged on every update)."""
        return tuple(r for run in self.runs() for r in split_at_pin_chunks(run))

    def runs(self) -> list[CopyRun]:
        """Merge placements whose host and bucket positions advance together (one owner's bucket)."""
        assert self.shared is None, "a bucket of pieces is staged by segments"  # noqa: S101 - the callers' own branch
        return merge_runs(CopyRun(p.meta.base, p.meta.base_offset, p.offset, p.meta.nbytes) for p in self.placements)

    @cached_property
    def segments(self) -> tuple[Segment, ...]:
        """Who stages and broadcasts which bytes of the bucket: the owner all of it, or, in a bucket
        of pieces, each piece's owner its own."""
        if self.shared is not None:
            return self.shared
        return (Segment(self.owner, 0, self.nbytes, self.copy_runs),)

    def owners(self) -> list[int]:
        return sorted({s.rank for s in self.segments})

    @cached_property
    def payload(self) -> int:
        """Bytes of the tensors in the bucket (the rest is alignment and gaps), summed once per
        planned bucket (plans are cached; every update reports them)."""
        return sum(p.meta.nbytes for p in self.placements)

    def reaches(self, rank: int) -> bool:
        """Whether PS rank ``rank`` (its worker) receives this bucket: every rank, unless it holds one
        engine rank's slices (``slice_routes.SlicedBucket``)."""
        return True


@dataclass(frozen=True)
class Plan:
    bucket_bytes: int
    buckets: tuple[Bucket, ...]

    @cached_property
    def total_bytes(self) -> int:
        return sum(b.payload for b in self.buckets)

    @property
    def largest_bucket(self) -> int:
        return max((b.nbytes for b in self.buckets), default=0)


def layer_of(name: str) -> str:
    """The layer a tensor belongs to: its name up to the first numeric component
    (``model.layers.12.mlp.experts.3.w1`` -> ``model.layers.12``); a name without one is its own."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return name


def delivery_order(metas: list[TensorMeta]) -> list[TensorMeta]:
    """Host order, with the tensors of one layer kept together.

    safetensors writes a file's tensors sorted by dtype before name, so an FP8 checkpoint holds
    every float32 scale first and every FP8 weight after them: sent in host order, each layer
    would wait for its weights until the last bucket, and the engine's layerwise reload would
    buffer every layer at once (on vLLM 0.26 that cost 0.2 s of a 0.34 s 7B update in per-tensor
    bookkeeping over the pending layers). Here each host buffer's layers go in the order of their
    first byte, and a layer's tensors in host order, so its copies still merge into few runs.
    A file whose tensors share one dtype (a bf16 checkpoint) keeps its host order exactly.
    """
    first: dict[tuple[int, str], int] = {}
    for m in metas:
        key = (m.base, layer_of(m.name))
        if key not in first or m.base_offset < first[key]:
            first[key] = m.base_offset
    return sorted(metas, key=lambda t: (t.base, first[(t.base, layer_of(t.name))], t.base_offset))


def _pack_owner(owner: int, metas: list[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    buckets: list[Bucket] = []
    cur = Bucket(owner)
    prev: Placement | None = None
    for m in delivery_order(metas):
        if m.nbytes > bucket_bytes:
            raise ConfigError(
                f"tensor {m.name!r} ({m.nbytes} bytes, rank {owner}) does not fit a bucket of "
                f"{bucket_bytes} bytes; raise PS_MAX_BUCKET_SIZE_GB / PS_MEM_FRACTION or free device memory")
        offset = align_up(cur.nbytes)
        if prev is not None and prev.meta.base == m.base:
            gap = m.base_offset - (prev.meta.base_offset + prev.meta.nbytes)
            keep = prev.offset + prev.meta.nbytes + gap
            if 0 <= gap <= MAX_GAP and keep % max(m.itemsize, 1) == 0:
                offset = keep
        if cur.placements and offset + m.nbytes > bucket_bytes:
            buckets.append(cur)
            cur, offset = Bucket(owner), 0
        placement = Placement(m, offset)
        cur.placements.append(placement)
        cur.nbytes = max(cur.nbytes, offset + m.nbytes)
        prev = placement
    if cur.placements:
        buckets.append(cur)
    return buckets


def interleave(per_owner: list[list[_T]]) -> list[_T]:
    """Round-robin over owners so that all ranks copy host-to-device at the same time."""
    out: list[_T] = []
    depth = max((len(b) for b in per_owner), default=0)
    for i in range(depth):
        out.extend(b[i] for b in per_owner if i < len(b))
    return out


def first_shared_name(metas_per_rank: list[list[TensorMeta]]) -> tuple[str, int, int] | None:
    """The first whole tensor's name listed by two ranks (or twice by one), with both ranks; None if
    none is. Pieces share their name by design (``pieces.group_pieces`` checks them)."""
    owner: dict[str, int] = {}
    for rank, metas in enumerate(metas_per_rank):
        for m in metas:
            if m.box is not None:
                continue
            if m.name in owner:
                return m.name, owner[m.name], rank
            owner[m.name] = rank
    return None


def plan_buckets(metas_per_rank: list[list[TensorMeta]], bucket_bytes: int) -> Plan:
    """Pack every rank's tensors into buckets of at most ``bucket_bytes``."""
    if bucket_bytes <= 0:
        raise ConfigError(f"bucket size must be positive, got {bucket_bytes}")
    shared = first_shared_name(metas_per_rank)
    if shared:
        raise ConfigError(f"tensor {shared[0]!r} is registered on rank {shared[1]} and on rank {shared[2]}")
    per_owner = [_pack_owner(r, [m for m in metas if m.box is None], bucket_bytes)
                 for r, metas in enumerate(metas_per_rank)]
    pieced = group_pieces(metas_per_rank)
    if pieced:   # buckets of pieces take turns with the owners' own
        per_owner.append(pack_pieced(pieced, bucket_bytes))
    return Plan(bucket_bytes, tuple(interleave(per_owner)))


def layout_sizes(metas_per_rank: list[list[TensorMeta]]) -> tuple[int, int]:
    """(largest bucket unit, largest total of one owner) of these metas, for ``choose_layout``:
    a tensor in pieces is one unit of its whole size (plus its strided pieces' scratch), and all
    of them together count as one more owner."""
    whole = [[m for m in ms if m.box is None] for ms in metas_per_rank]
    pieced = group_pieces(metas_per_rank)
    largest = max([m.nbytes for ms in whole for m in ms] + [t.nbytes + t.scratch_bytes for t in pieced], default=0)
    totals = [sum(align_up(m.nbytes) for m in ms) for ms in whole]
    totals.append(sum(align_up(t.nbytes) + t.scratch_bytes for t in pieced))
    return largest, max(max(totals), 1)


def pack_pieced(tensors: list[PiecedTensor], bucket_bytes: int) -> list[Bucket]:
    """Buckets of whole tensors made of pieces, in order. A piece that is one contiguous run of its
    tensor is broadcast by its owner straight into place; a strided one into the bucket's scratch
    area after the tensors (each owner's together), then copied into place on every rank."""
    buckets: list[Bucket] = []
    cur: list[PiecedTensor] = []
    used = 0   # tensor area + scratch of ``cur``
    for t in tensors:
        need = align_up(t.nbytes) + t.scratch_bytes + ALIGN * 2
        if need - ALIGN * 2 > bucket_bytes:
            raise ConfigError(
                f"tensor {t.name!r} ({t.nbytes} bytes, registered in pieces) does not fit a bucket of "
                f"{bucket_bytes} bytes; raise PS_MAX_BUCKET_SIZE_GB / PS_MEM_FRACTION or free device memory")
        if cur and used + need > bucket_bytes:
            buckets.append(_pieced_bucket(cur))
            cur, used = [], 0
        cur.append(t)
        used += need
    if cur:
        buckets.append(_pieced_bucket(cur))
    return buckets


def _pieced_bucket(tensors: list[PiecedTensor]) -> Bucket:
    placements, spans = [], []
    direct: list[tuple[int, int, TensorMeta]] = []                      # (rank, bucket offset, meta)
    strided: dict[int, list[tuple[PiecedTensor, Piece, int]]] = {}      # rank -> (tensor, piece, its place)
    pos = 0
    for t in tensors:
        at = align_up(pos)
        placements.append(Placement(TensorMeta(t.name, t.dtype, t.shape, t.nbytes, t.itemsize, -1, 0), at))
        for p in t.pieces:
            start = p.start
            if start is None:
                strided.setdefault(p.rank, []).append((t, p, at))
            else:
                direct.append((p.rank, at + start * t.itemsize, p.meta))
                spans.append(PieceSpan(p.rank, piece_key(t.name, p.offsets), at + start * t.itemsize, p.meta.nbytes))
        pos = at + t.nbytes
    segments, scatters = _direct_segments(direct), []
    for rank in sorted(strided):
        pos = start = align_up(pos)
        runs = []
        for t, p, at in strided[rank]:
            runs.append(CopyRun(p.meta.base, p.meta.base_offset, pos, p.meta.nbytes))
            scatters.append(Scatter(pos, at, t.shape, p.offsets, p.shape, t.itemsize))
            spans.append(PieceSpan(rank, piece_key(t.name, p.offsets), pos, p.meta.nbytes))
            pos += p.meta.nbytes
        segments.append(_segment(rank, start, pos - start, runs))
    return Bucket(SHARED, placements, pos, tuple(segments), tuple(scatters), tuple(spans))


def _direct_segments(direct: list[tuple[int, int, TensorMeta]]) -> list[Segment]:
    """One segment per run of one rank's pieces with nothing of another rank between them (a small
    gap, the alignment between two tensors, travels along: no rank writes it)."""
    out: list[tuple[int, int, int, list[CopyRun]]] = []
    for rank, at, m in sorted(direct, key=lambda d: d[1]):
        run = CopyRun(m.base, m.base_offset, at, m.nbytes)
        if out and out[-1][0] == rank and 0 <= at - (out[-1][1] + out[-1][2]) <= MAX_GAP:
            r, start, _, runs = out[-1]
            out[-1] = (r, start, at + m.nbytes - start, runs + [run])
        else:
            out.append((rank, at, m.nbytes, [run]))
    return [_segment(*o) for o in out if o[2]]


def _segment(rank: int, offset: int, nbytes: int, runs: list[CopyRun]) -> Segment:
    return Segment(rank, offset, nbytes, tuple(r for run in merge_runs(runs) for r in split_at_pin_chunks(run)
                                                if r.nbytes))


TARGET_BUCKETS_PER_OWNER = 8   # enough buckets per rank for H2D, broadcast and reload to overlap
DELTA_SUFFIX = "@delta"        # a version's delta companion is ``name + DELTA_SUFFIX`` (``delta/versions.py``)


def delta_companion(name: str) -> bool:
    """Whether checkpoint ``name`` is a delta's companion (``v@delta``, or a fold's ``v@delta:base``)."""
    return name.endswith(DELTA_SUFFIX) or DELTA_SUFFIX + ":" in name
MIN_BUCKET = 64 << 20          # below this, per-bucket overheads start to show
MAX_AUTO_BUCKET = 1 << 30      # larger buckets only lengthen the pipeline's fill and drain


def choose_layout(free_bytes: int, *, mem_fraction: float, max_slots: int, max_bucket_bytes: int,
                  largest_tensor: int, largest_owner_total: int,
                  buckets_per_owner: int | None = None) -> tuple[int, int]:
    """(bucket bytes, slots) one rank can afford for its IPC buffer of ``slots x bucket``.

    Aims at ~8 buckets per owner (so the stages overlap; ``buckets_per_owner`` if given: a delta's
    payloads, whose apply costs the engine worker a fixed host time per bucket, take fewer), at most 1 GiB and at
    most ``max_bucket_bytes``, but no smaller than 64 MiB or the largest tensor
    (a cap below the largest tensor is raised to it rather than failing). When memory is
    short it first gives up slots (pipelining), then shrinks the bucket; callers
    take the minimum of both over ranks, and ``plan_buckets`` names any tensor
    that still does not fit.
    """
    budget = int(max(free_bytes, 0) * mem_fraction)
    per_owner = -(-max(largest_owner_total, 1) // max(1, buckets_per_owner or TARGET_BUCKETS_PER_OWNER))
    want = min(max(min(per_owner, MAX_AUTO_BUCKET), MIN_BUCKET), max_bucket_bytes,
               align_up(max(largest_owner_total, 1)))
    want = align_up(max(want, largest_tensor))   # the cap yields to a tensor that needs more
    # The most slots whose share of the budget, rounded down to ALIGN, still holds the largest
    # tensor (a closed form: a loop down from max_slots would run for ever on PS_NUM_SLOTS=10**11).
    slots = min(max(max_slots, 1), budget // align_up(max(largest_tensor, 1)))
    if slots >= 1:
        return min(want, budget // slots) // ALIGN * ALIGN, slots
    return max(min(want, budget) // ALIGN * ALIGN, ALIGN), 1
