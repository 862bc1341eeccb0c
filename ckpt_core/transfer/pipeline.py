"""The broadcast pipeline: host-to-device copy ∥ broadcast ∥ engine reload, over a ring of slots.

Per bucket ``i`` (slot ``i % num_slots`` of the IPC buffer):
  1. wait until the worker finished with the bucket that last used the slot;
  2. the owner rank copies the bucket's runs from host memory into the slot
     (on a copy stream, so it overlaps the broadcasts in flight);
  3. the slot is broadcast from the owner into every rank's slot;
  4. once the broadcast is done (checked without blocking), the worker is told to load it.
Buckets are interleaved across owners, so every rank's host link is busy.
A worker failure does not stop the collectives (all ranks must issue the same
sequence); the failing rank stops talking to its worker and reports at the end.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass

import torch

from ckpt_core.devices import DeviceBackend, IpcBuffer
from ckpt_core.errors import UpdateTimeoutError
from ckpt_core.planning.boxcopy import copied_bytes, merge_copies
from ckpt_core.planning.buckets import Plan
from ckpt_core.planning.slice_routes import SlicedBucket, replica_groups
from ckpt_core.transfer.collectives import Collectives, groups_broken
from ckpt_core.wire.link import PsLink

AWAIT_SLICE_S = 0.0002   # polling step while the host must wait for the device


@dataclass
class PipelineStats:
    seconds: float = 0.0
    buckets: int = 0
    h2d_bytes: int = 0
    bytes: int = 0
    deferred: int = 0    # times a finished broadcast's notice waited because an earlier one was not done
    awaited: int = 0     # times the host had to wait for a broadcast to complete (a slot, or the end)
    # What this rank was the source of (each send it issued, each broadcast it was the root of; in a
    # world of one rank such a broadcast moves nothing):
    sent_bytes: int = 0       # bytes of tensors and slices it owns
    forwarded_bytes: int = 0  # bytes of slices it re-broadcast in its replica group for an owner outside it
    sends: int = 0            # sends and broadcasts it was the source of


def byte_box(flat: torch.Tensor, shape, offsets, extent, itemsize: int) -> torch.Tensor:
    """The box (``offsets``, ``extent``) of the row-major tensor of ``shape`` whose bytes are
    ``flat`` (uint8), as a uint8 view with the last dimension scaled by the itemsize, so that
    every dtype is moved bit-exact."""
    k = itemsize
    shape = list(shape) or [1]
    shape[-1] *= k
    box = flat[: math.prod(shape)].view(shape)
    last = len(shape) - 1
    for d, (o, e) in enumerate(zip(offsets, extent)):
        box = box.narrow(d, o * (k if d == last else 1), e * (k if d == last else 1))
    return box


def segment_payloads(bucket) -> list[int]:
    """Bytes of tensors (or of their pieces) in each segment of a broadcast bucket (the rest is
    alignment and small gaps), worked out once per planned bucket (plans are cached)."""
    cached = getattr(bucket, "_payloads", None)
    if cached is None:
        if bucket.shared is None:
            cached = [bucket.payload]
        else:
            spans = sorted(bucket.spans, key=lambda s: s.offset)
            starts = [s.offset for s in spans]
            cached = [sum(s.nbytes for s in spans[bisect_left(starts, seg.offset):
                                                   bisect_left(starts, seg.offset + seg.nbytes)] if s.rank == seg.rank)
                      for seg in bucket.segments]
        bucket._payloads = cached
    return cached


def pitched_copies(bucket: SlicedBucket, rank: int) -> list:
    """Rank ``rank``'s copies of a bucket of slices (the owner's, or a piece owner's part of
    them), per host buffer (``planning/boxcopy.py``: pitched, none across a pinned piece's border,
    merged where runs continue each other or follow at constant steps: one copy for a layer's
    experts' slices of one kind), worked out once per planned bucket and rank (plans are cached)."""
    cached = getattr(bucket, "_pitched", None)
    if cached is None:
        cached = bucket._pitched = {}  # type: ignore[attr-defined]  # a memo on the planned bucket
    if rank not in cached:
        per_base: dict[int, list] = {}
        for bc in bucket.boxes:
            if (bucket.owner if bc.rank < 0 else bc.rank) == rank:
                per_base.setdefault(bc.base, []).extend(bc.copies())
        cached[rank] = [(base, merge_copies(copies)) for base, copies in per_base.items()]
    return cached[rank]


def place_strided(slot: torch.Tensor, sc) -> None:
    """Copy a strided piece, packed at ``sc.src`` of the slot, into its box of the whole tensor at
    ``sc.dst``."""
    box = byte_box(slot[sc.dst:], sc.shape, sc.offsets, sc.extent, sc.itemsize)
    box.copy_(slot[sc.src: sc.src + box.numel()].view(box.shape))


class BroadcastPipeline:
    """Runs one plan through one rank's IPC buffer. One instance per update."""

    def __init__(self, *, plan: Plan, rank: int, index: int, backend: DeviceBackend, ipc: IpcBuffer,
                 slot_bytes: int, num_slots: int, host: dict[int, torch.Tensor], coll: Collectives,
                 link: PsLink, copy_stream, log, on_failure=None, deadline: float | None = None, progress=None):
        self.plan, self.rank, self.index, self.backend = plan, rank, index, backend
        self.ipc, self.slot_bytes, self.num_slots = ipc, slot_bytes, num_slots
        self.host, self.coll, self.link, self.copy_stream, self.log = host, coll, link, copy_stream, log
        self.on_failure = on_failure           # told once, as soon as this rank's worker fails
        self.progress = progress               # optional (buckets handed to the worker, all buckets)
        # Only the deadline ends a wait on the device: a peer's *worker* failing does not stop
        # the collectives (every rank still issues them), so it is no reason to stop waiting.
        self.deadline = deadline if deadline is not None else float("inf")
        # A broadcast gets as long as any collective: PS_COLLECTIVE_TIMEOUT_S from when it was issued
        # (a dead peer never lets it finish, and the collective library's watchdog only logs that).
        self.collective_s = coll.timeout.total_seconds()
        self.async_ops = backend.collective_backend != "gloo"
        self.pending: deque = deque()          # (index, slot, event, issued at): broadcast issued, worker not told
        self.in_slot: dict[int, int] = {}      # slot -> bucket index the worker may still read
        self.stats = PipelineStats()

    def run(self) -> PipelineStats:
        stats = self.stats
        t0 = time.perf_counter()
        # the replica groups the buckets of slices are broadcast in: made once per ParameterServer,
        # by every rank in the plan's order (a collective of the whole world the first time)
        self.groups = {ranks: self.coll.group(ranks) for ranks in replica_groups(self.plan)}
        for i, bucket in enumerate(self.plan.buckets):
            slot = i % self.num_slots
            self._free_slot(slot)
            dst = self.ipc.tensor[slot * self.slot_bytes: slot * self.slot_bytes + bucket.nbytes]
            self._move(bucket, dst)
            event = self.backend.new_event()
            event.record()
            self.pending.append((i, slot, event, time.monotonic()))
            self.in_slot[slot] = i
            self._notify_finished()
            self.log.debug("bucket %d/%d: %d bytes from rank(s) %s", i + 1, len(self.plan.buckets),
                           bucket.nbytes, bucket.owners())
        while self.pending:
            self._notify(*self.pending.popleft())
        for slot in list(self.in_slot):
            self._free_slot(slot)
        self.backend.synchronize(self.index)
        stats.seconds = time.perf_counter() - t0
        stats.buckets = len(self.plan.buckets)
        stats.bytes = self.plan.total_bytes
        return stats

    def _move(self, bucket, dst: torch.Tensor) -> None:
        """Stage this rank's part of the bucket, broadcast every part from its owner, place strided pieces.

        A bucket of one owner is one segment. In a bucket of pieces every owner stages its own
        segments at once (all host links busy), then each segment is broadcast from its owner;
        the strided pieces, broadcast packed, are then copied into their boxes on every rank.
        """
        if isinstance(bucket, SlicedBucket):
            self._move_slices(bucket, dst)
            return
        segments = bucket.segments
        if bucket.shared is None:
            if bucket.owner == self.rank:
                self.stats.h2d_bytes += self._stage(bucket, dst)
        else:
            mine = [r for s in segments if s.rank == self.rank for r in s.runs]
            if mine:
                self.stats.h2d_bytes += self._copy_runs(mine, dst)
        for seg, payload in zip(segments, segment_payloads(bucket)):
            part = dst if bucket.shared is None else dst[seg.offset: seg.offset + seg.nbytes]
            if seg.rank == self.rank:
                self._count_sent(payload)
            self._wait(self.coll.broadcast(part, seg.rank, async_op=self.async_ops))
        for sc in bucket.scatters:
            place_strided(dst, sc)

    def _move_slices(self, bucket: SlicedBucket, dst: torch.Tensor) -> None:
        """A bucket of one engine rank's slices: each part's rank packs its boxes (a strided
        host-to-device copy per box), and each part reaches that engine rank's PS ranks (its replica
        group) by one transfer: a broadcast in the group from the part's rank, or, when that rank is
        outside the group, a send to the group's first rank, which broadcasts it in the group.
        Pieces' strided intersections are then placed. Every other rank skips the bucket."""
        mine = pitched_copies(bucket, self.rank)
        if mine:
            with self.backend.stream_context(self.copy_stream):
                for base, copies in mine:
                    self.backend.copy_pitched(dst, self.host[base], copies)
                    self.stats.h2d_bytes += copied_bytes(copies)
                copied = self.backend.new_event()
                copied.record()
            copied.wait()
        group = bucket.ranks or (bucket.dest,)
        for part in bucket.segments:
            self._deliver(dst[part.offset: part.offset + part.nbytes], part, group)
        if self.rank in group:
            for sc in bucket.scatters:
                place_strided(dst, sc)

    def _deliver(self, data: torch.Tensor, part, group: tuple[int, ...]) -> None:
        """``part`` of a bucket of slices from its rank to every rank of ``group``, sent once."""
        root = part.rank
        if root not in group:
            root = group[0]
            if self.rank == part.rank:
                self._count_sent(part.payload)
                self._wait(self.coll.send(data, root, async_op=self.async_ops))
            elif self.rank == root:
                self._wait(self.coll.recv(data, part.rank, async_op=self.async_ops))
        if len(group) > 1 and self.rank in group:
            if self.rank == root:
                self._count_sent(part.payload, forwarded=root != part.rank)
            self._wait(self.coll.broadcast(data, root, async_op=self.async_ops, group=self.groups[group]))

    def _count_sent(self, payload: int, *, forwarded: bool = False) -> None:
        self.stats.sends += 1
        if forwarded:
            self.stats.forwarded_bytes += payload
        else:
            self.stats.sent_bytes += payload

    @staticmethod
    def _wait(work) -> None:
        if work is not None:
            work.wait()   # on a device kind this only orders the current stream after the collective

    def _stage(self, bucket, dst: torch.Tensor) -> int:
        """Owner: copy the bucket's host runs into its slot on the copy stream."""
        return self._copy_runs(bucket.copy_runs, dst)

    def _copy_runs(self, runs, dst: torch.Tensor) -> int:
        """Copy host runs into the slot on the copy stream; the broadcasting stream waits for them."""
        n = 0
        with self.backend.stream_context(self.copy_stream):
            for run in runs:
                src = self.host[run.base][run.base_offset: run.base_offset + run.nbytes]
                dst[run.offset: run.offset + run.nbytes].copy_(src, non_blocking=True)
                n += run.nbytes
            copied = self.backend.new_event()
            copied.record()
        copied.wait()   # the stream that issues the broadcast waits for the copy, the host does not
        return n

    def _await(self, event, what: str, issued: float) -> None:
        """Wait for a broadcast with the update's deadline and the collective timeout, never blindly.

        A collective whose peer rank died never completes; ``event.synchronize()``
        would then hold this rank forever (or until the collective library's watchdog
        tears the process down). Polling lets the rank fail with a typed error instead.
        """
        limit = min(self.deadline, issued + self.collective_s)
        if not event.query():
            self.stats.awaited += 1
        while not event.query():
            now = time.monotonic()
            if now > limit:
                why = (f"within PS_COLLECTIVE_TIMEOUT_S={self.collective_s:g} s" if limit < self.deadline
                       else "within the update timeout")
                raise groups_broken(UpdateTimeoutError(
                    f"rank {self.rank}: {what} did not complete {why} (waited {now - issued:.1f} s); "
                    "a peer parameter-server rank died or stalls"))
            time.sleep(AWAIT_SLICE_S)

    def _notify_finished(self) -> None:
        """Hand the worker every bucket whose broadcast is complete, without blocking the host.

        The host must stay free to queue the next host-to-device copies: blocking on
        the newest broadcast here would leave the copy stream idle between buckets.
        """
        while self.pending and self.pending[0][2].query():
            self._notify(*self.pending.popleft())
        if self.pending:
            self.stats.deferred += 1

    def _notify(self, index: int, slot: int, event, issued: float) -> None:
        owners = self.plan.buckets[index].owners()
        self._await(event, f"the broadcast of bucket {index} from rank(s) {owners}", issued)
        self.link.send_bucket(index, slot)
        if self.progress is not None:
            self.progress(index + 1, len(self.plan.buckets))
        self._report()

    def _free_slot(self, slot: int) -> None:
        """Block until the worker is done with whatever bucket last used ``slot``."""
        if slot not in self.in_slot:
            return
        index = self.in_slot.pop(slot)
        # the notice of the bucket after it goes first too: a worker may report a bucket done only once it has
        # the next one (a pipelined delta, wire.worker.Unfinished); waiting for its done with that notice still
        # queued here would wait forever
        while self.pending and self.pending[0][0] <= index + 1:
            self._notify(*self.pending.popleft())
        self.link.wait_done(index)
        self._report()

    def _report(self) -> None:
        if self.link.failure is not None and self.on_failure is not None:
            fn, self.on_failure = self.on_failure, None
            fn(self.link.failure)
