"""Staged updates in the vLLM worker: receive the next weights beside the live ones while the
engine keeps generating, prepare them in kernel format between steps, commit them in one pause.

``StagedWeights`` is a mixin of :class:`ckpt_vllm.VllmColocateWorkerExtension` (vLLM mixes the
extension, and so these methods, into its worker: every name is prefixed ``ckpt_``/``_ckpt_`` or is
one of the documented RPCs). It uses the extension's ``_ckpt_made_live`` and ``_ckpt_zmq_context``
and vLLM's worker fields (``_sessions.ExtensionWorker`` says which).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext as _nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpt_core import update_weights_from_ipc as _core_update_weights_from_ipc
from ckpt_core.devices import local_device_key
from ckpt_core.errors import CheckpointFormatError, ConfigError
from ckpt_core.wire.staging import StagingArea

from ._live import settle
from ._reload import LiveWrites
from ._sessions import (
    abort_sessions,
    answered_together,
    count_over_workers,
    drafter_target,
    finish_sessions,
    live_layout,
    new_sessions,
    worker_device,
)

if TYPE_CHECKING:
    from ckpt_core.delta.apply import DeltaReceiver

    from ._prepare import PrepareJob
    from ._sessions import ExtensionWorker as _Worker
else:
    _Worker = object   # at run time the worker is vLLM's: the mixin adds no base class of its own

log = logging.getLogger("ckpt_vllm")


@dataclass(eq=False)
class _StageJob:
    """A stage receiving on its own thread of the worker (see ``_ckpt_stage``)."""

    area: StagingArea
    thread: threading.Thread | None = None
    result: dict | None = None
    error: BaseException | None = None
    started_at: float = 0.0
    cancelled: bool = False
    replay: Any = None   # the slice plan it was staged by (``_slices.ReplayPlan``); the commit applies it
    deltas: bool = False   # staged with deltas=True: it may be a delta of the held version (``_delta.py``)
    delta: tuple[str, str] | None = None   # (base, version) of the staged delta, set by its plan


class StagedWeights(_Worker):
    """The staging RPCs of the worker extension (see the module's docstring)."""

    # Set by the RPCs below, unset until the first (hence read with getattr); declared only: a class
    # attribute would be an attribute of vLLM's worker class too, which vLLM refuses on a name clash.
    _ckpt_stage_job: _StageJob | None
    _ckpt_prepare_job: PrepareJob | None
    _ckpt_delta_rx: DeltaReceiver | None   # the held version deltas apply to (``_delta.py``)

    @answered_together("the commit")
    def commit_staged_weights(self, version: str) -> dict:
        """Make the staged weights of ``version`` live, through the reload path an update takes.

        Run it while generation is paused (``VllmClient.commit`` pauses with ``mode=keep``). Every
        worker of the engine must hold ``version`` staged, else none commits. The staging area is
        freed afterwards, also when the commit fails (the engine then serves its previous weights
        for every layer not yet processed, as after a failed update). A prepared stage that its
        preparation found incomplete (``ckpt_prepare_staged``'s state ``refused``) is refused on
        every worker before anything is made live. A refusal or failure is answered by every
        worker in the same call (``_sessions.answer_together``); a failed commit keeps the live
        version when no worker wrote into its live model, else leaves none live (``_live.py``).
        """
        t0 = time.perf_counter()
        stage = _staged_job(self)
        area = None if stage is None else stage.area
        ok = area is not None and area.sealed and area.version == str(version)
        if count_over_workers(not ok) or stage is None:   # (None: not ok here, so counted above)
            staged = "nothing" if area is None or not area.sealed else f"version {area.version!r}"
            raise ConfigError(f"cannot commit version {str(version)!r}: this worker has {staged} staged, or "
                              "another worker of the engine lacks it; nothing was committed")
        area = stage.area
        job = getattr(self, "_ckpt_prepare_job", None)
        refused = job.refused if job is not None else None
        if count_over_workers(refused is not None):
            self._ckpt_drop_staged()
            raise CheckpointFormatError(f"cannot commit version {str(version)!r}: "
                                        f"{refused or 'another worker of the engine found its stage incomplete'}; "
                                        "the stage was dropped and the engine serves its current weights")
        delta = count_over_workers(stage.delta is not None) > 0
        prepared = count_over_workers(not (job is not None and job.prepared)) == 0
        return settle(self, "the commit", lambda writes: self._ckpt_commit(stage, job, str(version), t0, writes,
                                                                           delta=delta, prepared=prepared))

    def _ckpt_commit(self, stage: _StageJob, job, version: str, t0: float, writes: LiveWrites, *, delta: bool,
                     prepared: bool) -> dict:
        """The commit of ``stage`` once every worker agreed to run it: a delta's, a prepared one, or by reload."""
        area = stage.area
        if delta:
            return self._ckpt_commit_delta(area, version, t0, stage.replay, writes)
        delta_rx = getattr(self, "_ckpt_delta_rx", None)
        if delta_rx is not None:
            delta_rx.held = None   # whole weights from a stage: no delta applies to them any more
        if prepared:
            return self._ckpt_commit_prepared(area, job, version, t0, writes)
        replay = stage.replay   # staged by a slice plan: its slices are applied as received
        sessions = new_sessions(self, replay, writes)
        try:
            try:
                for s in sessions:   # no layer half-written: refused before anything is loaded
                    s.check_whole_layers(area.names)
                for bucket in area.buckets:
                    for s in sessions:
                        s.load(bucket)
                finish_sessions(sessions)
            except BaseException:
                abort_sessions(sessions)
                raise
            self._ckpt_made_live(live_layout(sessions, replay), version)
        finally:
            self._ckpt_drop_staged()
        main, device_key, total = sessions[0], local_device_key(*worker_device(self)), time.perf_counter() - t0
        log.info("ckpt commit of %s on %s: %d tensors, %.1f MB in %.3f s", version, device_key,
                 main.tensors, main.bytes / 1e6, total)
        return {"device_key": device_key, "version": version, "tensors": main.tensors, "bytes": main.bytes,
                "seconds": {**main.seconds, "total": total}}

    @answered_together("preparing the stage")
    def ckpt_prepare_staged(self, version: str, budget_bytes: int = 512 << 20) -> dict:
        """Turn the next layers of the staged ``version`` into kernel format (about ``budget_bytes``
        per call; call until the state is no longer ``preparing``), so that the commit is one device
        copy. The live model is unchanged when this returns; see :mod:`ckpt_vllm._prepare`. The
        state ``refused`` (with its ``reason``): the stage is incomplete and its commit will be refused."""
        from ._prepare import PrepareJob, layer_groups, prepare_step

        stage = _staged_job(self)
        if stage is None or not stage.area.sealed or stage.area.version != str(version):
            staged = "nothing" if stage is None or not stage.area.sealed else f"version {stage.area.version!r}"
            raise ConfigError(f"cannot prepare version {str(version)!r}: this worker has {staged} staged")
        area = stage.area
        job = getattr(self, "_ckpt_prepare_job", None)
        if job is None:
            job = self._ckpt_prepare_job = PrepareJob(layer_groups(area.buckets))
            if drafter_target(self) is not None:
                job.give_up("an MTP drafter loads the same checkpoint (its stage is not prepared)")
            elif stage.replay is not None:
                job.give_up("it was staged by a slice plan (its commit applies the slices through the reload)")
            elif stage.deltas:
                job.give_up("it was staged with deltas=True (its commit applies the delta)")
        return {"version": area.version, **prepare_step(self.model_runner.model, self.model_config, job,
                                                        int(budget_bytes))}

    def _ckpt_commit_delta(self, area: StagingArea, version: str, t0: float, replay=None,
                           writes: LiveWrites | None = None) -> dict:
        from ._delta import commit_staged_delta

        try:
            result = commit_staged_delta(self, area.buckets, version, replay, writes)
            self._ckpt_made_live(getattr(self, "_ckpt_live_layout", {}), version)
        finally:
            self._ckpt_drop_staged()
        result.update(device_key=local_device_key(*worker_device(self)), version=version, path="delta",
                      seconds={"total": time.perf_counter() - t0})
        if replay is not None:
            result["slices"] = {"plan": replay.digest, "rank": replay.rank.rank}
        return result

    def _ckpt_commit_prepared(self, area: StagingArea, job, version: str, t0: float,
                              writes: LiveWrites | None = None) -> dict:
        from ._prepare import commit_prepared

        try:
            if writes is not None:   # its first copy writes into the live tensors
                writes.mark()
            seconds = commit_prepared(self.model_runner.model, self.model_config, job)
            layout = {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for b in area.buckets for n, t in b}
            self._ckpt_made_live(layout, version)
            tensors, nbytes = area.tensors, area.nbytes
        finally:
            self._ckpt_drop_staged()
        result = {"device_key": local_device_key(*worker_device(self)), "version": version, "path": "prepared",
                  "tensors": tensors, "bytes": nbytes, "prepared_bytes": job.prepared_bytes,
                  "seconds": {**seconds, "total": time.perf_counter() - t0}}
        log.info("ckpt commit of %s on %s (prepared): %.1f MB copied in %.1f ms", version, result["device_key"],
                 job.prepared_bytes / 1e6, seconds["copy"] * 1e3)
        return result

    @answered_together("dropping the stage")
    def drop_staged_weights(self) -> dict | None:
        """Free the staging area; returns what it held (None if nothing was staged)."""
        area = getattr(self, "_ckpt_staged", None)
        self._ckpt_drop_staged()
        return None if area is None else area.summary()

    def ckpt_weight_versions(self) -> dict:
        """``{"live": version or None, "live_since": unix time, "mixed": bool, "staged": {...} or None}``;
        ``mixed``: the last update or commit failed after a worker began writing (a mix of versions may serve)."""
        area = getattr(self, "_ckpt_staged", None)
        return {"live": getattr(self, "_ckpt_live_version", None),
                "live_since": getattr(self, "_ckpt_live_since", None),
                "mixed": bool(getattr(self, "_ckpt_mixed", False)),
                "staged": None if area is None or not area.sealed else area.summary()}

    def _ckpt_stage(self, handle: str, kind: str, index: int, version: str, device_limit: int,
                    timeout: float, replay=None, deltas: bool = False) -> dict:
        """Start receiving a stage on a thread of this worker and return at once.

        The RPC that starts it runs inside vLLM's engine loop, which does not step while an RPC
        runs: receiving on a thread is what lets the engine keep generating meanwhile. The
        requester then polls :meth:`ckpt_stage_status` (each poll is a short RPC between steps).
        """
        import torch

        self._ckpt_drop_staged()   # a new stage replaces the staged one, also when it fails
        device = torch.device(kind.lower(), index) if kind.lower() == "cuda" else torch.device("cpu")
        job = _StageJob(StagingArea(version, device, device_limit), replay=replay, deltas=deltas)
        expected = getattr(self, "_ckpt_live_layout", None)
        if replay is not None:   # this rank receives its slices only
            expected = replay.staged_layout(expected)
        job.thread = threading.Thread(target=self._ckpt_stage_body, name=f"ckpt-stage-{version}", daemon=True,
                                      args=(job, handle, index, expected, timeout))
        self._ckpt_stage_job = job
        job.thread.start()
        return {"device_key": local_device_key(kind, index), "version": version, "state": "running"}

    def _ckpt_stage_body(self, job: "_StageJob", handle: str, index: int, expected: dict | None,
                         timeout: float) -> None:
        import torch

        area = job.area
        job.started_at = time.time()
        t0 = time.perf_counter()

        def add(weights):
            if job.cancelled:
                raise ConfigError(f"the stage of {area.version!r} was dropped while it ran")
            area.add(weights)

        def seal():
            area.sealed = True

        dropped = f"the stage of {area.version!r} was dropped while it waited for the parameter server"

        try:
            side = None
            if area.device.type == "cuda":   # copies on a stream of their own: generation keeps the default one
                torch.cuda.set_device(area.device)
                side = torch.cuda.Stream(area.device)
            with torch.cuda.stream(side) if side is not None else _nullcontext():
                _core_update_weights_from_ipc(self._ckpt_zmq_context(), handle, index, run=add, timeout=timeout,
                                              on_plan=lambda tensors: self._ckpt_stage_plan(job, tensors, expected),
                                              post_hook=seal, slices=None if job.replay is None else job.replay.route,
                                              should_stop=lambda: dropped if job.cancelled else None)
            job.result = {"device_key": local_device_key(area.device.type, index), **area.summary(),
                          "state": "done", "started_at": job.started_at, "finished_at": time.time(),
                          "seconds": {"copy": area.seconds, "total": time.perf_counter() - t0}}
            log.info("ckpt stage of %s on %s: %d tensors, %.1f MB (%.1f MB on the device) in %.3f s, "
                     "while the engine kept serving", area.version, job.result["device_key"], area.tensors,
                     area.nbytes / 1e6, area.device_bytes / 1e6, job.result["seconds"]["total"])
        except BaseException as exc:   # noqa: BLE001 - handed to the requester by ckpt_stage_status
            area.free()
            job.error = exc
            log.warning("ckpt stage of %s failed: %s: %s", area.version, type(exc).__name__, exc)

    def _ckpt_stage_plan(self, job: "_StageJob", tensors, expected: dict | None) -> None:
        tensors = list(tensors)
        if job.deltas:
            from ._delta import check_staged_plan

            job.delta = check_staged_plan(self, tensors, None if job.replay is None else job.replay.digest)
        # a delta's payloads are not the live layout: its names and its base are checked instead
        job.area.check_plan(tensors, None if job.delta is not None else expected)

    def ckpt_stage_status(self) -> dict:
        """The running or finished stage: ``{"state": "running" | "done" | "failed" | "none", ...}``.

        A stage that failed is reported once (``error_type``, ``error``); the requester raises it."""
        job = getattr(self, "_ckpt_stage_job", None)
        if job is None:
            return {"state": "none"}
        if job.thread.is_alive():
            area = job.area
            return {"state": "running", "version": area.version, "tensors": area.tensors, "bytes": area.nbytes}
        if job.error is not None:   # reported, not raised: a raise on some workers leaves stale replies in vLLM
            self._ckpt_stage_job = None
            return {"state": "failed", "version": job.area.version, "error_type": type(job.error).__name__,
                    "error": str(job.error)}
        return job.result

    def _ckpt_drop_staged(self, join_s: float = 30.0) -> None:
        job = getattr(self, "_ckpt_stage_job", None)
        if job is not None:
            job.cancelled = True
            if job.thread.is_alive():
                job.thread.join(join_s)
                if job.thread.is_alive():
                    raise ConfigError(f"the stage of {job.area.version!r} did not stop within {join_s:g} s")
            job.area.free()
        self._ckpt_stage_job = None
        self._ckpt_prepare_job = None

    @property
    def _ckpt_staged(self) -> StagingArea | None:
        job = _staged_job(self)
        return None if job is None else job.area


def _staged_job(worker: StagedWeights) -> _StageJob | None:
    """``worker``'s stage whose area is staged (received whole, not failed), or None."""
    job = getattr(worker, "_ckpt_stage_job", None)
    return None if job is None or job.thread.is_alive() or job.error is not None else job
