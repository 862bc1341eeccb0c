"""The vLLM worker extension: pull one update from the colocated parameter-server rank.

Start vLLM with ``--worker-extension-cls ckpt_vllm.VllmColocateWorkerExtension`` (and
``VLLM_SERVER_DEV_MODE=1`` for ``/collective_rpc``); the requester then calls
``update_weights_from_ipc`` on every worker through ``/collective_rpc``. vLLM mixes this class
into its worker and refuses to start if any attribute name collides with the worker's own, so
every helper here is prefixed ``_ckpt_``.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext as _nullcontext
from dataclasses import dataclass
from typing import Any, Callable

from ckpt_core import update_weights_from_ipc as _core_update_weights_from_ipc
from ckpt_core.wire.worker import DEFAULT_TIMEOUT_S
from ckpt_core.devices import default_kind, get_backend, local_device_key
from ckpt_core.errors import ConfigError
from ckpt_core.wire.staging import StagingArea

from ._reload import ReloadSession

__all__ = ["VllmColocateWorkerExtension", "worker_device", "drafter_target", "receive_into", "agree_on_handle"]

log = logging.getLogger("ckpt_vllm")


def device_kind_index(device, local_rank: Callable[[], int]) -> tuple[str, int]:
    """(device kind, index) of a vLLM worker's ``device``, as ckpt_core keys devices.

    On CPU the index is the worker's local rank (vLLM's device is plain ``cpu``); on an
    accelerator it is the device's own index. ``local_rank`` is only called on CPU.
    """
    if device.type == "cpu" or device.index is None:
        return device.type, int(local_rank())
    return device.type, int(device.index)


def worker_device(worker: Any) -> tuple[str, int]:
    """(device kind, index) of a vLLM worker (see ``device_kind_index``).

    vllm-ascend's worker may leave ``device`` unset; it is then set to the worker's local rank
    on this host's default device kind (a plugin kind such as ``npu`` when it is available).
    """
    if getattr(worker, "device", None) is None:
        worker.device = get_backend(default_kind()).device(int(worker.local_rank))
    return device_kind_index(worker.device, lambda: worker.local_rank)


def drafter_target(worker: Any):
    """(draft model, its model config) when the drafter shares the target's checkpoint (MTP), else None.

    A drafter with a checkpoint of its own (EAGLE, a separate draft model) must not receive the
    target's tensors; it is left alone.
    """
    runner = worker.model_runner
    get_draft = getattr(runner, "get_draft_model", None)
    draft = get_draft() if callable(get_draft) else getattr(getattr(runner, "drafter", None), "model", None)
    spec = getattr(worker, "speculative_config", None) or getattr(worker.vllm_config, "speculative_config", None)
    if draft is None or spec is None or getattr(spec, "draft_model_config", None) is None:
        return None
    shares_checkpoint = getattr(spec, "method", None) == "mtp" or (
        spec.draft_model_config.model == worker.model_config.model)
    return (draft, spec.draft_model_config) if shares_checkpoint else None


def finish_sessions(sessions: list[ReloadSession]) -> None:
    """Check that every session received all it needs, then let vLLM finalize each one."""
    for s in sessions:
        s.check_complete()
    for s in sessions:
        s.finish()


def abort_sessions(sessions: list[ReloadSession]) -> None:
    for s in sessions:
        s.abort()


def receive_into(sessions: list[ReloadSession], zmq_ctx, zmq_handle: str, kind: str, index: int, *,
                 timeout: float, finalize: bool = True) -> dict:
    """Run one PS update into begun reload ``sessions`` (the model, and the MTP drafter if any).

    With ``finalize``, the completeness check and vLLM's deferred processing run in the core's
    post hook, so the PS learns of a failure before its ``update`` returns. On any failure every
    session is aborted (unprocessed layers keep their old weights) and the error is raised.
    """
    t0 = time.perf_counter()

    def run(weights):
        for s in sessions:
            s.load(weights)

    def on_plan(tensors):
        for s in sessions:
            s.check_plan(name for name, _, _ in tensors)
            if finalize:   # the last update of the weight update: no layer may be left half-written
                s.check_whole_layers(name for name, _, _ in tensors)

    try:
        _core_update_weights_from_ipc(zmq_ctx, zmq_handle, index, run=run, timeout=timeout, on_plan=on_plan,
                                      post_hook=(lambda: finish_sessions(sessions)) if finalize else None)
    except BaseException:
        abort_sessions(sessions)
        raise
    main = sessions[0]
    return {"device_key": local_device_key(kind, index), "tensors": main.tensors, "bytes": main.bytes,
            "drafter": len(sessions) > 1, "seconds": {**main.seconds, "total": time.perf_counter() - t0}}


def new_sessions(worker: Any, replay: Any = None) -> list[ReloadSession]:
    """The reload sessions of the model (and its MTP drafter), begun; ``replay``: the slice plan
    (``_slices.ReplayPlan``) the model's session applies what it receives by, or None (whole tensors)."""
    sessions = [ReloadSession(worker.model_runner.model, worker.model_config, label="model")]
    draft = drafter_target(worker)
    if draft is not None:
        sessions.append(ReloadSession(draft[0], draft[1], label="MTP drafter"))
    if replay is not None:
        sessions[0].wrap = replay.wrap
    for s in sessions:
        s.begin()
    return sessions


def live_layout(sessions: list[ReloadSession], replay: Any = None) -> dict:
    """The checkpoint layout an update through ``sessions`` made live (full shapes under a slice plan)."""
    layout = sessions[0].layout
    return layout if replay is None else replay.live_layout(layout)


def reset_derived_caches(worker: Any) -> None:
    """Drop worker-side state computed from the old weights (vLLM's own reload does the same)."""
    for name in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        fn = getattr(worker.model_runner, name, None)
        if callable(fn):
            fn()


def own_handle(zmq_handles: dict[str, str], kind: str, index: int) -> str:
    key = local_device_key(kind, index)
    if not isinstance(zmq_handles, dict) or key not in zmq_handles:
        known = sorted(zmq_handles) if isinstance(zmq_handles, dict) else type(zmq_handles).__name__
        raise ConfigError(f"no ZeroMQ handle for this worker's device {key} ({kind}:{index}); "
                          f"the parameter server sent handles for {known}")
    return zmq_handles[key]


def agree_on_handle(zmq_handles: dict[str, str], kind: str, index: int) -> str | None:
    """This worker's handle, once every worker of the engine found its own: all load, or none.

    Tensor-parallel workers hold slices of one model: one loading while another refuses would
    leave them on different weights. Each worker checks its handle, then the workers count the
    failures over vLLM's world group (CPU group), before any of them touches a weight. When any
    worker lacks its handle, none loads: the last worker raises ConfigError and the others return
    None (see :func:`refuse_together`: a raise on every worker leaves stale replies in vLLM's executor).
    """
    try:
        handle, problem = own_handle(zmq_handles, kind, index), None
    except ConfigError as exc:
        handle, problem = None, str(exc)
    known = sorted(zmq_handles) if isinstance(zmq_handles, dict) else zmq_handles
    if refuse_together(problem, f"the update (a worker has no ZeroMQ handle among {known})") is not None:
        return None
    return handle


def _tensor_specs(tensors) -> dict[str, tuple[str, tuple[int, ...]]]:
    from ckpt_core.checkpoint.safetensors import WIRE_DTYPES

    if not isinstance(tensors, dict) or not tensors:
        raise ConfigError("ckpt_slice_plan needs {name: [dtype, shape]} of the checkpoint's tensors")
    out = {}
    for name, spec in tensors.items():
        if (not isinstance(spec, (list, tuple)) or len(spec) != 2 or spec[0] not in WIRE_DTYPES
                or not all(isinstance(d, int) and d >= 0 for d in spec[1])):
            raise ConfigError(f"ckpt_slice_plan: tensor {name!r} must be [dtype code, shape], got {spec!r}")
        out[str(name)] = (spec[0], tuple(spec[1]))
    return out


def _slice_rank(worker: Any) -> int:
    """This worker's tensor-parallel rank; slices need one pipeline stage and no drafter."""
    from vllm.distributed import get_tensor_model_parallel_rank

    pc = worker.vllm_config.parallel_config
    if getattr(pc, "pipeline_parallel_size", 1) != 1 or drafter_target(worker) is not None:
        raise ConfigError("slice plans need pipeline parallel size 1 and no MTP drafter: update without slices")
    return int(get_tensor_model_parallel_rank())


# Slice plans installed in this worker process (``ckpt_use_slice_plan``), by digest; the extension's
# updates and the ``ckpt`` weight-transfer backend (``transfer_engine.py``) both apply them.
_SLICE_PLANS: dict[str, Any] = {}


def agree_on_slices(zmq_handles: dict, kind: str, index: int, digest: str):
    """This worker's installed plan ``digest``, once every worker has it and is fed by the PS rank of
    its own tensor-parallel rank (the handles come in PS-rank order): all load (or stage) by it, or
    none (the last worker raises ConfigError, the others raise ``_Refused``)."""
    problem = None
    replay = _SLICE_PLANS.get(str(digest))
    key = local_device_key(kind, index)
    position = list(zmq_handles).index(key) if isinstance(zmq_handles, dict) and key in zmq_handles else -1
    if replay is None:
        problem = f"slice plan {str(digest)[:12]} is not installed on this worker (ckpt_use_slice_plan)"
    elif position != replay.rank.rank:
        problem = (f"the worker of tensor-parallel rank {replay.rank.rank} would receive the slices of PS rank "
                   f"{position}: each PS rank must feed the engine rank of its number")
    refused = refuse_together(problem, f"slice plan {str(digest)[:12]}")
    if refused is not None:
        raise _Refused(refused)
    return replay


class _Refused(Exception):
    """Another worker raises the agreed refusal; this one returns ``refused`` to vLLM."""

    def __init__(self, refused: dict):
        super().__init__(refused["refused"])
        self.refused = refused


def refuse_together(problem: str | None, what: str) -> dict | None:
    """Every worker's ``problem`` counted over the engine: None when no worker has one; else the last
    worker raises ConfigError and the others return ``{"refused": ...}`` (their reason is logged).

    Only the last worker raises because vLLM 0.32's MultiprocExecutor.collective_rpc stops reading
    replies at the first failed worker: the replies of the workers after it stay queued and answer
    the next call. A failure of the last worker alone leaves no reply behind.
    """
    failed = _count_over_workers(problem is not None)
    if not failed:
        return None
    if problem is not None:
        log.error("ckpt: this worker refuses %s: %s", what, problem)
    message = (f"{failed} worker(s) of this engine refused {what}" +
               (f" (this one: {problem})" if problem else " (see the server log for theirs)") + "; no worker used it")
    if _is_last_worker():
        raise ConfigError(message)
    return {"refused": message}


def _is_last_worker() -> bool:
    try:
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
    except (ImportError, AssertionError):
        return True
    return group.rank_in_group == group.world_size - 1


def _count_over_workers(flag: bool) -> int:
    """How many workers of this engine raised ``flag`` (this one alone outside a vLLM world)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
    except (ImportError, AssertionError):
        return int(flag)
    if group.world_size <= 1:
        return int(flag)
    import torch
    import torch.distributed as dist

    count = torch.tensor([int(flag)], dtype=torch.int64)
    dist.all_reduce(count, group=group.cpu_group)
    return int(count.item())


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


class VllmColocateWorkerExtension:
    """Mixed into vLLM's worker by ``--worker-extension-cls ckpt_vllm.VllmColocateWorkerExtension``.

    Example (what :class:`ckpt_vllm.VllmClient` sends)::

        POST /collective_rpc {"method": "update_weights_from_ipc",
                              "args": [{"CPU-<machine>-0": "ipc://@ckpt-..."}]}
    """

    def update_weights_from_ipc(self, zmq_handles: dict[str, str], timeout: float | None = None,
                                stage: str | None = None, stage_device_bytes: int = 0,
                                version: str | None = None, slices: str | None = None) -> dict:
        """Receive one update from the PS rank colocated with this worker; returns its timings.

        ``zmq_handles`` maps device keys to handles (the PS's ``req_func`` argument as a dict);
        this worker picks its own. Raises (and keeps serving the previous weights for every
        layer not yet processed) when a tensor is missing, has the wrong shape, or the PS aborts.

        ``stage="v8"``: stage instead (see :meth:`commit_staged_weights`): the buckets are copied
        into a staging area (device memory up to ``stage_device_bytes``, then pinned host memory)
        while the engine keeps serving its current weights; a stage replaces one staged before.
        ``version`` names the weights an update makes live (see :meth:`ckpt_weight_versions`).
        ``slices``: the digest of the slice plan installed with :meth:`ckpt_use_slice_plan` that the
        PS routes this update by (this worker then receives only its slices, see ``_slices.py``).
        """
        kind, index = worker_device(self)
        handle = agree_on_handle(zmq_handles, kind, index)
        if handle is None:   # another worker lacks its handle; the last worker raised for all
            return {"refused": "a worker of this engine has no ZeroMQ handle; no worker loads anything"}
        try:
            replay = agree_on_slices(zmq_handles, kind, index, slices) if slices is not None else None
        except _Refused as refused:
            return refused.refused
        if stage is not None:
            return self._ckpt_stage(handle, kind, index, str(stage), int(stage_device_bytes),
                                    float(timeout or DEFAULT_TIMEOUT_S), replay)
        sessions = new_sessions(self, replay)
        result = receive_into(sessions, self._ckpt_zmq_context(), handle, kind, index,
                              timeout=float(timeout or DEFAULT_TIMEOUT_S))
        self._ckpt_made_live(live_layout(sessions, replay), version)
        if replay is not None:
            result["slices"] = {"plan": replay.digest, "rank": replay.rank.rank}
        log.info("ckpt update on %s: %d tensors, %.1f MB in %.3f s", result["device_key"], result["tensors"],
                 result["bytes"] / 1e6, result["seconds"]["total"])
        return result

    def ckpt_slice_plan(self, tensors: dict) -> dict:
        """Record which part of each checkpoint tensor this worker's loaders read (``_slices.py``).

        ``tensors``: ``{name: [dtype code, shape]}`` of the checkpoint (``ParameterServer.tensor_specs``).
        Returns ``{"key", "rank", "recording", "whole"}``: the engine's (model, layout, version) key,
        this worker's tensor-parallel rank, its ``RankSlices`` as JSON, and why each tensor sent whole
        is. Nothing is loaded: the live layers are put back afterwards. Recorded once per key; a
        later call with the same key returns the same recording.
        """
        from ckpt_core.planning.slices import rank_to_json

        from ._compat import reload_api
        from ._slices import record, slice_key, tied_aliases

        specs = _tensor_specs(tensors)
        rank = _slice_rank(self)
        model = self.model_runner.model
        key = slice_key(model, self.model_config, self.vllm_config.parallel_config, specs)
        recorded_before = getattr(self, "_ckpt_recordings", None)
        if recorded_before is None:
            recorded_before = self._ckpt_recordings = {}
        if key in recorded_before:   # once per (model, layout, vLLM version): the loaders do not change
            return recorded_before[key]
        aliases = tied_aliases(model)
        session = ReloadSession(model, self.model_config, label="model (slice recording)")
        session.begin()
        try:
            recorded, whole = record(model, specs, self.device, rank=rank, aliases=aliases,
                                     skip_params=reload_api().skip_load_tensors)
        finally:
            session.abort(quiet=True)
        result = {"key": {"model": key.model, "layout": key.layout, "engine": key.engine}, "rank": rank,
                  "recording": rank_to_json(recorded), "whole": whole}
        while len(recorded_before) >= 4:
            recorded_before.pop(next(iter(recorded_before)))
        recorded_before[key] = result
        return result

    def ckpt_use_slice_plan(self, plan: dict) -> dict:
        """Install a slice plan merged from every worker's recording (``VllmClient.slice_plan``):
        checked whole (``planning.slices.check_plan``) and refused unless it was recorded for this
        engine's model, layout and vLLM version. Returns its digest and this worker's bytes."""
        from ckpt_core.planning.slices import plan_from_json

        from ._slices import ReplayPlan, check_installed, slice_key

        problem = None
        try:
            parsed = plan_from_json(plan)
            rank = _slice_rank(self)
            specs = {n: (d, tuple(s)) for n, (d, s, _) in parsed.tensors.items()}
            check_installed(parsed.key, slice_key(self.model_runner.model, self.model_config,
                                                  self.vllm_config.parallel_config, specs))
        except ConfigError as exc:
            problem = str(exc)
        refused = refuse_together(problem, "the slice plan")
        if refused is not None:
            return refused
        _SLICE_PLANS.pop(parsed.digest, None)
        _SLICE_PLANS[parsed.digest] = ReplayPlan(parsed.digest, parsed.key, parsed.rank(rank), parsed.tensors)
        while len(_SLICE_PLANS) > 4:
            _SLICE_PLANS.pop(next(iter(_SLICE_PLANS)))
        return {"plan": parsed.digest, "rank": rank, "bytes": parsed.rank_bytes(rank),
                "whole_bytes": parsed.whole_bytes()}

    def commit_staged_weights(self, version: str) -> dict:
        """Make the staged weights of ``version`` live, through the reload path an update takes.

        Run it while generation is paused (``VllmClient.commit`` pauses with ``mode=keep``). Every
        worker of the engine must hold ``version`` staged, else none commits. The staging area is
        freed afterwards, also when the commit fails (the engine then serves its previous weights
        for every layer not yet processed, as after a failed update).
        """
        t0 = time.perf_counter()
        area = getattr(self, "_ckpt_staged", None)
        ok = area is not None and area.sealed and area.version == str(version)
        if _count_over_workers(not ok):
            staged = "nothing" if area is None or not area.sealed else f"version {area.version!r}"
            raise ConfigError(f"cannot commit version {str(version)!r}: this worker has {staged} staged, or "
                              "another worker of the engine lacks it; nothing was committed")
        job = getattr(self, "_ckpt_prepare_job", None)
        if _count_over_workers(not (job is not None and job.prepared)) == 0:
            return self._ckpt_commit_prepared(area, job, str(version), t0)
        replay = self._ckpt_stage_job.replay   # staged by a slice plan: its slices are applied as received
        sessions = new_sessions(self, replay)
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
            self._ckpt_made_live(live_layout(sessions, replay), str(version))
        finally:
            self._ckpt_drop_staged()
        main = sessions[0]
        result = {"device_key": local_device_key(*worker_device(self)), "version": str(version),
                  "tensors": main.tensors, "bytes": main.bytes,
                  "seconds": {**main.seconds, "total": time.perf_counter() - t0}}
        log.info("ckpt commit of %s on %s: %d tensors, %.1f MB in %.3f s", version, result["device_key"],
                 result["tensors"], result["bytes"] / 1e6, result["seconds"]["total"])
        return result

    def ckpt_prepare_staged(self, version: str, budget_bytes: int = 512 << 20) -> dict:
        """Turn the next layers of the staged ``version`` into kernel format (about ``budget_bytes``
        per call; call until the state is no longer ``preparing``), so that the commit is one device
        copy. The live model is unchanged when this returns; see :mod:`ckpt_vllm._prepare`."""
        from ._prepare import PrepareJob, layer_groups, prepare_step

        area = getattr(self, "_ckpt_staged", None)
        if area is None or not area.sealed or area.version != str(version):
            staged = "nothing" if area is None or not area.sealed else f"version {area.version!r}"
            raise ConfigError(f"cannot prepare version {str(version)!r}: this worker has {staged} staged")
        job = getattr(self, "_ckpt_prepare_job", None)
        if job is None:
            job = self._ckpt_prepare_job = PrepareJob(layer_groups(area.buckets))
            if drafter_target(self) is not None:
                job.give_up("an MTP drafter loads the same checkpoint (its stage is not prepared)")
            elif self._ckpt_stage_job.replay is not None:
                job.give_up("it was staged by a slice plan (its commit applies the slices through the reload)")
        return {"version": area.version, **prepare_step(self.model_runner.model, self.model_config, job,
                                                        int(budget_bytes))}

    def _ckpt_commit_prepared(self, area: StagingArea, job, version: str, t0: float) -> dict:
        from ._prepare import commit_prepared

        try:
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

    def drop_staged_weights(self) -> dict | None:
        """Free the staging area; returns what it held (None if nothing was staged)."""
        area = getattr(self, "_ckpt_staged", None)
        self._ckpt_drop_staged()
        return None if area is None else area.summary()

    def ckpt_weight_versions(self) -> dict:
        """``{"live": version or None, "live_since": unix time, "staged": {...} or None}``."""
        area = getattr(self, "_ckpt_staged", None)
        return {"live": getattr(self, "_ckpt_live_version", None), "live_since": getattr(self, "_ckpt_live_since", None),
                "staged": None if area is None or not area.sealed else area.summary()}

    def _ckpt_stage(self, handle: str, kind: str, index: int, version: str, device_limit: int,
                    timeout: float, replay=None) -> dict:
        """Start receiving a stage on a thread of this worker and return at once.

        The RPC that starts it runs inside vLLM's engine loop, which does not step while an RPC
        runs: receiving on a thread is what lets the engine keep generating meanwhile. The
        requester then polls :meth:`ckpt_stage_status` (each poll is a short RPC between steps).
        """
        import torch

        self._ckpt_drop_staged()   # a new stage replaces the staged one, also when it fails
        device = torch.device(kind.lower(), index) if kind.lower() == "cuda" else torch.device("cpu")
        job = _StageJob(StagingArea(version, device, device_limit), replay=replay)
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

        try:
            side = None
            if area.device.type == "cuda":   # copies on a stream of their own: generation keeps the default one
                torch.cuda.set_device(area.device)
                side = torch.cuda.Stream(area.device)
            with torch.cuda.stream(side) if side is not None else _nullcontext():
                _core_update_weights_from_ipc(self._ckpt_zmq_context(), handle, index, run=add, timeout=timeout,
                                              on_plan=lambda tensors: area.check_plan(tensors, expected),
                                              post_hook=seal)
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
        job = getattr(self, "_ckpt_stage_job", None)
        return None if job is None or job.thread.is_alive() or job.error is not None else job.area

    def _ckpt_made_live(self, layout: dict, version: str | None) -> None:
        reset_derived_caches(self)
        self._ckpt_live_layout = dict(layout)
        self._ckpt_live_version = version
        self._ckpt_live_since = time.time()

    def ckpt_state_digests(self) -> dict[str, list]:
        """``{name: [dtype, shape, sha256]}`` of everything this worker's model reads in its
        forward pass: parameters, buffers, derived kernel tensors and a probe of each linear
        layer (:func:`ckpt_vllm._digest.state_digests`). Compare with a cold load of the same
        checkpoint in the same vLLM: ``POST /collective_rpc {"method": "ckpt_state_digests"}``.
        """
        from ._digest import state_digests

        return state_digests(self.model_runner.model, dtype=getattr(self.model_config, "dtype", None))

    def _ckpt_zmq_context(self):
        # One context per worker process, for its lifetime. No destroy hook on purpose: a hook
        # name that a future vLLM worker also defines would stop vLLM from starting.
        import zmq

        ctx = getattr(self, "_ckpt_zmq_ctx", None)
        if ctx is None:
            ctx = self._ckpt_zmq_ctx = zmq.Context()
        return ctx
