"""Pure slice plans: which part of each checkpoint tensor each engine rank's loaders read.

An engine adapter records, per engine rank, what its own weight loaders do with each checkpoint
tensor (``ckpt_vllm/_slices.py`` drives vLLM's ``load_weights`` over zero-storage tensors). The
result is plain data:

- ``needs``: per checkpoint name, the box of the tensor the rank reads, as a canonical chain of
  ``(dim, start, length)`` (dims ascending, each at most once, a dim read whole left out), or
  ``None``: the whole tensor (what the recording could not describe exactly goes whole: fail
  closed, never a guessed slice);
- ``params``: the checkpoint-format shape of every live parameter the rank's loaders write;
- ``writes``: the region of a parameter each copy wrote (``source`` the checkpoint name it read,
  or ``None`` when the engine filled it itself, e.g. the padded rows of a vocabulary).

:func:`check_plan` refuses, before anything moves, a plan that leaves a byte of a live parameter
unwritten or writes it twice (per rank), reads outside a tensor, leaves a byte of a checkpoint
tensor that some rank reads unread by every rank (a slice shifted by one row), or moves nothing.
Plans are cached by :class:`SliceKey` (model fingerprint, parallel layout, engine version):
:meth:`SlicePlanCache.get` never hands out a plan recorded for another key.

No torch, no I/O.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, NamedTuple

from ckpt_core.errors import CheckpointFormatError, ConfigError
from ckpt_core.planning.buckets import (MAX_GAP, SHARED, Bucket, Placement, Plan, Scatter, TensorMeta, _pack_owner,
                                        align_up, delivery_order, first_shared_name, interleave, pack_pieced)
from ckpt_core.planning.pieces import PiecedTensor, contiguous_start, group_pieces

Box = tuple[tuple[int, int, int], ...]   # ((dim, start, length), ...); () reads every element
PLAN_VERSION = 1


class Write(NamedTuple):
    param: str
    region: Box                  # in the parameter's (checkpoint-format) coordinates
    source: str | None           # checkpoint name read; None: written by the engine itself (padding)


@dataclass(frozen=True)
class SliceKey:
    """What a plan was recorded for; a plan is only ever used under its own key."""
    model: str                   # fingerprint of the model (architecture, config, names and shapes)
    layout: str                  # parallel layout, e.g. "tp=2,pp=1,ep=1,dp=1"
    engine: str                  # engine and version, e.g. "vllm-0.32.0"


@dataclass(frozen=True)
class RankSlices:
    rank: int
    needs: dict[str, Box | None]
    params: dict[str, tuple[int, ...]]
    writes: tuple[Write, ...]


@dataclass(frozen=True)
class SlicePlan:
    key: SliceKey
    tensors: dict[str, tuple[str, tuple[int, ...], int]]   # name -> (dtype, shape, itemsize)
    ranks: tuple[RankSlices, ...]

    def rank(self, r: int) -> RankSlices:
        if not 0 <= r < len(self.ranks):
            raise ConfigError(f"the slice plan has {len(self.ranks)} engine ranks; there is no rank {r}")
        return self.ranks[r]

    def rank_bytes(self, r: int) -> int:
        """Bytes engine rank ``r`` receives under this plan (its slices plus what it needs whole)."""
        return sum(box_numel(self.tensors[n][1], b) * self.tensors[n][2] for n, b in self.rank(r).needs.items())

    def whole_bytes(self) -> int:
        """Bytes one rank receives without slices: every tensor some rank needs, whole."""
        names = {n for rs in self.ranks for n in rs.needs}
        return sum(math.prod(self.tensors[n][1]) * self.tensors[n][2] for n in names)

    @cached_property
    def digest(self) -> str:
        """SHA-1 of the plan's JSON, computed once (the plan is immutable; every update names it)."""
        return hashlib.sha1(json.dumps(plan_to_json(self), sort_keys=True).encode()).hexdigest()


def box_extent(shape, box: Box | None) -> tuple[int, ...]:
    ext = list(shape)
    for d, _, n in box or ():
        ext[d] = n
    return tuple(ext)


def box_offsets(shape, box: Box | None) -> tuple[int, ...]:
    off = [0] * len(shape)
    for d, s, _ in box or ():
        off[d] = s
    return tuple(off)


def box_numel(shape, box: Box | None) -> int:
    return math.prod(box_extent(shape, box))


def make_box(shape, offsets, extent) -> Box:
    """The canonical chain of the box ``offsets``/``extent`` of a tensor of ``shape``."""
    return tuple((d, int(o), int(e)) for d, (o, e, n) in enumerate(zip(offsets, extent, shape)) if (o, e) != (0, n))


def contiguous_strides(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _view_dims(shape, size, stride, offset: int):
    """(start, extent, tensor dim of each view dim) of a strided view of a contiguous tensor of
    ``shape`` whose elements are exactly one box, else None (see :func:`view_box`)."""
    n = len(shape)
    if any(s == 0 for s in size) or any(s == 0 for s in shape):
        return None
    cs = contiguous_strides(shape)
    ext = [1] * n
    seen = [False] * n
    dim_of = []
    for s, st in zip(size, stride):
        if s == 1:
            dim_of.append(None)
            continue
        dims = [d for d in range(n) if cs[d] == st and shape[d] > 1]
        if len(dims) != 1:
            return None
        d = dims[0]
        dim_of.append(d)
        while s > shape[d] and not seen[d]:   # the view dim spans d whole and continues outward
            if s % shape[d] or d == 0:
                return None
            seen[d], ext[d] = True, shape[d]
            s //= shape[d]
            d -= 1
        if seen[d] or s > shape[d]:
            return None
        seen[d], ext[d] = True, s
    start = [(offset // cs[d]) % shape[d] for d in range(n)]
    if sum(o * c for o, c in zip(start, cs)) != offset:
        return None
    if any(start[d] + ext[d] > shape[d] for d in range(n)):
        return None
    return start, ext, dim_of


def view_box(shape, size, stride, offset: int) -> Box | None:
    """The box of a contiguous tensor of ``shape`` that the strided view (``size``, ``stride``,
    ``offset``, in elements) reads, or None when its elements are not exactly one box (a view
    that repeats elements, skips some inside a dim, or is not a view of this tensor at all).

    A view dim may span several tensor dims (``view(-1)`` of a range of rows): it then reads the
    inner ones whole. The element order of the view does not matter (a transposed view reads the
    same box); the loader that replays it gets a view of the same geometry.
    """
    dims = _view_dims(shape, size, stride, offset)
    return None if dims is None else make_box(shape, dims[0], dims[1])


def view_in_box(shape, box: Box | None, size, stride, offset: int) -> tuple[tuple[int, ...], int]:
    """The same view taken of the box alone (its elements packed in row-major order): the
    (stride, offset) that give, from the packed box, the elements the view (``size``, ``stride``,
    ``offset``) reads of the whole tensor. ConfigError when the view reads outside the box."""
    dims = _view_dims(shape, size, stride, offset)
    b_off, b_ext = box_offsets(shape, box), box_extent(shape, box)
    if dims is None or any(s < o or s + e > o + x for s, e, o, x in zip(dims[0], dims[1], b_off, b_ext)):
        raise ConfigError(f"a loader read a view (size {list(size)}, stride {list(stride)}, offset {offset}) of a "
                          f"tensor of shape {list(shape)} outside its recorded box {list(map(list, box or ()))}")
    bs = contiguous_strides(b_ext)
    new_stride = tuple(0 if d is None else bs[d] for d in dims[2])
    return new_stride, sum((s - o) * k for s, o, k in zip(dims[0], b_off, bs))


def _check_box(what: str, shape, box: Box | None, *, tensor: str) -> None:
    if box is None:
        return
    dims = [d for d, _, _ in box]
    if dims != sorted(set(dims)):
        raise CheckpointFormatError(f"{what}: box {list(map(list, box))} is not canonical (dims ascending, once)",
                                    tensor=tensor)
    for d, s, n in box:
        if not (0 <= d < len(shape)) or n <= 0 or s < 0 or s + n > shape[d]:
            raise CheckpointFormatError(f"{what}: box {list(map(list, box))} lies outside the shape {list(shape)} "
                                        f"or is empty", tensor=tensor)


def _tile(shape, boxes: list[tuple[Box, str]]) -> str | None:
    """Why ``boxes`` (each with a label) do not tile ``shape`` exactly; None when they do."""
    spans = sorted((box_offsets(shape, b), box_extent(shape, b), label) for b, label in boxes)
    active: list = []
    for off, ext, label in spans:
        lo = off[0] if off else 0
        active = [a for a in active if not a[0] or a[0][0] + a[1][0] > lo]
        for ao, ae, alabel in active:
            if all(x < y + m and y < x + k for x, k, y, m in zip(ao, ae, off, ext)):
                return f"written twice: by {alabel} (offsets {list(ao)}, extent {list(ae)}) and by {label} " \
                       f"(offsets {list(off)}, extent {list(ext)})"
        active.append((off, ext, label))
    covered = sum(math.prod(e) for _, e, _ in spans)
    total = math.prod(shape)
    if covered != total:
        return f"a hole: {covered} of its {total} elements are written (shape {list(shape)})"
    return None


def check_plan(plan: SlicePlan) -> None:
    """Refuse a plan that would leave a hole, write a byte twice, or move nothing.

    Per engine rank: every box lies inside its tensor; every live parameter is written exactly
    once per element (its writes tile it); every write's source is a tensor the rank needs. Over
    all ranks: the distinct boxes of one tensor are identical (replicas) or disjoint, and together
    cover the whole tensor; the plan moves at least one byte. Raises CheckpointFormatError naming
    the parameter or tensor, ConfigError for an empty plan.
    """
    if not plan.ranks or not any(rs.needs for rs in plan.ranks):
        raise ConfigError(f"the slice plan for {plan.key} moves nothing: no engine rank needs any tensor")
    for rs in plan.ranks:
        _check_rank(plan, rs)
    _check_sources(plan)
    if not sum(plan.rank_bytes(r) for r in range(len(plan.ranks))):
        raise ConfigError(f"the slice plan for {plan.key} moves nothing: every slice is empty")


def _check_rank(plan: SlicePlan, rs: RankSlices) -> None:
    for name, box in rs.needs.items():
        if name not in plan.tensors:
            raise CheckpointFormatError(f"engine rank {rs.rank} needs a tensor the checkpoint does not have",
                                        tensor=name)
        _check_box(f"engine rank {rs.rank} reads", plan.tensors[name][1], box, tensor=name)
    per_param: dict[str, list[tuple[Box, str]]] = {p: [] for p in rs.params}
    for w in rs.writes:
        if w.param not in rs.params:
            raise CheckpointFormatError(f"engine rank {rs.rank} writes a parameter its plan does not list",
                                        tensor=w.param)
        if w.source is not None and w.source not in rs.needs:
            raise CheckpointFormatError(f"engine rank {rs.rank} writes {w.param} from {w.source}, which it does "
                                        f"not receive", tensor=w.source)
        _check_box(f"engine rank {rs.rank} writes", rs.params[w.param], w.region, tensor=w.param)
        per_param[w.param].append((w.region, w.source or "the engine"))
    for param, boxes in per_param.items():
        problem = _tile(rs.params[param], boxes)
        if problem:
            raise CheckpointFormatError(f"the slice plan of engine rank {rs.rank} leaves parameter {param} "
                                        f"with {problem}", tensor=param)


def _check_sources(plan: SlicePlan) -> None:
    boxes: dict[str, dict[Box, list[int]]] = {}
    for rs in plan.ranks:
        for name, box in rs.needs.items():
            boxes.setdefault(name, {}).setdefault(() if box is None else box, []).append(rs.rank)
    for name, distinct in boxes.items():
        shape = plan.tensors[name][1]
        if () in distinct:
            continue   # some rank reads it whole: every byte is read
        problem = _tile(shape, [(b, f"rank(s) {ranks}") for b, ranks in distinct.items()])
        if problem:
            problem = problem.replace("written twice", "read in partly overlapping boxes").replace(
                "are written", "are read by any rank")
            raise CheckpointFormatError(f"the engine ranks' slices of this tensor are inconsistent: {problem}",
                                        tensor=name)


class SlicePlanCache:
    """Plans by key; a plan recorded for another model, layout or engine version is never returned."""

    def __init__(self, size: int = 4):
        self.size = size
        self._plans: dict[SliceKey, SlicePlan] = {}

    def put(self, plan: SlicePlan) -> SlicePlan:
        check_plan(plan)
        self._plans.pop(plan.key, None)
        while len(self._plans) >= self.size:
            self._plans.pop(next(iter(self._plans)))
        self._plans[plan.key] = plan
        return plan

    def get(self, key: SliceKey) -> SlicePlan | None:
        plan = self._plans.get(key)
        assert plan is None or plan.key == key
        return plan


def require_key(plan: SlicePlan, key: SliceKey) -> SlicePlan:
    """``plan`` if it was recorded for ``key``, else ConfigError naming both (never reused elsewhere)."""
    if plan.key != key:
        raise ConfigError(f"the slice plan was recorded for {plan.key}, not for {key}: record it again")
    return plan


# --- the plan as JSON (it travels from the engine's workers to every PS rank) ---------------------

def plan_to_json(plan: SlicePlan) -> dict:
    return {"version": PLAN_VERSION,
            "key": {"model": plan.key.model, "layout": plan.key.layout, "engine": plan.key.engine},
            "tensors": {n: [d, list(s), i] for n, (d, s, i) in plan.tensors.items()},
            "ranks": [rank_to_json(rs) for rs in plan.ranks]}


def rank_to_json(rs: RankSlices) -> dict:
    return {"rank": rs.rank,
            "needs": {n: None if b is None else [list(x) for x in b] for n, b in rs.needs.items()},
            "params": {p: list(s) for p, s in rs.params.items()},
            "writes": [[w.param, [list(x) for x in w.region], w.source] for w in rs.writes]}


def _ints(value, what: str, n: int | None = None) -> tuple[int, ...]:
    if not isinstance(value, list) or (n is not None and len(value) != n) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ConfigError(f"slice plan: {what} must be a list of {n or 'some'} non-negative integers, got {value!r}")
    return tuple(value)


def _box(value, what: str) -> Box:
    if not isinstance(value, list):
        raise ConfigError(f"slice plan: {what} must be a list of [dim, start, length], got {value!r}")
    return tuple(_ints(x, what, 3) for x in value)


def rank_from_json(doc) -> RankSlices:
    if not isinstance(doc, dict) or not {"rank", "needs", "params", "writes"} <= set(doc):
        raise ConfigError(f"slice plan: a rank's entry needs rank, needs, params and writes, got {str(doc)[:200]}")
    needs = {str(n): None if b is None else _box(b, f"the box of {n}") for n, b in doc["needs"].items()}
    params = {str(p): _ints(s, f"the shape of {p}") for p, s in doc["params"].items()}
    writes = []
    for w in doc["writes"]:
        if not isinstance(w, list) or len(w) != 3 or not isinstance(w[0], str) or not (
                w[2] is None or isinstance(w[2], str)):
            raise ConfigError(f"slice plan: a write must be [param, region, source], got {w!r}")
        writes.append(Write(w[0], _box(w[1], f"the region of {w[0]}"), w[2]))
    return RankSlices(int(doc["rank"]), needs, params, tuple(writes))


def plan_from_json(doc) -> SlicePlan:
    """Parse and validate (``check_plan``) a plan document; ConfigError for a malformed one."""
    if not isinstance(doc, dict) or doc.get("version") != PLAN_VERSION:
        raise ConfigError(f"slice plan: expected version {PLAN_VERSION}, got {str(doc)[:200]}")
    k = doc.get("key") or {}
    key = SliceKey(str(k.get("model")), str(k.get("layout")), str(k.get("engine")))
    tensors = {}
    for n, t in (doc.get("tensors") or {}).items():
        if not isinstance(t, list) or len(t) != 3 or not isinstance(t[0], str):
            raise ConfigError(f"slice plan: tensor {n!r} must be [dtype, shape, itemsize], got {t!r}")
        tensors[str(n)] = (t[0], _ints(t[1], f"the shape of {n}"), int(t[2]))
    ranks = tuple(rank_from_json(r) for r in doc.get("ranks") or [])
    if [r.rank for r in ranks] != list(range(len(ranks))):
        raise ConfigError(f"slice plan: ranks must be listed 0..n-1 in order, got {[r.rank for r in ranks]}")
    plan = SlicePlan(key, tensors, ranks)
    check_plan(plan)
    return plan


def merge_ranks(key: SliceKey, tensors: dict, ranks: Iterable[RankSlices]) -> SlicePlan:
    """One plan from every engine rank's recording (in rank order), checked."""
    ordered = tuple(sorted(ranks, key=lambda r: r.rank))
    if [r.rank for r in ordered] != list(range(len(ordered))):
        raise ConfigError(f"slice plan: recordings of engine ranks {[r.rank for r in ordered]}, expected 0..n-1")
    plan = SlicePlan(key, dict(tensors), ordered)
    check_plan(plan)
    return plan


def split_plan(key: SliceKey, tensors: dict, tp: int, dims: dict) -> SlicePlan:
    """The plan of an engine whose rank r keeps the r-th of ``tp`` equal parts of each checkpoint
    tensor along ``dims[name]`` (absent or None: the whole tensor on every rank), each in a parameter
    of the tensor's own name: a tensor-parallel layout without fused, padded or repacked layers
    (the update benchmark's simulated engine). ``tensors``: name -> (dtype, shape, itemsize).
    A dimension ``tp`` does not divide is a ConfigError naming the tensor; the plan is checked."""
    if tp < 1:
        raise ConfigError(f"a tensor-parallel size must be >= 1, got {tp}")
    ranks = []
    for r in range(tp):
        needs: dict[str, Box | None] = {}
        params: dict[str, tuple[int, ...]] = {}
        for name, (_, shape, _) in tensors.items():
            d = dims.get(name)
            box = None
            if d is not None:
                if not 0 <= d < len(shape) or shape[d] % tp:
                    raise ConfigError(f"tensor {name!r} of shape {list(shape)} cannot be split in {tp} equal "
                                      f"parts along dimension {d}")
                n = shape[d] // tp
                box = make_box(shape, [r * n if i == d else 0 for i in range(len(shape))],
                               [n if i == d else x for i, x in enumerate(shape)]) or None
            needs[name], params[name] = box, box_extent(shape, box)
        ranks.append(RankSlices(r, needs, params, tuple(Write(n, (), n) for n in tensors)))
    return merge_ranks(key, tensors, ranks)


# --- routing: buckets of slices, each for one engine rank (and its data-parallel replicas) -------

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

    @cached_property
    def segments(self) -> tuple[Part, ...]:
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
    whole = {n for n in plan.tensors if all(n in rs.needs and not rs.needs[n] for rs in plan.ranks)}
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
        if any(h <= l for l, h in zip(lo, hi)):
            continue
        copies.append(_Copy(p.rank, p.meta.base, p.meta.base_offset, tuple(p.shape),
                            tuple(l - o for l, o in zip(lo, p.offsets)), tuple(l - o for l, o in zip(lo, off)),
                            tuple(h - l for l, h in zip(lo, hi))))
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
    placements, direct, strided = [], [], {}
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
    boxes, scatters, runs = [], [], []   # runs: [rank, start, end, payload]
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


def _reaches(bucket: Bucket, rank: int) -> bool:
    return not isinstance(bucket, SlicedBucket) or bucket.reaches(rank)


def rank_placements(plan: Plan, rank: int) -> list[list[tuple[str, str, tuple[int, ...], int]]]:
    """What PS rank ``rank``'s worker is told of each bucket: its engine rank's slices and the whole
    tensors (a bucket of slices for another engine rank: nothing; it is not even in this rank's buffer)."""
    return [[(p.meta.name, p.meta.dtype, p.meta.shape, p.offset) for p in b.placements]
            if _reaches(b, rank) else [] for b in plan.buckets]


def received_bytes(plan: Plan, rank: int) -> int:
    """Bytes of tensors and slices PS rank ``rank`` (its worker) receives under ``plan``."""
    return sum(p.meta.nbytes for b in plan.buckets if _reaches(b, rank) for p in b.placements)


def replica_groups(plan: Plan) -> list[tuple[int, ...]]:
    """The groups of more than one PS rank the plan's buckets of slices are broadcast in, in order of
    first use (every rank computes the same list from the same plan)."""
    seen: dict[tuple[int, ...], None] = {}
    for b in plan.buckets:
        if isinstance(b, SlicedBucket) and len(b.ranks) > 1:
            seen.setdefault(b.ranks)
    return list(seen)
