"""The ``ckpt`` weight-transfer backend for vLLM's native RL weight-update API.

With ``--weight-transfer-config '{"backend": "ckpt"}'`` (registered by :mod:`ckpt_vllm.plugin`),
vLLM's own routes drive an update from our parameter server:

    POST /init_weight_transfer_engine  {"init_info": {"timeout_s": 600}}     (optional)
    POST /start_weight_update                                  layerwise reload begins
    POST /update_weights  {"update_info": {"zmq_handles": {device_key: handle}}}
                                                              blocks until the PS update is in
    POST /finish_weight_update                                 deferred layers processed

``update_info`` may add ``timeout_s`` and ``check_complete`` (default true: the update carries
the whole checkpoint, so it is checked and finalized before the PS's update returns, and
``/finish_weight_update`` has nothing left to do; pass false to spread one checkpoint over
several PS updates: the check and vLLM's deferred processing then run at ``/finish_weight_update``).
This module imports vLLM; vLLM imports it lazily when the backend is selected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from ckpt_core.errors import ConfigError

from . import worker as _w
from ._reload import ReloadSession

__all__ = ["CkptInitInfo", "CkptUpdateInfo", "CkptWeightTransferEngine"]


@dataclass
class CkptInitInfo(WeightTransferInitInfo):
    timeout_s: float = _w.DEFAULT_TIMEOUT_S


@dataclass
class CkptUpdateInfo(WeightTransferUpdateInfo):
    zmq_handles: dict[str, str] = field(default_factory=dict)
    timeout_s: float | None = None
    check_complete: bool = True

    def __post_init__(self):
        if not self.zmq_handles or not all(isinstance(k, str) and isinstance(v, str)
                                           for k, v in self.zmq_handles.items()):
            raise ValueError("update_info.zmq_handles must map device keys to ZeroMQ handles (strings)")


class CkptWeightTransferEngine(WeightTransferEngine[CkptInitInfo, CkptUpdateInfo]):
    """Receives weights from a colocated ckpt-engine parameter server (shared memory / device IPC)."""

    init_info_cls = CkptInitInfo
    update_info_cls = CkptUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._timeout = _w.DEFAULT_TIMEOUT_S
        self._sessions: list[ReloadSession] | None = None
        self._zmq_ctx = None
        self._managed = self._start_managed_ps()   # managed mode (CKPT_ENGINE_SERVE); None otherwise

    def init_transfer_engine(self, init_info: CkptInitInfo) -> None:
        if init_info.timeout_s <= 0:
            raise ValueError(f"init_info.timeout_s must be positive, got {init_info.timeout_s}")
        self._timeout = float(init_info.timeout_s)

    def start_weight_update(self) -> None:
        # The worker retargets self.model/self.model_config at the drafter for a draft session.
        session = ReloadSession(self.model, self.model_config,
                                label="model" if self.model is self._default_model else "draft model")
        session.begin()
        self._sessions = [session]

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU;
        # the core's receive loop already synchronizes the device after every bucket.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: CkptUpdateInfo) -> None:
        if self._sessions is None:
            raise ConfigError("update_weights called outside a weight update: call start_weight_update first")
        kind, index = self._device()
        handle = _w.own_handle(update_info.zmq_handles, kind, index)
        timeout = float(update_info.timeout_s or self._timeout)
        # A complete update is also finalized in the core's post hook, so that a failure there
        # reaches the PS before its update() returns; /finish_weight_update then has nothing left.
        complete = update_info.check_complete
        try:
            _w.receive_into(self._sessions, self._context(), handle, kind, index, timeout=timeout,
                            finalize=complete)
        except BaseException:
            self._sessions = None  # receive_into aborted them: the old weights serve on
            raise
        if complete:
            self._sessions = None

    def finish_weight_update(self) -> None:
        sessions, self._sessions = self._sessions, None
        if sessions is None:
            return
        try:
            _w.finish_sessions(sessions)
        except BaseException:
            _w.abort_sessions(sessions)
            raise

    def shutdown(self) -> None:
        if self._sessions is not None:
            _w.abort_sessions(self._sessions)
            self._sessions = None
        ctx, self._zmq_ctx = self._zmq_ctx, None
        if ctx is not None:
            ctx.term()
        managed, self._managed = self._managed, None
        if managed is not None:
            managed.stop()

    def _start_managed_ps(self):
        """With CKPT_ENGINE_SERVE=uds:PATH, this worker's PS rank runs as our child (stopped by shutdown)."""
        from ckpt_core.service._managed import start_from_env
        from vllm.distributed.parallel_state import get_world_group

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
