"""Checkpoint sources: safetensors files, in-memory named tensors (whole, DTensor shards or
``TensorShard`` boxes: ``shards.py``), /dev/shm files in place.

``build_checkpoint`` validates everything first (all headers, names, dtypes),
then lays the copied content out in one host region and fills it; a failure
before the fill leaves nothing allocated, and a failure during it frees what
was taken. Source files are never modified or deleted unless asked.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from ckpt_core.checkpoint.duplicates import dedupe
from ckpt_core.checkpoint.hf_dir import checkpoint_files
from ckpt_core.checkpoint.host import (
    HostRegion,
    SharedPool,
    copy_jobs,
    counted,
    file_writable,
    grouped,
    map_file_region,
    new_region,
    populate_and_pin,
    read_jobs,
    run_jobs,
)
from ckpt_core.checkpoint.safetensors import WIRE_CODES, SafetensorsHeader, read_header
from ckpt_core.checkpoint.shards import TensorShard, boxes_of, is_pieced
from ckpt_core.devices import DeviceBackend
from ckpt_core.errors import ConfigError
from ckpt_core.planning.buckets import TensorMeta, align_up

SHM_PREFIX = "/dev/shm/"
_log = logging.getLogger("ckpt_core")


@dataclass
class RegisteredCheckpoint:
    name: str
    metas: list[TensorMeta]
    regions: dict[int, HostRegion]
    pool: SharedPool | None = None
    nbytes: int = field(default=0)
    seconds: dict[str, float] = field(default_factory=dict)   # registration phases, for logs and benchmarks
    # registered on the device (``checkpoint/device.py``): each region views one of the caller's device tensors
    on_device: bool = False
    # lin64 sums of tensors (name -> sum mod 2**64, ``delta/lin64.py``), where known: kept by the delta
    # encode (``delta/batch.py``) for the next version's; only of regions filled here, which nothing writes
    digests: dict[str, int] = field(default_factory=dict)

    def host_tensor(self, meta: TensorMeta) -> torch.Tensor:
        """A typed view of one tensor's host bytes (for checks and the P2P path)."""
        assert not self.on_device, "callers refuse device-resident checkpoints first"  # noqa: S101 - our invariant
        raw = self.regions[meta.base].tensor[meta.base_offset: meta.base_offset + meta.nbytes]
        if meta.base_offset % max(meta.itemsize, 1):   # in-place file data need not be aligned: a copy
            raw = raw.clone()
        return raw.view(_torch_dtype(meta.dtype)).view(meta.shape)

    def source_problem(self) -> str | None:
        """The first in-place file that shrank under its map since registration, if any."""
        return self._first_problem("source_check")

    def rewritten_problem(self) -> str | None:
        """The first in-place file written since registration (its mapped bytes changed with it), if any."""
        return self._first_problem("source_rewritten")

    def _first_problem(self, check: str) -> str | None:
        for region in self.regions.values():
            fn = getattr(region, check)
            problem = fn() if fn is not None else None
            if problem:
                return problem
        return None

    def release(self) -> None:
        for rid, region in self.regions.items():
            if self.pool is not None and self.pool.owns(region):
                continue  # the pool keeps its memory for the next checkpoint
            region.release()
        if self.pool is not None:
            self.pool.give_back(self.name)
        self.regions = {}


def _torch_dtype(code: str) -> torch.dtype:
    from ckpt_core.checkpoint.safetensors import WIRE_DTYPES
    return WIRE_DTYPES[code]


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _check_named(named: dict) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(named, dict):
        raise ConfigError(f"named_tensors must be a dict of name -> tensor, got {type(named).__name__}")
    out = []
    for name, t in named.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(t, (torch.Tensor, TensorShard)):
            raise ConfigError(f"named_tensors[{name!r}] is a {type(t).__name__}, not a torch.Tensor or TensorShard")
        if t.dtype not in WIRE_CODES:
            raise ConfigError(f"named_tensors[{name!r}] has dtype {t.dtype}, which is unsupported: only dtypes "
                              "with a whole number of bytes per element and plain storage can be carried")
        out.append((name, t))
    return out


def _in_place(path: str, inplace: bool) -> bool:
    return inplace and os.path.realpath(path).startswith(SHM_PREFIX)


def build_checkpoint(name: str, backend: DeviceBackend, *, files=None,
                     named_tensors=None, pool: SharedPool | None = None, inplace: bool = True,
                     unlink_inplace_files: bool = False, progress=None,
                     pool_beside: str | None = None) -> RegisteredCheckpoint:
    """Validate, then load or map this rank's share. Region ids are local to the checkpoint, so two
    checkpoints of the same layout (successive RL steps) have identical metas and share one plan.
    ``pool_beside``: the base this version is registered with (it may take a second pool region beside
    the base's, ``SharedPool``).
    ``progress(phase, done_bytes, total_bytes)``, if given, is called as each phase advances (from
    worker threads)."""
    files = [os.fspath(p) for p in (files or [])]
    missing = [p for p in files if not os.path.isfile(p)]
    if missing:
        raise ConfigError(f"checkpoint file(s) do not exist or are not regular files: {missing}")
    clock = _Phases()
    named = _check_named(named_tensors or {})
    pieces = [(b.name, b.view, (b.global_shape, b.offsets)) for n, t in named if is_pieced(t) for b in boxes_of(n, t)]
    named = [(n, t) for n, t in named if not is_pieced(t)]
    headers = [_read_header(p) for p in files]          # validates every file before any allocation
    skip, named = dedupe(headers, named)               # duplicate names: identical once, differing raise
    entries: list[tuple] = [*named, *pieces]   # (name, tensor), then this rank's pieces (tiling: gather_metas)
    headers = [_without(h, {n for i, n in skip if i == k}) for k, h in enumerate(headers)]
    eligible, placed, writable = _in_place_files(backend, headers, inplace)
    copied = [h for h in headers if all(h is not p for p in placed)]

    layout, total = _layout(copied, entries)
    clock.lap("validate")
    ids = itertools.count()
    regions: dict[int, HostRegion] = {}
    metas: list[TensorMeta] = []
    try:
        if copied or entries:
            # A share of 0-byte tensors only (total == 0) is still part of the checkpoint: its
            # tensors get metas in an empty region, so they reach the engine like any other.
            rid = next(ids)
            regions[rid] = (pool.acquire(name, total, rid, beside=pool_beside) if pool is not None and total else
                            new_region(backend, rid, total))
            clock.lap("allocate")
            if pool is None or not total:   # the pool's region is pinned already
                _pin_fresh(backend, regions[rid], total, clock, progress)
            jobs = grouped(_fill_jobs(regions[rid], copied, entries, layout))
            run_jobs(counted(jobs, _reporter(progress, "fill", sum(end - start for start, end, _ in jobs))))
            clock.lap("fill")
            metas += _metas_copied(rid, copied, entries, layout)
        for h in placed:
            rid = next(ids)
            regions[rid] = map_file_region(backend, rid, h.path, writable=writable[h.path], lap=clock.lap,
                                           on_bytes=_reporter(progress, f"map {os.path.basename(h.path)}",
                                                              h.file_size))
            metas += [_meta(e.name, e.dtype, e.shape, rid, e.start) for e in h.tensors]
    except BaseException:
        RegisteredCheckpoint(name, [], regions, pool).release()
        raise
    ckpt = RegisteredCheckpoint(name, metas, regions, pool if total and pool is not None else None,
                                nbytes=sum(m.nbytes for m in metas), seconds=clock.seconds)
    if unlink_inplace_files:   # only now that every region is mapped: a failure above deletes nothing
        # Every /dev/shm file registered in place goes, also one this device kind had to copy
        # (read-only, or a kind that cannot pin in place): its bytes are ours now either way.
        _unlink(h.path for h in eligible)
    return ckpt


class PackedRegion:
    """A fresh host region (zeroed, pinned where the backend pins) that a delta's payloads are written
    straight into (``delta/_payload_vector.Encoded.payload_list``'s ``alloc``) and that ``build_packed`` then
    adopts as its checkpoint's: without it the payloads were written into a zeroed numpy buffer and copied
    into a second fresh region (two first touches of every page and a copy: on the 2-core VM ~1 us per page
    touched first; dense16 x0.05's 34 MB of payloads). ``release()`` frees it unless a checkpoint took it."""

    def __init__(self, backend: DeviceBackend):
        self.backend = backend
        self.region: HostRegion | None = None

    def alloc(self, nbytes: int):
        """A zeroed numpy uint8 buffer of ``nbytes`` in a new region (one per PackedRegion)."""
        if self.region is not None:
            raise RuntimeError("a PackedRegion holds one buffer")
        self.region = new_region(self.backend, 0, nbytes)   # an anonymous mapping: zeroed
        _pin_fresh(self.backend, self.region, nbytes, _Phases(), None)
        return self.region.tensor.numpy()

    def holds(self, t: torch.Tensor) -> bool:
        if self.region is None or not t.numel():
            return False
        base, end = self.region.tensor.data_ptr(), self.region.tensor.data_ptr() + self.region.nbytes
        return base <= t.data_ptr() and t.data_ptr() + t.numel() <= end

    def release(self) -> None:
        if self.region is not None:
            self.region.release()
            self.region = None


def build_packed(name: str, backend: DeviceBackend, named: dict[str, torch.Tensor],
                 into: PackedRegion | None = None) -> RegisteredCheckpoint:
    """``build_checkpoint(name, backend, named_tensors=named)`` for flat uint8 host tensors (a delta's
    payloads): the same metas, each tensor copied into the region with one numpy slice assignment on this
    thread, instead of a copy job each (thousands of small payloads: 5,210 cost ~300 ms in jobs). Tensors
    that already lie in ``into``'s region (written there by the encode) stay where they are: that region
    becomes the checkpoint's region 0 (``into`` gives it up), the others are copied into region 1.
    Anything else goes through ``build_checkpoint``."""
    items = list(named.items())
    if not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == torch.uint8 and t.dim() == 1
               and t.is_contiguous() for _, t in items):
        return build_checkpoint(name, backend, named_tensors=named)   # copies: ``into`` stays its owner's
    _check_named(named)
    adopted = into.region if into is not None and into.region is not None else None
    placed = {i: (0, t.data_ptr() - adopted.tensor.data_ptr())
              for i, (_, t) in enumerate(items) if adopted is not None and into.holds(t)}  # type: ignore[union-attr]
    rid = 1 if adopted is not None else 0
    offsets, pos = {}, 0
    for i, (_, t) in enumerate(items):
        if i not in placed:
            offsets[i] = pos
            pos = align_up(pos + t.numel())
    clock = _Phases()
    region = new_region(backend, rid, pos)
    try:
        _pin_fresh(backend, region, pos, clock, None)
        buf = region.tensor.numpy() if pos else None
        for i, off in offsets.items():
            t = items[i][1]
            if t.numel():
                buf[off: off + t.numel()] = t.numpy()   # type: ignore[index]
        clock.lap("fill")
    except BaseException:
        region.release()
        raise
    where = {**placed, **{i: (rid, off) for i, off in offsets.items()}}
    metas = [_meta(n, torch.uint8, (t.numel(),), *where[i]) for i, (n, t) in enumerate(items)]
    regions = {rid: region}
    if adopted is not None:
        regions = {0: adopted, **({rid: region} if offsets else {})}
        if not offsets:
            region.release()
        into.region = None   # type: ignore[union-attr]  # the checkpoint's now
    return RegisteredCheckpoint(name, metas, regions, nbytes=sum(m.nbytes for m in metas), seconds=clock.seconds)


def _pin_fresh(backend: DeviceBackend, region: HostRegion, total: int, clock: "_Phases", progress) -> None:
    """Fault a fresh region's pages in and pin them piece by piece, overlapped, before anything is
    copied into it. (Pinning while copying into fresh pages was 2x slower on 2xH200: dense16 5.3 s
    against 2.0 s + 0.35 s.)"""
    if backend.pins_host_memory:
        populate_and_pin(backend, region, on_bytes=_reporter(progress, "populate and pin", total))
        clock.lap("populate and pin")


def _in_place_files(backend: DeviceBackend, headers, inplace: bool):
    """(files eligible for in-place registration, those mapped in place, path -> writable).

    A read-only in-place file is mapped read-only; a kind that pins host memory (which needs
    write access to the pages) gets a copy instead, as does every file of a kind that cannot
    pin memory where it lies."""
    eligible = [h for h in headers if _in_place(h.path, inplace)]
    writable = {h.path: file_writable(h.path) for h in eligible}
    placed = [h for h in eligible if writable[h.path] or not backend.pins_host_memory]
    if placed and backend.pins_host_memory and not backend.pins_in_place:
        _log.info("%s cannot pin host memory in place: copying %d /dev/shm file(s) into pinned memory "
                  "instead of mapping them", backend.kind, len(placed))
        placed = []
    return eligible, placed, writable


def _reporter(progress, phase: str, total: int):
    """``progress`` bound to one phase of ``total`` bytes, for :func:`counted` (None: no progress)."""
    if progress is None or not total:
        return None
    return lambda done: progress(phase, done, total)


def _read_header(path: str) -> SafetensorsHeader:
    try:
        return read_header(path)
    except OSError as exc:   # unreadable (permissions), vanished since the check
        raise ConfigError(f"cannot read checkpoint file {path!r}: {exc}") from exc


def _unlink(paths) -> None:
    """Delete in-place files the caller asked us to: a mapped file's memory goes when we release
    the map, a copied one's at once.
    A file that cannot be deleted is kept (and said so): the registration stands."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            _log.warning("could not delete the in-place checkpoint file %r (unlink_inplace_files=True): %s",
                         path, exc)


class _Phases:
    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._t
        self._t = now


def _without(h: SafetensorsHeader, names: set[str]) -> SafetensorsHeader:
    """``h`` without the entries ``names`` (their bytes are still copied with the file, never registered)."""
    return dataclasses.replace(h, tensors=tuple(e for e in h.tensors if e.name not in names)) if names else h


def _layout(copied: list[SafetensorsHeader], named) -> tuple[list[int], int]:
    """Start offset in the region of each file's data area, then of each named tensor."""
    offsets, pos = [], 0
    for h in copied:
        offsets.append(pos)
        pos = align_up(pos + h.file_size - h.data_offset)
    for _, t, *_ in named:
        offsets.append(pos)
        pos = align_up(pos + t.numel() * t.element_size())
    return offsets, pos


def _fill_jobs(region: HostRegion, copied, named, layout) -> list:
    buf = region.tensor
    reads = [(h.path, h.data_offset, buf[off: off + h.file_size - h.data_offset])
             for h, off in zip(copied, layout) if h.file_size > h.data_offset]
    pairs = []
    for (_, t, *_), off in zip(named, layout[len(copied):]):
        # a device tensor is copied device-to-host straight into the region (pinned where the kind
        # pins): no host copy of it on the way
        src = _flat_bytes(t)
        pairs.append((buf[off: off + src.numel()], src))
    return read_jobs(region, reads) + copy_jobs(region, pairs)


def _meta(name, dtype: torch.dtype, shape, rid: int, offset: int) -> TensorMeta:
    shape = tuple(int(d) for d in shape)
    n = 1
    for d in shape:
        n *= d
    return TensorMeta(name, WIRE_CODES[dtype], shape, n * dtype.itemsize, dtype.itemsize, rid, offset)


def _metas_copied(rid: int, copied, named, layout) -> list[TensorMeta]:
    out = []
    for h, off in zip(copied, layout):
        out += [_meta(e.name, e.dtype, e.shape, rid, off + e.start - h.data_offset) for e in h.tensors]
    for (n, t, *box), off in zip(named, layout[len(copied):]):
        out.append(_meta(n, t.dtype, t.shape, rid, off)._replace(box=box[0] if box else None))
    return out


def split_checkpoint_files(path: str, rank: int, world_size: int) -> list[str]:
    """The safetensors files of a Hugging Face checkpoint directory that ``rank`` should register.

    Uses ``model.safetensors.index.json`` when present (every file it names must
    exist), else every ``*.safetensors`` in the directory. Files are spread so that
    ranks get similar byte counts; every rank computes the same split.
    """
    files = checkpoint_files(path)   # the index validated: its entries stay inside the directory
    loads = [0] * world_size
    mine = []
    for f in sorted(files, key=lambda p: (-os.path.getsize(p), p)):   # largest first, least-loaded rank
        r = min(range(world_size), key=lambda i: (loads[i], i))
        loads[r] += os.path.getsize(f)
        if r == rank:
            mine.append(f)
    return sorted(mine)
