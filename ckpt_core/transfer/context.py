"""One rank's update context: what the broadcast and P2P flows share, handed to them explicitly.

``ParameterServer`` (the facade) builds one :class:`UpdateContext` per rank and passes it, with
the update's data (a :class:`Catalog` of checkpoints, metas and plans; the P2P state), to the
flows: ``transfer/broadcast.py`` and ``p2p/update.py``. The context holds the rank's
collectives, device backend and keys, ZeroMQ context and copy stream, the IPC buffer it
lends its engine worker, the running update's stop signal, the update counter and the log; the
steps every flow takes alike live here once: the pre-checks of a call and the layout free
memory allows (the first exchange), the handshake, the status agreement after each phase, the
report, the release of the buffer. Nothing outside this module writes its fields.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

import zmq

from ckpt_core._settings import update_seconds
from ckpt_core.checkpoint.sources import RegisteredCheckpoint
from ckpt_core.devices import IpcBuffer
from ckpt_core.errors import CkptError, ConfigError, RemoteWorkerError, UpdateTimeoutError
from ckpt_core.planning.buckets import Plan, TensorMeta, choose_layout
from ckpt_core.planning.slices import require_plan
from ckpt_core.transfer.collectives import Collectives
from ckpt_core.transfer.plan_cache import PlanCache
from ckpt_core.transfer.prechecks import Problem, problem_of, req_precheck
from ckpt_core.transfer.signals import ReqThread, StopSignal, req_func_failure
from ckpt_core.transfer.signals import causes as causes_of
from ckpt_core.wire.link import Failure, PsLink

GiB = float(1 << 30)
Tell = Callable[..., None]   # tell(operation, phase, done=None, total=None): the facade's progress callback


@dataclass
class Catalog:
    """What one rank holds for updates: its registered checkpoints, every gathered or loaded
    checkpoint's metas (one list per owner rank) and the plans cached per layout. The facade fills
    it (register, gather, load, unregister); the flows read it."""
    checkpoints: dict[str, RegisteredCheckpoint] = field(default_factory=dict)
    metas: dict[str, list[list[TensorMeta]]] = field(default_factory=dict)
    plans: PlanCache = field(default_factory=PlanCache)   # shared by checkpoints of one layout

    def release(self) -> None:
        """Free every registered checkpoint's host memory and forget them (the facade's close())."""
        for ckpt in self.checkpoints.values():
            ckpt.release()
        self.checkpoints.clear()

    def registered_bytes(self, name: str | None = None) -> int | None:
        """Host bytes of registered checkpoint ``name`` (None: of every one; an unknown name: None); a
        device-resident one (``on_device``) holds none."""
        def host(c: RegisteredCheckpoint) -> int:
            return 0 if c.on_device else c.nbytes
        if name is not None:
            return host(self.checkpoints[name]) if name in self.checkpoints else None
        return sum(host(c) for c in self.checkpoints.values())

    def tensor_specs(self, name: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        """``{tensor: (dtype code, shape)}`` of every tensor of gathered checkpoint ``name`` (all ranks')."""
        metas = self.metas.get(name)
        if metas is None:
            raise ConfigError(f"call gather_metas({name!r}) before tensor_specs({name!r})")
        return {m.name: (m.dtype, tuple(m.box[0] if m.box is not None else m.shape)) for ms in metas for m in ms}


def agree_device_keys(coll: Collectives, key: str) -> tuple[list[str], str]:
    """Collective at construction: every rank's device key, in rank order (distinct, or ``ConfigError``),
    and the world's run id (rank 0's random token: it names IPC buffers and update ids)."""
    peers = coll.all_gather_json({"key": key, "token": secrets.token_hex(6)})
    keys = [p["key"] for p in peers]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"two ranks share a device key: {keys}; set LOCAL_RANK per rank")
    return keys, peers[0]["token"]


class UpdateContext:
    """One PS rank's side of every update (see the module docstring).

    Owns the ZeroMQ context, the copy stream and the IPC buffer (``close()`` frees them); uses the
    collectives and the backend it is given (the facade owns those)."""

    def __init__(self, *, settings, backend, device_index: int, device_key: str, device_keys: list[str],
                 run_id: str, coll: Collectives, wire: str, keep_device_buffers: bool, log, tell: Tell):
        self.settings, self.rank, self.world_size = settings, settings.rank, settings.world_size
        self.backend, self.device_index, self.device_key = backend, device_index, device_key
        self.device_keys = device_keys   # every rank's, in rank order: the workers' handles
        self.run_id = run_id             # the world's: names IPC buffers and update ids
        self.coll, self.wire, self.keep_device_buffers = coll, wire, keep_device_buffers
        self.log, self.tell = log, tell
        self.zmq = zmq.Context()
        self.copy_stream = backend.new_stream(device_index)
        self.last_update: dict | None = None
        self._ipc: IpcBuffer | None = None
        self._updates = 0
        self._called = time.monotonic()   # when this rank's update() began (precheck_call)
        self._closing: str | None = None   # set by stop() (close() in another thread): the update stops
        # every rank passed the running update's handshake agreement: from there a bucket may reach an engine
        # (reset by began_update; read by delta/dispatch.py for what a failed full update left)
        self.past_handshake = False
        self._signal: StopSignal | None = None   # the running update's: stop() tells every rank at once

    # -- counters and stop signal ------------------------------------------------
    def next_update_id(self) -> str:
        """The id of the update about to start (unique in this world); counts it."""
        update_id = f"{self.run_id}-{self._updates}"
        self._updates += 1
        return update_id

    @property
    def closing(self) -> str | None:
        """Why the running update must stop (close() was called), or None."""
        return self._closing

    def stop(self, reason: str) -> None:
        """close() in another thread: the running update fails on every rank at once, a later one here."""
        self._closing = reason
        signal = self._signal
        if signal is not None:   # peers stop waiting at once, even while this rank sits in a collective
            signal.publish(Failure(self.rank, self.device_key, reason))

    def stop_signal(self, update_id: str, req: ReqThread | None) -> StopSignal:
        """The update's abort flag in the rendezvous store (not yet armed)."""
        return StopSignal(self.coll.store, f"ckpt/{update_id}/abort", self.rank, req, self.log)

    def arm(self, signal: StopSignal) -> None:
        """From now on ``stop()`` publishes through ``signal``."""
        self._signal = signal

    def disarm(self, signal: StopSignal) -> None:
        """The update ended: ``stop()`` no longer publishes, and ``signal`` lets go of the store."""
        self._signal = None
        signal.close()

    def closing_stop(self, link: PsLink) -> str | None:
        """close() was called in another thread: this rank's update fails (and tells its peers)."""
        if self._closing is not None:
            link.fail(self._closing)
        return self._closing

    # -- the IPC buffer --------------------------------------------------------
    @property
    def ipc(self) -> IpcBuffer | None:
        """The buffer this rank lends its worker, kept between updates (None: none)."""
        return self._ipc

    def ensure_ipc(self, nbytes: int) -> IpcBuffer:
        if self._ipc is not None and self._ipc.nbytes >= nbytes:
            return self._ipc
        self.release_ipc()
        ipc: IpcBuffer = self.backend.alloc_ipc(nbytes, self.device_index, f"{self.run_id}-{self.rank}-{self._updates}")
        self._ipc = ipc
        return ipc

    def try_ipc(self, buffer_bytes: int) -> tuple[IpcBuffer | None, str | None]:
        """The IPC buffer, or why it could not be allocated: told to every rank at the handshake's
        agreement, not raised by this rank alone."""
        try:
            return self.ensure_ipc(buffer_bytes), None
        except CkptError as exc:
            return None, f"cannot allocate the {buffer_bytes}-byte IPC buffer: {exc}"

    def release_ipc(self) -> None:
        if self._ipc is not None:
            self._ipc.close()
            self._ipc = None
            self.backend.empty_cache()

    def take_ipc(self) -> IpcBuffer | None:
        """Hand the buffer over (to a quarantine that frees it once a failed read settled): this
        context forgets it without freeing it."""
        ipc, self._ipc = self._ipc, None
        return ipc

    def release_after(self, mapped: bool, *, broken: bool) -> None:
        """After an update, free the IPC buffer unless it is kept (``keep_device_buffers``). A buffer
        no worker mapped stays exported (torch frees an IPC export only once a consumer has let go
        of it): it is kept for the next update instead of leaking it. After a broken collective it
        may still be the target of a stuck broadcast: close() frees it, once the groups are aborted."""
        if not self.keep_device_buffers and mapped and not broken:
            self.release_ipc()

    def close(self) -> None:
        """Free the IPC buffer and the ZeroMQ context (the facade's ``close()``, under its update lock)."""
        self.release_ipc()
        self.zmq.term()

    # -- the first exchange ----------------------------------------------------
    def precheck_call(self, req_func, timeout, slices=None) -> tuple[float, Problem | None]:
        """The checks every update makes, broadcast or P2P: (deadline, problem), nothing raised.

        With a bad ``timeout`` the deadline is ``PS_COLLECTIVE_TIMEOUT_S`` away: long enough
        for the first exchange, which tells every rank the problem. ``slices`` must be a
        ``SlicePlan`` (not its digest or JSON) and needs our own wire.
        """
        self._called = time.monotonic()
        try:
            deadline = time.monotonic() + update_seconds(timeout)
        except ConfigError as exc:
            return time.monotonic() + self.settings.collective_timeout_s, problem_of(exc)
        if not callable(req_func):
            return deadline, problem_of(ConfigError(f"req_func must be callable, got {type(req_func).__name__}"))
        if slices is not None:
            try:
                require_plan(slices)
            except ConfigError as exc:
                return deadline, problem_of(exc)
            if self.wire != "native":
                return deadline, problem_of(ConfigError("slices are supported with the native wire only"))
        return deadline, req_precheck(req_func)

    def layout(self, sizes: tuple[int, int], *, delta: bool = False) -> tuple[int, int]:
        """The (bucket size, slots) this rank's free device memory allows (the buffer it holds
        counts as free), for a checkpoint whose largest tensor and largest owner share are ``sizes``
        (``delta``: a delta's companion, in ``PS_DELTA_BUCKETS`` buckets per owner)."""
        free = self.backend.mem_get_info(self.device_index)[0] + (self._ipc.nbytes if self._ipc else 0)
        largest, owner_total = sizes
        return choose_layout(
            free, mem_fraction=self.settings.mem_fraction, max_slots=self.settings.num_slots,
            max_bucket_bytes=self.settings.max_bucket_bytes, largest_tensor=largest, largest_owner_total=owner_total,
            buckets_per_owner=self.settings.delta_buckets if delta else None)

    # -- the phases every flow shares ------------------------------------------
    def handshake(self, link: PsLink, hello: tuple[bytes, bytes] | None, publish, *, alloc_failed: str | None = None,
                  ckpt: RegisteredCheckpoint | None = None) -> bool:
        """Send the plan and buffer to this rank's worker; whether it mapped the buffer. A local
        problem (no buffer, an in-place file of ``ckpt`` that shrank) fails the link and is published."""
        mapped = False
        if alloc_failed:
            link.fail(alloc_failed)
        elif time.monotonic() >= link.deadline:
            # the first exchange ended past this rank's deadline (a rank called update() late): the
            # update fails here on every rank, not later or never depending on how fast this rank's
            # worker answers what is already waiting (``PsLink._wait`` takes it)
            link.expire("timed out before the handshake: the update timeout had passed when the first "
                        "exchange ended")
        else:
            link.send_hello(frame=hello)
            mapped = link.wait_ready()
        problem = None if ckpt is None else ckpt.source_problem()
        if problem:
            link.fail(problem)
        if not mapped or problem:
            publish(link.failure)
        return mapped

    def agree(self, link: PsLink, req: ReqThread, deadline: float, *, phase: str, final: bool) -> None:
        """All ranks exchange their status; if any failed, every rank aborts its worker and raises."""
        failure = None
        if req.error is not None:
            failure = req_func_failure(self.rank, self.device_key, req.error)
        failure = failure or link.failure
        if failure is not None and failure.timeout and req.is_alive() and not link.reached:
            # The deadline passed before the worker connected while req_func, which brings it the
            # handles, was still running: req_func is the cause (on a loaded host either wait may
            # expire first; the answer must not depend on which).
            failure = Failure(self.rank, self.device_key, "req_func did not return within the update timeout, "
                              f"and the engine worker never connected ({failure.message})", timeout=True)
        if failure is not None and failure.timeout and failure.rank == self.rank and isinstance(link, PsLink):
            failure = self._late_note(failure, link, deadline)
        if failure is None and final:
            req.join(max(0.0, deadline - time.monotonic()))
            if req.is_alive():
                failure = Failure(self.rank, self.device_key, "req_func did not return within the update timeout",
                                  timeout=True)
            elif req.error is not None:   # req_func may fail after the workers finished (e.g. a resume call)
                failure = req_func_failure(self.rank, self.device_key, req.error)
        statuses = self.coll.all_gather_json(failure.to_json() if failure else None)
        failed = [Failure(**s) for s in statuses if s is not None]
        if not failed:
            if phase == "handshake":
                self.past_handshake = True
            return
        # An engine worker's own failure is the cause; ranks that stopped because of it,
        # and req_func failing because the engine reported it, are echoes.
        causes = causes_of(failed)
        reason = "; ".join(f"rank {f.rank}: {f.message}" for f in causes)
        link.send_abort(reason)
        first = causes[0]
        self.log.error("update failed during %s: %s", phase, reason)
        if first.timeout:
            raise UpdateTimeoutError(f"[rank {first.rank}] {first.message} (device {first.device_key}); "
                                     f"failed during {phase}: {reason}")
        raise RemoteWorkerError(f"update failed during {phase}: {reason}", rank=first.rank,
                                device_key=first.device_key, remote_traceback=first.traceback or None)

    def _late_note(self, failure: Failure, link: PsLink, deadline: float) -> Failure:
        """A wait for this rank's worker that timed out, when the timeout was mostly spent before the
        handshake began (planning, or waiting for the other ranks to call update): say so, since
        the cause is then a rank that came late, not this rank's engine."""
        before, budget = link.opened - self._called, deadline - self._called
        if before <= max(1.0, 0.25 * budget):
            return failure
        note = (f" (this rank had spent {before:.1f} s of its {budget:.1f} s update timeout before the handshake "
                "began, in the first exchange: another rank called update() late, or planning was slow)")
        return Failure(failure.rank, failure.device_key, failure.message + note, failure.traceback, timeout=True)

    def report(self, name: str, plan: Plan, stats, times: dict, **layout) -> dict:
        """The update's figures: logged once, kept in ``last_update``, returned."""
        result = {"name": name, "bytes": plan.total_bytes, "buckets": len(plan.buckets),
                  "bucket_bytes": plan.bucket_bytes, **layout, "h2d_bytes": stats.h2d_bytes,
                  "waits": {"deferred": stats.deferred, "awaited": stats.awaited},
                  "seconds": times, "gbps": plan.total_bytes / times["total"] / 1e9}
        self.last_update = result
        self.log.info("updated %r: %.3f GiB in %d buckets, %.3f s (%.1f GB/s); pipeline %.3f s%s", name,
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
