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
A plan carries the :class:`SliceKey` it was recorded for (model fingerprint, parallel layout, engine
version): an engine refuses a plan recorded for another key (``ckpt_vllm._slices.check_installed``).

Routing by a plan (the buckets each engine rank receives) is ``planning/slice_routes.py``; reading
a plan's JSON back (checked field by field) is ``planning/slice_json.py``.

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
        return self._whole_bytes

    @cached_property
    def _whole_bytes(self) -> int:
        """Once per plan: every sliced update reports it."""
        names = {n for rs in self.ranks for n in rs.needs}
        return sum(math.prod(self.tensors[n][1]) * self.tensors[n][2] for n in names)

    @property
    def route_digest(self) -> str:
        """The plan an update routed by this one is told to the engine workers as (its own digest; a
        sliced delta's routing names the engine's plan it was cut by: ``delta/sliced.py``)."""
        return self.digest

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
    dim_of: list[int | None] = []
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


# --- the plan as JSON (it travels from the engine's workers to every PS rank; read back: slice_json.py) --

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


def require_plan(plan, what: str = "slices") -> SlicePlan:
    """``plan`` if it is a :class:`SlicePlan`, else the ConfigError every entry that takes one raises
    (``update(slices=)``, broadcast and P2P, ``share_slice_plan``), before any exchange: a plan's digest
    or its JSON is not one."""
    if isinstance(plan, SlicePlan):
        return plan
    hint = ""
    if isinstance(plan, str):
        hint = " (a plan's digest is what an engine client's update(slices=) takes, not the parameter server's)"
    elif isinstance(plan, dict):
        hint = " (the plan's JSON: parse it with plan_from_json first)"
    raise ConfigError(f"{what} must be a SlicePlan (ckpt_core.planning.slices, e.g. VllmClient.slice_plan(...)), "
                      f"got {type(plan).__name__}{hint}")


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


_JSON_READERS = ("plan_from_json", "rank_from_json", "read_plan_file", "write_plan_file")


def __getattr__(name: str):
    """The JSON readers live in ``slice_json.py`` (which imports this module); their old names here
    still work, resolved on first use so that neither module needs the other half-imported."""
    if name in _JSON_READERS:
        from ckpt_core.planning import slice_json
        return getattr(slice_json, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
