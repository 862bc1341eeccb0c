"""The ``ckpt`` weight-transfer backend for vLLM's native RL weight-update API.

With ``--weight-transfer-config '{"backend": "ckpt"}'`` (registered by :mod:`ckpt_vllm.plugin`),
vLLM's own routes drive an update from our parameter server:

    POST /init_weight_transfer_engine  {"init_info": {"timeout_s": 600}}     (optional)
    POST /start_weight_update                                  a session opens; nothing is touched
    POST /update_weights  {"update_info": {"zmq_handles": {device_key: handle}}}
                                    the layerwise reload begins, blocks until the PS update is in
    POST /finish_weight_update                                 deferred layers processed

The reload begins inside ``/update_weights`` (not at ``/start``): the engine keeps running steps
between the calls, and a layer on the meta device would kill it. Any failure of
``/update_weights`` (its parsing included) aborts the session: layers not yet processed get their
old weights back. A failed ``/update_weights`` or ``/finish_weight_update`` ends vLLM's session on
every worker, so the next ``/start_weight_update`` is accepted (no ``/finish_weight_update`` is due
after a failed ``/update_weights``). A failure on any worker is answered by every worker in the same
call (``_sessions.answer_together``: the last one raises it), so vLLM's next call reads its own replies.

``update_info`` may add ``timeout_s`` and ``check_complete`` (default true: the update carries
the whole checkpoint, so it is checked and finalized before the PS's update returns, and
``/finish_weight_update`` has nothing left to do; pass false to spread one checkpoint over
several PS updates: the check and vLLM's deferred processing then run at ``/finish_weight_update``,
a tensor sent twice in the session is refused, and generation must stay paused from the first
part to the finish, since the model is half reloaded in between), and ``slices``: the digest
of a slice plan installed with the extension's ``ckpt_use_slice_plan`` that the PS update routes
by (each worker then receives only its slices and hands them to the reload as ``SliceTensor``s,
see ``_slices.py``; every worker must hold it, else none loads).
This module imports vLLM; vLLM imports it lazily when the backend is selected.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from ckpt_core.errors import ConfigError

from . import worker as _w
from ._reload import ReloadSession
from ._sessions import answer_together

__all__ = ["CkptInitInfo", "CkptUpdateInfo", "CkptWeightTransferEngine"]

log = logging.getLogger("ckpt_vllm")


@dataclass
class CkptInitInfo(WeightTransferInitInfo):
    timeout_s: float = _w.DEFAULT_TIMEOUT_S


@dataclass
class CkptUpdateInfo(WeightTransferUpdateInfo):
    zmq_handles: dict[str, str] = field(default_factory=dict)
    timeout_s: float | None = None
    check_complete: bool = True
    slices: str | None = None   # digest of an installed slice plan (``ckpt_use_slice_plan``) the PS routes by

    def __post_init__(self):
        if not self.zmq_handles or not all(isinstance(k, str) and isinstance(v, str)
                                           for k, v in self.zmq_handles.items()):
            raise ValueError("update_info.zmq_handles must map device keys to ZeroMQ handles (strings)")
        if self.slices is not None and not isinstance(self.slices, str):
            raise ValueError("update_info.slices must be the digest of an installed slice plan (a string)")


class CkptWeightTransferEngine(WeightTransferEngine[CkptInitInfo, CkptUpdateInfo]):
    """Receives weights from a colocated ckpt-engine parameter server (shared memory / device IPC)."""

    init_info_cls = CkptInitInfo
    update_info_cls = CkptUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._timeout = _w.DEFAULT_TIMEOUT_S
        self._sessions: list[ReloadSession] | None = None   # None: no session; []: started, not begun
        self._target = (model, self.model_config, "model")
        self._zmq_ctx = None
        self._managed = self._start_managed_ps()   # managed mode (CKPT_ENGINE_SERVE); None otherwise

    def init_transfer_engine(self, init_info: CkptInitInfo) -> None:
        if init_info.timeout_s <= 0:
            raise ValueError(f"init_info.timeout_s must be positive, got {init_info.timeout_s}")
        self._timeout = float(init_info.timeout_s)

    def start_weight_update(self) -> None:
        # Nothing is touched here: the engine may still run steps until /update_weights arrives,
        # and layers put on the meta device now would kill it. The reload begins in the receive.
        # The worker retargets self.model/self.model_config at the drafter for a draft session.
        self._target = (self.model, self.model_config,
                        "model" if self.model is self._default_model else "draft model")
        self._sessions = []

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU;
        # the core's receive loop already synchronizes the device after every bucket.
        # Any failure, parsing included, aborts the session: the old weights keep serving. A failure
        # on any worker is raised by the last worker alone (answer_together: vLLM's executor stops
        # reading replies at the first failed worker, and the rest would answer the next call), and
        # every worker ends vLLM's weight update alike, as vLLM 0.32 does on the worker that raises:
        # the next /start_weight_update is accepted everywhere, and no /finish_weight_update is due.
        try:
            answer = answer_together("the update (/update_weights)",
                                     lambda: self.receive_weights(self.parse_update_info(update_info)))
        except BaseException:
            self._abort()
            _end_worker_session(self)
            raise
        if isinstance(answer, dict) and "refused" in answer:
            self._abort()
            _end_worker_session(self)

    def receive_weights(self, update_info: CkptUpdateInfo) -> None:
        if self._sessions is None:
            raise ConfigError("update_weights called outside a weight update: call start_weight_update first")
        kind, index = self._device()
        handle = _w.agree_on_handle(update_info.zmq_handles, kind, index)
        if handle is None:   # another worker lacks its handle: none loads, the last worker raised for all
            return
        replay = None
        if update_info.slices is not None:   # every worker holds the plan and is fed by its own PS rank, or none loads
            try:
                replay = _w.agree_on_slices(update_info.zmq_handles, kind, index, update_info.slices)
            except _w.Refused:
                return
        timeout = float(update_info.timeout_s or self._timeout)
        if not self._sessions:   # the first update of this session begins the reload
            _forget_live_version(self)
            model, model_config, label = self._target
            session = ReloadSession(model, model_config, label=label)
            session.begin()
            self._sessions = [session]
        # each PS update of the session names its own plan (or none: whole tensors)
        self._sessions[0].wrap = None if replay is None else replay.wrap
        # A complete update is also finalized in the core's post hook, so that a failure there
        # reaches the PS before its update() returns; /finish_weight_update then has nothing left.
        complete = update_info.check_complete
        _w.receive_into(self._sessions, self._context(), handle, kind, index, timeout=timeout, finalize=complete,
                        replay=replay)
        if complete:
            self._sessions = None

    def finish_weight_update(self) -> None:
        # Answered alike by every worker (see update_weights); a failure ends vLLM's weight update on each.
        try:
            answer_together("the end of the update (/finish_weight_update)", self._finish)
        except BaseException:
            _end_worker_session(self)
            raise

    def _finish(self) -> None:
        sessions, self._sessions = self._sessions, None
        if not sessions:
            return
        try:
            _w.finish_sessions(sessions)
        except BaseException:
            _w.abort_sessions(sessions)
            raise

    def _abort(self) -> None:
        sessions, self._sessions = self._sessions, None
        if sessions:
            _w.abort_sessions(sessions)

    def shutdown(self) -> None:
        self._abort()
        ctx, self._zmq_ctx = self._zmq_ctx, None
        if ctx is not None:
            ctx.term()
        managed, self._managed = self._managed, None
        if managed is not None:
            managed.stop()

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:
        """Abstract in vLLM 0.26 - 0.27's base class (the class would not instantiate there without
        it); the sending side of this backend is ckpt-engine's ParameterServer, driven by
        :mod:`ckpt_vllm.trainer` (vLLM's trainer API) or ``VllmClient.req_func(path='backend')``."""
        raise ConfigError("the ckpt backend's weights are sent by ckpt_vllm.trainer.CkptTrainerWeightTransferEngine "
                          "(vLLM's trainer API; docs/frameworks.md) or by ckpt_core.ParameterServer.update(...) with "
                          "ckpt_vllm.VllmClient.req_func(path='backend'), not trainer_send_weights")

    def _start_managed_ps(self):
        """With CKPT_ENGINE_SERVE=uds:PATH, this worker's PS rank runs as our child (stopped by shutdown)."""
        from vllm.distributed.parallel_state import get_world_group

        from ckpt_core.engines.managed import start_from_env

        group = get_world_group()
        kind, index = self._device()
        return start_from_env(rank=group.rank, world_size=group.world_size, local_rank=index, device=kind)

    def _device(self) -> tuple[str, int]:
        """The same (kind, index) the worker extension uses; the engine sees no worker object."""
        def local_rank() -> int:
            from vllm.distributed.parallel_state import get_world_group

            return get_world_group().local_rank
        return _w.device_kind_index(self.device, local_rank)

    def _context(self):
        import zmq

        if self._zmq_ctx is None:
            self._zmq_ctx = zmq.Context()
        return self._zmq_ctx


def _calling_worker(engine: CkptWeightTransferEngine) -> Any:
    """The vLLM worker whose call (``Worker.update_weights`` or ``Worker.finish_weight_update``) runs
    ``engine`` now, found on the stack by its engine (the engine sees no worker object), or None."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and owner is not engine and getattr(owner, "weight_transfer_engine", None) is engine:
            return owner
        frame = frame.f_back
    return None


def _forget_live_version(engine: CkptWeightTransferEngine) -> None:
    """Before this backend's reload first writes into the model: the worker extension, where the server
    also runs it, no longer reports the version its own updates made live, nor holds it as a delta's
    base (a delta of it would apply to other weights); this route names no version."""
    worker = _calling_worker(engine)
    forget = getattr(worker, "_ckpt_forget_live", None)
    if callable(forget):
        forget()
    elif worker is None:
        log.warning("the vLLM worker was not found on the stack: the worker extension's live version, if any, "
                    "is not dropped by this update")


def _end_worker_session(engine: CkptWeightTransferEngine) -> None:
    """After a failed update or finish, clear the calling vLLM worker's "update active" flag.

    vLLM 0.32's worker clears it only when finish succeeds, or on the worker whose update raised, so
    every later /start_weight_update would be refused on the others until someone posted
    /finish_weight_update again. The worker is the caller; it is found on the stack, by its engine.
    """
    owner = _calling_worker(engine)
    if owner is None:
        log.warning("a failed weight update: the vLLM worker was not found on the stack; "
                    "post /finish_weight_update once more before the next update")
        return
    if hasattr(owner, "_weight_update_active"):
        owner._weight_update_active = False
    reset = getattr(engine, "reset_weight_update_target", None)
    if callable(reset):
        reset()
