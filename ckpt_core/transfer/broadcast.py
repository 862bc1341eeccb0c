"""The broadcast update's flow on one rank, given the rank's :class:`UpdateContext` and its data.

After the first exchange (``transfer/agree.py``) agreed the plan: the IPC buffer, the
handshake with this rank's engine worker, the pipeline (``transfer/pipeline.py``), the post
hook, and an agreement of every rank's status after each phase (``UpdateContext.agree``), so
that every rank raises the same error and every worker aborts when any rank or worker failed.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

from ckpt_core.checkpoint.sources import RegisteredCheckpoint
from ckpt_core.errors import CheckpointNotFoundError, TransportError
from ckpt_core.planning.buckets import ALIGN, Plan, align_up
from ckpt_core.planning.slice_routes import received_bytes
from ckpt_core.transfer.agree import agree_plan, precheck
from ckpt_core.transfer.context import Catalog, UpdateContext
from ckpt_core.transfer.pipeline import BroadcastPipeline
from ckpt_core.transfer.signals import ReqThread
from ckpt_core.wire.link import PsLink
from ckpt_core.wire.protocol import encode_hello
from ckpt_core.wire.stock import open_link, wire_handles

ReqFunc = Callable[[list[tuple[str, str]]], object]
REQ_GRACE_S = 2.0   # how long a failed update still waits for req_func to return


def run_update(ctx: UpdateContext, catalog: Catalog, name: str, req_func: ReqFunc, timeout, slices=None) -> dict:
    """Collective: a broadcast update of checkpoint ``name`` into every rank's engine worker
    (``ParameterServer.update`` without ``ranks``). Returns this rank's figures."""
    return _update(ctx, catalog, name, req_func, *precheck(ctx, catalog, name, req_func, timeout, slices), slices)


def _update(ctx: UpdateContext, catalog: Catalog, name: str, req_func: ReqFunc, deadline: float,
            ckpt: RegisteredCheckpoint | None, problem: list | None, slices=None) -> dict:
    t0 = time.perf_counter()
    ctx.tell("update", "plan")
    plan, slots, (plan_json, plan_digest) = agree_plan(ctx, catalog, name, problem, slices)
    if ckpt is None:   # precheck's problem: agree_plan raised it on every rank
        raise CheckpointNotFoundError(f"checkpoint {name!r} is not registered on rank {ctx.rank}")
    ctx.tell("update", "handshake", 0, len(plan.buckets))
    slot_bytes = align_up(max(plan.largest_bucket, ALIGN))
    buffer_bytes = slot_bytes * slots
    ipc, alloc_failed = ctx.try_ipc(buffer_bytes)
    update_id = ctx.next_update_id()
    handles = wire_handles(ctx.wire, update_id, ctx.device_keys)
    req = ReqThread(req_func, handles)   # on every rank, like the reference: the function decides what to post

    signal = ctx.stop_signal(update_id, req)
    should_stop, publish = signal.should_stop, signal.publish

    link: PsLink = open_link(ctx.wire, ctx.zmq, handles[ctx.rank][1], update_id, rank=ctx.rank,
                     device_key=ctx.device_key, deadline=deadline,
                     should_stop=lambda: ctx.closing_stop(link) or should_stop(),
                     buckets=plan.buckets, slot_bytes=slot_bytes, ipc=ipc, device_kind=ctx.backend.kind)
    times = {"plan": time.perf_counter() - t0}
    ok = mapped = False
    ctx.arm(signal)   # close() in another thread publishes through it
    try:
        req.start()
        # whose slices these are (PS rank p feeds engine rank p % T, slice_routes.replica_ranks): the worker checks
        routed = None if slices is None else (slices.route_digest, ctx.rank % len(slices.ranks))
        hello = None if ipc is None else encode_hello(   # None: alloc_failed says why
            update_id, device_kind=ctx.backend.kind, buffer=ipc.descriptor, slot_bytes=slot_bytes,
            num_slots=slots, plan_json=plan_json, plan_digest=plan_digest, slices=routed)
        mapped = ctx.handshake(link, hello, publish, alloc_failed=alloc_failed, ckpt=ckpt)
        ctx.agree(link, req, deadline, phase="handshake", final=False)
        times["handshake"] = time.perf_counter() - t0 - times["plan"]
        if ipc is None:   # the handshake failed the link: its agreement raised on every rank
            raise TransportError(f"rank {ctx.rank}: {alloc_failed}")
        host = {rid: region.tensor for rid, region in ckpt.regions.items()}
        if ckpt.on_device:
            _after_caller(ctx)
        stats = BroadcastPipeline(plan=plan, rank=ctx.rank, index=ctx.device_index, backend=ctx.backend,
                                  ipc=ipc, slot_bytes=slot_bytes, num_slots=slots, host=host, coll=ctx.coll,
                                  link=link, copy_stream=ctx.copy_stream, log=ctx.log,
                                  on_failure=publish, deadline=deadline,
                                  progress=lambda done, n: ctx.tell("update", "transfer", done, n)).run()
        times["pipeline"] = stats.seconds
        ctx.agree(link, req, deadline, phase="transfer", final=False)
        ctx.tell("update", "post-hook", len(plan.buckets), len(plan.buckets))
        link.send_end(ctx.keep_device_buffers)
        link.wait_finished()
        ctx.agree(link, req, deadline, phase="post-hook", final=True)
        ok = True
    finally:
        if ckpt.on_device and not ok:   # reads still queued on the copy stream come before the caller's next writes
            _after_copies(ctx)
        ctx.disarm(signal)
        link.end(ok, f"the update failed on rank {ctx.rank}: {sys.exc_info()[1]!r}")
        # On failure the error matters more than req_func's return: wait briefly only.
        left = max(0.0, deadline - time.monotonic())
        req.join(left if ok else min(left, REQ_GRACE_S))
        ctx.release_after(mapped, broken=getattr(sys.exc_info()[1], "groups_broken", False))
    times["total"] = time.perf_counter() - t0
    extra = {} if slices is None else {"slices": _slices_report(slices, plan, stats, ctx.world_size)}
    return ctx.report(name, plan, stats, times, slots=slots, device_buffer_bytes=buffer_bytes, **extra)


def _after_caller(ctx: UpdateContext) -> None:
    """A device-resident checkpoint (``on_device``) is read in place on the copy stream: that stream first
    waits for the work the caller queued on its current stream (the trainer's last writes into its
    tensors), without blocking the host."""
    queued = ctx.backend.new_event()
    queued.record()   # on the calling thread's current stream
    with ctx.backend.stream_context(ctx.copy_stream):
        queued.wait()   # the copy stream waits for it


def _after_copies(ctx: UpdateContext) -> None:
    """After a failed update of a device-resident checkpoint: the caller's current stream waits for the
    copies still queued on the copy stream (a successful one synchronized the device already), so that
    the caller's next writes into its tensors cannot overtake our reads of them."""
    with ctx.backend.stream_context(ctx.copy_stream):
        copied = ctx.backend.new_event()
        copied.record()   # on the copy stream
    copied.wait()   # the calling thread's current stream waits for it


def _slices_report(slices, plan: Plan, stats, world_size: int) -> dict:
    """A sliced update's figures: bytes each engine rank received, and what this rank sent."""
    return {"plan": slices.route_digest, "received_bytes": [received_bytes(plan, r) for r in range(world_size)],
            "whole_bytes": slices.whole_bytes(),
            "sent": {"bytes": stats.sent_bytes, "forwarded_bytes": stats.forwarded_bytes, "sends": stats.sends}}
