"""What the vLLM worker's update, stage and commit paths share: the reload sessions of the model
(and its MTP drafter), this worker's device and ZeroMQ handle, and refusals that every worker of
an engine agrees on before any of them touches a weight."""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ckpt_core import errors as _errors
from ckpt_core import update_weights_from_ipc as _core_update_weights_from_ipc
from ckpt_core.devices import default_kind, get_backend, local_device_key
from ckpt_core.errors import ConfigError, RemoteWorkerError

from ._reload import LiveWrites, ReloadSession

if TYPE_CHECKING:
    import torch
    import zmq
    from vllm.config import ModelConfig, VllmConfig

log = logging.getLogger("ckpt_vllm")


class ModelRunner(Protocol):
    """vLLM's model runner of a worker, as ckpt_vllm reads it (its drafter and ``reset_*`` caches
    are looked up by name: not every runner has them)."""

    model: torch.nn.Module


class VllmWorker(Protocol):
    """The fields of vLLM's worker (``vllm.v1.worker``'s GPU and CPU workers, vllm-ascend's) that
    ckpt_vllm reads: vLLM mixes the worker extension into it (``--worker-extension-cls``)."""

    model_runner: ModelRunner
    model_config: ModelConfig
    vllm_config: VllmConfig
    device: torch.device | None   # vllm-ascend's may be unset: worker_device() sets it
    local_rank: int


class ExtensionWorker(VllmWorker, Protocol):
    """A vLLM worker with :class:`ckpt_vllm.VllmColocateWorkerExtension` mixed in, as the extension's
    mixins (``_staged.StagedWeights``) see it: vLLM's fields and what the extension itself defines."""

    def _ckpt_made_live(self, layout: dict, version: str | None) -> None: ...

    def _ckpt_zmq_context(self) -> zmq.Context: ...


def device_kind_index(device, local_rank: Callable[[], int]) -> tuple[str, int]:
    """(device kind, index) of a vLLM worker's ``device``, as ckpt_core keys devices.

    On CPU the index is the worker's local rank (vLLM's device is plain ``cpu``); on an
    accelerator it is the device's own index. ``local_rank`` is only called on CPU.
    """
    if device.type == "cpu" or device.index is None:
        return device.type, int(local_rank())
    return device.type, int(device.index)


def worker_device(worker: VllmWorker) -> tuple[str, int]:
    """(device kind, index) of a vLLM worker (see ``device_kind_index``).

    vllm-ascend's worker may leave ``device`` unset; it is then set to the worker's local rank
    on this host's default device kind (a plugin kind such as ``npu`` when it is available).
    """
    if getattr(worker, "device", None) is None:
        worker.device = get_backend(default_kind()).device(int(worker.local_rank))
    return device_kind_index(worker.device, lambda: worker.local_rank)


def drafter_target(worker: VllmWorker) -> tuple[torch.nn.Module, ModelConfig] | None:
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
                 timeout: float, finalize: bool = True, replay: Any = None) -> dict:
    """Run one PS update into begun reload ``sessions`` (the model, and the MTP drafter if any).

    With ``finalize``, the completeness check and vLLM's deferred processing run in the core's
    post hook, so the PS learns of a failure before its ``update`` returns. On any failure every
    session is aborted (unprocessed layers keep their old weights) and the error is raised.
    ``replay``: the slice plan the sessions apply (``_slices.ReplayPlan``): the PS must route this
    worker's own engine rank of it (whole tensors when None), else nothing is loaded.
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
                                      post_hook=(lambda: finish_sessions(sessions)) if finalize else None,
                                      slices=None if replay is None else replay.route)
    except BaseException:
        abort_sessions(sessions)
        raise
    main = sessions[0]
    return {"device_key": local_device_key(kind, index), "tensors": main.tensors, "bytes": main.bytes,
            "drafter": len(sessions) > 1, "seconds": {**main.seconds, "total": time.perf_counter() - t0}}


def new_sessions(worker: VllmWorker, replay: Any = None, writes: LiveWrites | None = None) -> list[ReloadSession]:
    """The reload sessions of the model (and its MTP drafter), begun; ``replay``: the slice plan
    (``_slices.ReplayPlan``) the model's session applies what it receives by, or None (whole tensors);
    ``writes``: marked before either session first writes into its live model."""
    sessions = [ReloadSession(worker.model_runner.model, worker.model_config, label="model", writes=writes)]
    draft = drafter_target(worker)
    if draft is not None:
        sessions.append(ReloadSession(draft[0], draft[1], label="MTP drafter", writes=writes))
    if replay is not None:
        sessions[0].wrap = replay.wrap
    for s in sessions:
        s.begin()
    return sessions


def live_layout(sessions: list[ReloadSession], replay: Any = None) -> dict:
    """The checkpoint layout an update through ``sessions`` made live (full shapes under a slice plan)."""
    layout = sessions[0].layout
    return layout if replay is None else replay.live_layout(layout)


def reset_derived_caches(worker: VllmWorker) -> None:
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


class Refused(Exception):
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
    failed = count_over_workers(problem is not None)
    if not failed:
        return None
    if problem is not None:
        log.error("ckpt: this worker refuses %s: %s", what, problem)
    message = (f"{failed} worker(s) of this engine refused {what}" +
               (f" (this one: {problem})" if problem else " (see the server log for theirs)") + "; no worker used it")
    if is_last_worker():
        raise ConfigError(message)
    return {"refused": message}


def _world_group():
    """vLLM's world group of this engine's workers, or None outside a vLLM world."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group()
    except (ImportError, AssertionError):
        return None


def is_last_worker() -> bool:
    group = _world_group()
    return group is None or group.rank_in_group == group.world_size - 1


def count_over_workers(flag: bool) -> int:
    """How many workers of this engine raised ``flag`` (this one alone outside a vLLM world)."""
    return counts_over_workers(flag)[0]


def counts_over_workers(*flags: bool) -> list[int]:
    """For each flag, how many workers of this engine raised it (one all-reduce over vLLM's CPU group)."""
    group = _world_group()
    if group is None or group.world_size <= 1:
        return [int(f) for f in flags]
    import torch
    import torch.distributed as dist

    counts = torch.tensor([int(f) for f in flags], dtype=torch.int64)
    dist.all_reduce(counts, group=group.cpu_group)
    return [int(c) for c in counts.tolist()]


_NOTE_BYTES = 8192   # one worker's failure as it travels to the others: "Type\nmessage", UTF-8, cut to fit


def gather_failures(error: BaseException | None) -> list[tuple[int, str, str]]:
    """``(worker, error type, message)`` of every worker of this engine whose call failed, in
    worker order; every worker calls it once per call, failed or not (one all-gather of a fixed
    size over vLLM's CPU group: plain bytes, no pickle)."""
    note = None if error is None else (type(error).__name__, str(error))
    group = _world_group()
    if group is None or group.world_size <= 1:
        return [] if note is None else [(0, *note)]
    import torch
    import torch.distributed as dist

    mine = torch.zeros(_NOTE_BYTES, dtype=torch.uint8)
    if note is not None:
        data = b"\x01" + f"{note[0]}\n{note[1]}".encode("utf-8", "replace")[:_NOTE_BYTES - 1]
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    notes = [torch.empty_like(mine) for _ in range(group.world_size)]
    dist.all_gather(notes, mine, group=group.cpu_group)
    out = []
    for worker, t in enumerate(notes):
        raw = t.numpy().tobytes().rstrip(b"\x00")
        if raw[:1] == b"\x01":
            kind, _, message = raw[1:].decode("utf-8", "replace").partition("\n")
            out.append((worker, kind, message))
    return out


def _error_class(name: str) -> type[Exception]:
    cls = getattr(_errors, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, _errors.CkptError) else RemoteWorkerError


def _own(error: Exception | None, what: str) -> Exception:
    """This worker's own error, which :func:`gather_failures` listed: never None (else a bug, said)."""
    if error is None:
        raise RemoteWorkerError(f"{what}: a failure was listed for this worker, which raised nothing")
    return error


def answer_together(what: str, call: Callable[[], Any]) -> Any:
    """Run ``call()`` on this worker, then answer alike on every worker of the engine.

    vLLM 0.32's ``MultiprocExecutor.collective_rpc`` reads the workers' replies in order and stops
    at the first failed one: the replies after it stay queued and answer the *next* call, so from
    then on every call reads the replies of the one before. So a failure on any worker (a refusal
    every worker raises, or one worker's own) is answered by all in the same call: every worker
    learns of every failure (:func:`gather_failures`), the last worker raises the first failing
    worker's error (its own exception when that is its own, else one of the same ckpt_core type,
    or ``RemoteWorkerError``), and the others return ``{"refused": message, "error_type": ...}``.
    With no failure every worker returns its result.
    """
    try:
        result, error = call(), None
    except Exception as exc:   # noqa: BLE001 - answered below, by the last worker, for every worker
        result, error = None, exc
    failures = gather_failures(error)
    if not failures:
        return result
    group = _world_group()
    if group is None or group.world_size <= 1:
        raise _own(error, what)
    first, kind, message = failures[0]
    failed = [w for w, _, _ in failures]
    if not is_last_worker():
        if error is not None:   # vLLM logs the traceback of the worker that raises only
            log.error("ckpt: %s failed on this worker; the last worker raises it for all", what, exc_info=error)
        return {"refused": f"{message} (worker {first}; worker(s) {failed} of {group.world_size} failed {what})",
                "error_type": kind}
    if failed == [group.rank_in_group]:   # this worker's own failure alone: raised as it is
        raise _own(error, what)
    raise _error_class(kind)(f"{message} (worker {first}; worker(s) {failed} of {group.world_size} failed "
                             f"{what})") from error


def answered_together(what: str) -> Callable:
    """Decorate an RPC method of the worker extension with :func:`answer_together`."""
    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def answered(self, *args, **kwargs):
            return answer_together(what, lambda: method(self, *args, **kwargs))
        return answered
    return decorate
