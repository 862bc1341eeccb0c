"""P2P updates (``update(name, req_func, ranks=[...])``): target ranks pull from the owners' host memory.

Called on every rank of the world (it creates the target group, a collective). Then:

* the target ranks map their engines' IPC buffer as in a broadcast update; each bucket
  of the plan is assigned to one target (``planning/nics.assign_readers``), which reads the
  bucket's runs straight from the owner's registered host memory into its slot
  (Mooncake, ``p2p/store.py``) and broadcasts it inside the target group: the same
  pipeline, wire protocol and worker loop as a broadcast update;
* ranks outside ``ranks`` touch neither their device nor their engine: they only take
  part in the status agreements, so that every rank ends the update with one verdict.

The first exchange (``p2p/agree.py``) agrees every rank's pre-checks and the update's
identity; the pipeline (``p2p/pipeline.py``) carries one status byte per bucket, so a
target never hands its worker a bucket whose read failed. A failed or abandoned read
leaves its staging buffer unsettled (``Quarantine``); it is not reused or freed until
settled. The owners may live in another world: their metas (``p2p/metas.py``) say where.
With a slice plan (``p2p/slices.py``) the targets in rank order are its engine ranks, whatever
order ``ranks`` lists them in: a target reads its slices alone, checks them against the owners' box
digests, and names the plan and its engine rank in its hello (its worker checks both).
close() in another thread stops the update on every rank, as on the broadcast path. Each step takes
the rank's ``UpdateContext`` and the P2P state (``p2p/state.py``) explicitly.
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import NoReturn

from ckpt_core.errors import CkptError, RemoteWorkerError, TransportError
from ckpt_core.p2p.agree import first_exchange
from ckpt_core.p2p.pipeline import GroupColl, NoLink, NoReq, P2PBucket, P2PPipeline, P2PSliceBucket
from ckpt_core.p2p.slices import LANDING_BYTES, bucket_runs, per_target, route, slice_reads
from ckpt_core.p2p.state import P2PState
from ckpt_core.p2p.store import MARK, P2PStore
from ckpt_core.planning.buckets import ALIGN, Plan, align_up
from ckpt_core.planning.nics import assign_readers
from ckpt_core.planning.slice_routes import SlicedBucket, rank_placements
from ckpt_core.transfer.context import UpdateContext
from ckpt_core.transfer.signals import ReqThread
from ckpt_core.wire.link import Failure, PsLink
from ckpt_core.wire.protocol import encode_hello, plan_fragment
from ckpt_core.wire.stock import open_link, wire_handles

READ_MARGIN_S = 3.0    # a read must give up this long before the update's deadline, so the ranks can still agree


def run_update(ctx: UpdateContext, state: P2PState, name: str, req_func, ranks, timeout, slices=None) -> dict:
    """Collective over the whole world; see the module docstring. Returns this rank's figures.
    ``slices``: a plan whose engine rank i is the i-th target in rank order (``p2p/slices.py``)."""
    t0 = time.perf_counter()
    deadline, targets, src, tv, sliced = first_exchange(ctx, state, name, req_func, ranks, timeout, slices)
    me = ctx.rank in targets
    group = state.group(targets)
    update_id = ctx.next_update_id()
    if not me:
        _stand_by(ctx, update_id, deadline)
        return {"name": name, "p2p": True, "target": False, "seconds": {"total": time.perf_counter() - t0}}
    assert src is not None and state.store is not None  # noqa: S101 - type narrowing: a target's first exchange
    try:
        size = min(v["layout"][0] for v in tv)
        figures, boxes, routed = None, None, None
        if sliced is None:
            plan, wire = state.catalog.plans.get(src.metas, tv[0]["fp"], size)
            readers = assign_readers([(b.owner, b.nbytes) for b in plan.buckets], list(targets))
            p2p_plan = Plan(plan.bucket_bytes, tuple(_p2p_bucket(b, i, rd) for i, (b, rd) in
                                                     enumerate(zip(plan.buckets, readers))))
        else:
            boxes, routed = sliced, (slices.digest, targets.index(ctx.rank))
            p2p_plan, wire, figures = _sliced_plan(state, src, slices, size, tv[0]["fp"], list(targets), ctx.rank)
        slots = max(1, min(min(v["layout"][1] for v in tv), len(p2p_plan.buckets)))
    except Exception as exc:   # ours or not: every rank learns it at the next agreement
        _fail_through(ctx, exc, deadline)
    result = _run_target(ctx, state.store, name, req_func, deadline, targets, group, src, p2p_plan, wire, slots,
                         update_id, t0, boxes, routed)
    if figures is not None:
        result["slices"] = figures
    return result


def _sliced_plan(state: P2PState, src, slices, size: int, fp: str, targets: list[int], rank: int):
    """(P2P plan, this target's wire form, every target's figures) of a sliced update (cached)."""
    key = (fp, size, slices.digest, tuple(targets), rank)
    if key not in state.sliced_plans:
        routed, owners = route(src.metas, slices, size)
        whole = [i for i, b in enumerate(routed.buckets) if not isinstance(b, SlicedBucket)]
        readers = [targets[b.dest] if isinstance(b, SlicedBucket) else -1 for b in routed.buckets]
        for i, rd in zip(whole, assign_readers([(owners[i], routed.buckets[i].nbytes) for i in whole], targets)):
            readers[i] = rd
        landing = min(LANDING_BYTES, size)   # a slot grows by at most the bucket size
        buckets = tuple(_p2p_sliced_bucket(b, i, rd, owners[i], landing) for i, (b, rd) in
                        enumerate(zip(routed.buckets, readers)))
        received, read = per_target(buckets, targets)
        figures = {"plan": slices.digest, "targets": list(targets), "received_bytes": received, "read_bytes": read,
                   "whole_bytes": slices.whole_bytes()}
        wire = plan_fragment(rank_placements(routed, targets.index(rank)))
        while len(state.sliced_plans) >= 4:
            state.sliced_plans.pop(next(iter(state.sliced_plans)))
        state.sliced_plans[key] = (Plan(routed.bucket_bytes, buckets), wire, figures)
    plan, wire, figures = state.sliced_plans[key]
    return plan, wire, dict(figures)


def _p2p_sliced_bucket(b, index: int, reader: int, owner: int, landing: int) -> P2PBucket:
    """A routed bucket of a sliced update as its reader moves it (``b.owner`` is 0 there, see
    ``p2p/slices.route``; ``owner`` is whose it is): a bucket of slices stays with its reader."""
    if isinstance(b, SlicedBucket):   # its slot: the slices, a landing zone for spans read with holes, the status byte
        reads = slice_reads(b, landing=landing)
        land_at = align_up(b.nbytes) if reads.landing else b.nbytes
        return P2PSliceBucket(owner=reader, placements=b.placements, nbytes=land_at + reads.landing + 1, source=owner,
                              index=index, parts=((owner, bucket_runs(b)),), dest=b.dest, boxes=b.boxes, reads=reads,
                              land_at=land_at)
    return P2PBucket(owner=reader, placements=b.placements, nbytes=b.nbytes + 1, source=owner, index=index,
                     parts=((owner, b.copy_runs),))


def _p2p_bucket(b, index: int, reader: int) -> P2PBucket:
    """A planned bucket as its reader moves it: the reader reads every part from the owner that holds
    it (one owner, or each piece's own), broadcasts the whole slot; every target places strided pieces."""
    parts = tuple((s.rank, s.runs) for s in b.segments)
    return P2PBucket(owner=reader, placements=b.placements, nbytes=b.nbytes + 1, scatters=b.scatters, spans=b.spans,
                     source=b.owner, index=index, parts=parts)


def _stand_by(ctx: UpdateContext, update_id: str, deadline: float) -> None:
    """A rank outside ``ranks`` only takes part in the status agreements. It still has the
    update's stop signal, so that close() here stops the targets at once (``UpdateContext.stop``)."""
    link = NoLink()
    signal = ctx.stop_signal(update_id, None)
    ctx.arm(signal)
    try:
        for phase, final in (("handshake", False), ("transfer", False), ("post-hook", True)):
            if ctx.closing is not None and link.failure is None:
                link.failure = Failure(ctx.rank, ctx.device_key, ctx.closing)
            _agree(ctx, link, NoReq(), deadline, phase, final)
    finally:
        ctx.disarm(signal)


def _fail_through(ctx: UpdateContext, exc: Exception, deadline: float) -> NoReturn:
    """A target failed before its first status exchange: tell every rank there (so nobody waits
    for it until the collective timeout), then raise the error here: its own if it is one of
    ours (it says more), else the agreed one, as on the other ranks."""
    link = NoLink()
    tb = "" if isinstance(exc, CkptError) else traceback.format_exc()
    link.failure = Failure(ctx.rank, ctx.device_key, f"{type(exc).__name__}: {exc}", tb)
    try:
        _agree(ctx, link, NoReq(), deadline, "handshake", False)
    except CkptError as agreed:
        if not isinstance(exc, CkptError):
            raise agreed from exc
    raise exc


def _run_target(ctx: UpdateContext, store: P2PStore, name, req_func, deadline, targets, group, src, plan, wire,
                slots, update_id, t0, box_digests=None, routed=None) -> dict:
    slot_bytes = align_up(max(plan.largest_bucket, ALIGN))
    try:
        ipc = ctx.ensure_ipc(slot_bytes * slots)
        store.register(ipc.tensor.data_ptr(), ipc.nbytes)
    except Exception as exc:   # e.g. no device memory, or Mooncake refusing the registration
        _fail_through(ctx, exc, deadline)
    # Every rank's handle, in rank order (the broadcast contract, so req_funcs that pick their group's
    # handles by position work unchanged); only the targets' sockets exist and only targets run req_func.
    # The engines' wire is the broadcast update's (ctx.wire: native, or the stock worker's for SGLang).
    handles = wire_handles(ctx.wire, update_id, ctx.device_keys)
    req = ReqThread(req_func, handles)
    signal = ctx.stop_signal(update_id, req)
    # close() in another thread stops this rank's waits (its worker's and its reads) as on the broadcast path
    link: PsLink

    def should_stop() -> str | None:
        return ctx.closing_stop(link) or signal.should_stop()
    link = open_link(ctx.wire, ctx.zmq, handles[ctx.rank][1], update_id, rank=ctx.rank, device_key=ctx.device_key,
                     deadline=deadline, should_stop=should_stop, buckets=plan.buckets,
                     slot_bytes=slot_bytes, ipc=ipc, device_kind=ctx.backend.kind)
    times = {"plan": time.perf_counter() - t0}
    pipe = None
    ok = mapped = False
    ctx.arm(signal)
    try:
        req.start()
        hello = encode_hello(update_id, device_kind=ctx.backend.kind, buffer=ipc.descriptor, slot_bytes=slot_bytes,
                             num_slots=slots, plan_json=wire[0], plan_digest=wire[1], slices=routed)
        mapped = ctx.handshake(link, hello, signal.publish)
        _agree(ctx, link, req, deadline, "handshake", False)
        pipe = P2PPipeline(store=store, peers=src.peers, should_stop=should_stop,
                           read_deadline=deadline - READ_MARGIN_S, plan=plan, rank=ctx.rank, index=ctx.device_index,
                           backend=ctx.backend, ipc=ipc, slot_bytes=slot_bytes, num_slots=slots, host={},
                           coll=GroupColl(ctx.coll, group, len(targets)), link=link, copy_stream=ctx.copy_stream,
                           log=ctx.log, on_failure=signal.publish, deadline=deadline,
                           box_digests=None if box_digests is None else dict(enumerate(box_digests)))
        stats = pipe.run()
        times["pipeline"] = stats.seconds
        _agree(ctx, link, req, deadline, "transfer", False)
        link.send_end(ctx.keep_device_buffers)
        link.wait_finished()
        _agree(ctx, link, req, deadline, "post-hook", True)
        ok = True
    finally:
        ctx.disarm(signal)
        link.end(ok, f"the P2P update failed on rank {ctx.rank}: {sys.exc_info()[1]!r}")
        req.join(max(0.0, deadline - time.monotonic()) if ok else 2.0)
        _settle_buffer(ctx, store, ipc, pipe, mapped, broken=getattr(sys.exc_info()[1], "groups_broken", False))
    times["total"] = time.perf_counter() - t0
    result = ctx.report(name, plan, stats, times, slots=slots, device_buffer_bytes=slot_bytes * slots)
    result.update(p2p=True, target=True, read_bytes=pipe.read_bytes, bytes=plan.total_bytes)
    return result


def _settle_buffer(ctx: UpdateContext, store, ipc, pipe, mapped: bool, *, broken: bool) -> None:
    """After a target's update: unregister the staging buffer and free it (unless kept), or, while a
    failed read may still land bytes in it, quarantine it with its registration until that settles."""
    if pipe is not None and pipe.pending_read is not None:
        ctx.take_ipc()   # the quarantine frees it
        ptr = ipc.tensor.data_ptr()
        store.quarantine.add(pipe.pending_read, lambda: (store.unregister(ptr), ipc.close()))
        ctx.log.warning("P2P staging buffer quarantined until its failed read settles")
        return
    store.unregister(ipc.tensor.data_ptr())   # registered per update: a kept buffer may be freed later
    ctx.release_after(mapped, broken=broken)


def _agree(ctx: UpdateContext, link, req, deadline: float, phase: str, final: bool) -> None:
    """``UpdateContext.agree``; a P2P read failure is a TransportError, not an engine's."""
    try:
        ctx.agree(link, req, deadline, phase=phase, final=final)
    except RemoteWorkerError as exc:
        if MARK in str(exc):
            raise TransportError(str(exc)) from exc
        raise


__all__ = ["P2PState", "run_update", "Failure"]
