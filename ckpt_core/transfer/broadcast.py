"""The broadcast update's flow on one rank (a mixin of :class:`ParameterServer`).

After the first exchange (``_prechecks.UpdateAgreement``) agreed the plan: the IPC buffer, the
handshake with this rank's engine worker, the pipeline (``_broadcast.py``), the post hook, and
an agreement of every rank's status after each phase, so that every rank raises the same
error and every worker aborts when any rank or worker failed.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

from ckpt_core.transfer.pipeline import BroadcastPipeline
from ckpt_core.checkpoint.sources import RegisteredCheckpoint
from ckpt_core.wire.stock import open_link, wire_handles
from ckpt_core.wire.link import Failure, PsLink
from ckpt_core.planning.buckets import ALIGN, Plan, align_up
from ckpt_core.planning.slice_routes import received_bytes
from ckpt_core.wire.protocol import encode_hello
from ckpt_core.transfer.signals import ReqThread, StopSignal, causes as causes_of
from ckpt_core.devices import IpcBuffer
from ckpt_core.errors import CkptError, RemoteWorkerError, UpdateTimeoutError

ReqFunc = Callable[[list[tuple[str, str]]], object]
REQ_GRACE_S = 2.0   # how long a failed update still waits for req_func to return
GiB = float(1 << 30)


class BroadcastUpdate:
    """Uses the ParameterServer's settings, backend, collectives, zmq context and checkpoints."""

    def _ensure_ipc(self, nbytes: int) -> IpcBuffer:
        if self._ipc is not None and self._ipc.nbytes >= nbytes:
            return self._ipc
        self._release_ipc()
        self._ipc = self.backend.alloc_ipc(nbytes, self.device_index, f"{self._run_id}-{self.rank}-{self._updates}")
        return self._ipc

    def _release_ipc(self) -> None:
        if self._ipc is not None:
            self._ipc.close()
            self._ipc = None
            self.backend.empty_cache()

    def _update(self, name: str, req_func: ReqFunc, deadline: float, ckpt: RegisteredCheckpoint | None,
                problem: list | None, slices=None) -> dict:
        t0 = time.perf_counter()
        self._tell("update", "plan")
        plan, slots, (plan_json, plan_digest) = self._agree_plan(name, problem, slices)
        self._tell("update", "handshake", 0, len(plan.buckets))
        slot_bytes = align_up(max(plan.largest_bucket, ALIGN))
        buffer_bytes = slot_bytes * slots
        ipc, alloc_failed = self._try_ipc(buffer_bytes)
        update_id = f"{self._run_id}-{self._updates}"
        self._updates += 1
        handles = wire_handles(self.wire, update_id, self._device_keys)
        abort_key = f"ckpt/{update_id}/abort"
        req = ReqThread(req_func, handles)   # on every rank, like the reference: the function decides what to post

        signal = StopSignal(self._coll.store, abort_key, self.rank, req, self._log)
        should_stop, publish = signal.should_stop, signal.publish

        link = open_link(self.wire, self._zmq, handles[self.rank][1], update_id, rank=self.rank,
                         device_key=self.device_uuid, deadline=deadline,
                         should_stop=lambda: self._closing_stop(link) or should_stop(),
                         buckets=plan.buckets, slot_bytes=slot_bytes, ipc=ipc, device_kind=self.backend.kind)
        times = {"plan": time.perf_counter() - t0}
        ok = mapped = False
        self._stop_signal = signal   # close() in another thread publishes through it
        try:
            req.start()
            hello = None if alloc_failed else encode_hello(
                update_id, device_kind=self.backend.kind, buffer=ipc.descriptor, slot_bytes=slot_bytes,
                num_slots=slots, plan_json=plan_json, plan_digest=plan_digest)
            mapped = self._handshake(link, hello, alloc_failed, ckpt, publish)
            self._agree(link, req, deadline, phase="handshake", final=False)
            times["handshake"] = time.perf_counter() - t0 - times["plan"]
            host = {rid: region.tensor for rid, region in ckpt.regions.items()}
            stats = BroadcastPipeline(plan=plan, rank=self.rank, index=self.device_index, backend=self.backend,
                                      ipc=ipc, slot_bytes=slot_bytes, num_slots=slots, host=host, coll=self._coll,
                                      link=link, copy_stream=self._copy_stream, log=self._log,
                                      on_failure=publish, deadline=deadline,
                                      progress=lambda done, n: self._tell("update", "transfer", done, n)).run()
            times["pipeline"] = stats.seconds
            self._agree(link, req, deadline, phase="transfer", final=False)
            self._tell("update", "post-hook", len(plan.buckets), len(plan.buckets))
            link.send_end(self.keep_device_buffers)
            link.wait_finished()
            self._agree(link, req, deadline, phase="post-hook", final=True)
            ok = True
        finally:
            self._stop_signal = None
            signal.close()
            link.end(ok, f"the update failed on rank {self.rank}: {sys.exc_info()[1]!r}")
            # On failure the error matters more than req_func's return: wait briefly only.
            left = max(0.0, deadline - time.monotonic())
            req.join(left if ok else min(left, REQ_GRACE_S))
            self._release_after(mapped, broken=getattr(sys.exc_info()[1], "groups_broken", False))
        times["total"] = time.perf_counter() - t0
        extra = {} if slices is None else {"slices": self._slices_report(slices, plan, stats)}
        return self._report(name, plan, stats, times, slots=slots, device_buffer_bytes=buffer_bytes, **extra)

    def _release_after(self, mapped: bool, *, broken: bool) -> None:
        """After an update, free the IPC buffer unless it is kept (``keep_device_buffers``). A buffer
        no worker mapped stays exported (torch frees an IPC export only once a consumer has let go
        of it): it is kept for the next update instead of leaking it. After a broken collective it
        may still be the target of a stuck broadcast: close() frees it, once the groups are aborted."""
        if not self.keep_device_buffers and mapped and not broken:
            self._release_ipc()

    def _try_ipc(self, buffer_bytes: int):
        """The IPC buffer, or why it could not be allocated: told to every rank at the handshake's
        agreement, not raised by this rank alone."""
        try:
            return self._ensure_ipc(buffer_bytes), None
        except CkptError as exc:
            return None, f"cannot allocate the {buffer_bytes}-byte IPC buffer: {exc}"

    def _slices_report(self, slices, plan: Plan, stats) -> dict:
        """A sliced update's figures: bytes each engine rank received, and what this rank sent."""
        return {"plan": slices.digest, "received_bytes": [received_bytes(plan, r) for r in range(self.world_size)],
                "whole_bytes": slices.whole_bytes(),
                "sent": {"bytes": stats.sent_bytes, "forwarded_bytes": stats.forwarded_bytes, "sends": stats.sends}}

    def _handshake(self, link: PsLink, hello: bytes | None, alloc_failed: str | None,
                   ckpt: RegisteredCheckpoint, publish) -> bool:
        """Send the plan and buffer to this rank's worker; whether it mapped the buffer. A local
        problem (no buffer, an in-place file that shrank) fails the link and is published."""
        mapped = False
        if alloc_failed:
            link.fail(alloc_failed)
        else:
            link.send_hello(frame=hello)
            mapped = link.wait_ready()
        problem = ckpt.source_problem()
        if problem:
            link.fail(problem)
        if not mapped or problem:
            publish(link.failure)
        return mapped

    def _closing_stop(self, link: PsLink) -> str | None:
        """close() was called in another thread: this rank's update fails (and tells its peers)."""
        if self._closing is not None:
            link.fail(self._closing)
        return self._closing

    def _report(self, name: str, plan: Plan, stats, times: dict, **layout) -> dict:
        """The update's figures: logged once, kept in ``last_update``, returned."""
        result = {"name": name, "bytes": plan.total_bytes, "buckets": len(plan.buckets), "bucket_bytes": plan.bucket_bytes,
                  **layout, "h2d_bytes": stats.h2d_bytes, "waits": {"deferred": stats.deferred, "awaited": stats.awaited},
                  "seconds": times, "gbps": plan.total_bytes / times["total"] / 1e9}
        self.last_update = result
        self._log.info("updated %r: %.3f GiB in %d buckets, %.3f s (%.1f GB/s); pipeline %.3f s%s", name,
                       plan.total_bytes / GiB, len(plan.buckets), times["total"], result["gbps"], stats.seconds,
                       self._slices_line(layout.get("slices")))
        return result

    def _slices_line(self, report: dict | None) -> str:
        """With slices: what this rank's engine rank received of a whole update, for the one log line."""
        if not report:
            return ""
        got, whole = report["received_bytes"][self.rank], report["whole_bytes"]
        return (f"; slices {report['plan'][:12]}: this rank's worker received {got / GiB:.3f} of {whole / GiB:.3f} GiB "
                f"({got / max(whole, 1):.3f})")

    def _agree(self, link: PsLink, req: ReqThread, deadline: float, *, phase: str, final: bool) -> None:
        """All ranks exchange their status; if any failed, every rank aborts its worker and raises."""
        failure = None
        if req.error is not None:
            failure = Failure(self.rank, self.device_uuid, "req_func raised", req.error)
        failure = failure or link.failure
        if failure is not None and failure.timeout and req.is_alive() and not link.reached:
            # The deadline passed before the worker connected while req_func, which brings it the
            # handles, was still running: req_func is the cause (on a loaded host either wait may
            # expire first; the answer must not depend on which).
            failure = Failure(self.rank, self.device_uuid, "req_func did not return within the update timeout, "
                              f"and the engine worker never connected ({failure.message})", timeout=True)
        if failure is None and final:
            req.join(max(0.0, deadline - time.monotonic()))
            if req.is_alive():
                failure = Failure(self.rank, self.device_uuid, "req_func did not return within the update timeout",
                                  timeout=True)
            elif req.error is not None:   # req_func may fail after the workers finished (e.g. a resume call)
                failure = Failure(self.rank, self.device_uuid, "req_func raised", req.error)
        statuses = self._coll.all_gather_json(failure.to_json() if failure else None)
        failed = [Failure(**s) for s in statuses if s is not None]
        if not failed:
            return
        # An engine worker's own failure is the cause; ranks that stopped because of it,
        # and req_func failing because the engine reported it, are echoes.
        causes = causes_of(failed)
        reason = "; ".join(f"rank {f.rank}: {f.message}" for f in causes)
        link.send_abort(reason)
        first = causes[0]
        self._log.error("update failed during %s: %s", phase, reason)
        if first.timeout:
            raise UpdateTimeoutError(f"[rank {first.rank}] {first.message} (device {first.device_key}); "
                                     f"failed during {phase}: {reason}")
        raise RemoteWorkerError(f"update failed during {phase}: {reason}", rank=first.rank,
                                device_key=first.device_key, remote_traceback=first.traceback or None)
