"""TRL's ``WeightTransferProtocol`` through ckpt-engine, for ``AsyncGRPOTrainer(weight_transfer=...)``.

TRL's asynchronous GRPO trainer syncs its policy into a vLLM server with five calls on its main
process: ``init_weight_transfer()`` once, then per sync ``pause()``, ``send_weights(iterator)``
(full ``(name, tensor)`` pairs), ``resume()``, and ``destroy()`` at the end. This class maps them
onto :class:`ckpt_vllm.trainer.CkptTrainerWeightTransferEngine` (one parameter-server rank in
the trainer's main process) and the server's own routes::

    from trl.experimental.async_grpo import AsyncGRPOTrainer
    from ckpt_vllm.trl import CkptWeightTransfer

    trainer = AsyncGRPOTrainer(model=..., args=config, ...,
                               weight_transfer=CkptWeightTransfer(config.vllm_server_base_url))

The server runs ``--weight-transfer-config '{"backend": "ckpt"}'`` (and, for ``stage=True``, our
worker extension). Two modes:

- plain: ``pause()`` is the server's ``/pause?mode=keep`` (running requests freeze), the weights go
  in through vLLM's weight-transfer routes, ``resume()`` is ``/resume``;
- ``stage=True``: the transfer moves out of the pause. ``pause()`` leaves the server generating,
  ``send_weights`` stages the weights in every worker meanwhile, and ``resume()`` commits them:
  pause (``keep``), reload the staged weights, reset the prefix cache, resume.

Either way the server serves exactly the trainer's weights once ``resume()`` returns; errors are
ckpt_core's. One PS rank: an engine with one worker (vLLM TP 1), or give ``world_size`` ranks
yourself. Nothing here imports TRL: the class only has the protocol's shape.
"""

from __future__ import annotations

import logging
import time

from ckpt_core.errors import ClosedError, ConfigError

from .sync_client import VllmSyncClient
from .trainer import CkptTrainerInitInfo, CkptTrainerWeightTransferEngine

__all__ = ["CkptWeightTransfer"]

log = logging.getLogger("ckpt_vllm")
PAUSE_MODES = ("keep", "wait", "abort")


class CkptWeightTransfer:
    """TRL's ``WeightTransferProtocol``. ``endpoint``/``uds``: the vLLM server; ``stage``: stage while
    generating, commit at ``resume()``; ``timeout_s``: bound of one sync (every wait); ``pause_mode``:
    how running requests wait (``keep``: frozen, resumed on the new weights); ``ready_timeout_s``: how
    long ``init_weight_transfer`` waits for the server; ``master_port``: the PS's rendezvous port
    (default: a free one); ``device``: the PS's device kind (default: CUDA where present)."""

    def __init__(self, endpoint: str = "http://127.0.0.1:8000", *, uds: str | None = None, stage: bool = False,
                 timeout_s: float = 600.0, pause_mode: str = "keep", ready_timeout_s: float = 300.0,
                 master_port: int | None = None, device: str | None = None):
        if pause_mode not in PAUSE_MODES:
            raise ConfigError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        self.endpoint, self.uds, self.stage = endpoint, uds, bool(stage)
        self.timeout_s, self.pause_mode, self.ready_timeout_s = float(timeout_s), pause_mode, float(ready_timeout_s)
        self.master_port, self.device = master_port, device
        self.client: VllmSyncClient | None = None
        self.engine: CkptTrainerWeightTransferEngine | None = None
        self.seconds: dict[str, float] = {}   # the last sync's phases, as this side saw them
        self._closed = False
        self._paused = False

    def init_weight_transfer(self) -> None:
        """Wait for the server, then start the parameter server (a world of one rank)."""
        if self._closed:
            raise ClosedError("this CkptWeightTransfer was destroyed")
        if self.engine is not None:
            return
        self.client = VllmSyncClient(self.endpoint, uds=self.uds, timeout=self.timeout_s)
        self.client.http.wait_ready(timeout=self.ready_timeout_s)
        info = CkptTrainerInitInfo(rank=0, world_size=1, timeout_s=self.timeout_s, stage=self.stage,
                                   commit_pause=self.pause_mode, device=self.device, master_addr="127.0.0.1",
                                   master_port=self.master_port or _free_port())
        self.engine = CkptTrainerWeightTransferEngine.trainer_init(info, client=self.client)

    def pause(self) -> None:
        """Plain mode: the server stops generating (``pause_mode``). Staged: nothing yet, the
        server keeps generating while the weights are staged; ``resume()`` pauses for the commit."""
        engine = self._engine()
        if not self.stage:
            t0 = time.perf_counter()
            self._paused = True
            engine.client.http.pause(self.pause_mode)
            self.seconds = {"pause": time.perf_counter() - t0}

    def send_weights(self, iterator) -> None:
        """Push ``(name, tensor)`` pairs (the whole model, TRL's ``_streaming_iter``) through the PS."""
        engine = self._engine()
        t0 = time.perf_counter()
        weights = list(iterator)
        if self.stage:
            engine.stage_weights(weights)
        else:
            engine.send_weights(weights)
        self.seconds["stage" if self.stage else "update"] = time.perf_counter() - t0

    def resume(self) -> None:
        """Plain mode: the server generates again. Staged: commit (the only pause), then resume."""
        engine = self._engine()
        t0 = time.perf_counter()
        if self.stage:
            report = engine.commit_weights()
            self.seconds["paused"] = report.seconds.get("paused", 0.0) if report is not None else 0.0
        elif self._paused:
            self._paused = False
            engine.client.http.resume()
        self.seconds["resume"] = time.perf_counter() - t0

    def destroy(self) -> None:
        """Resume a server left paused, close the parameter server and the HTTP client. Idempotent."""
        if self._closed:
            return
        self._closed = True
        engine, client, self.engine, self.client = self.engine, self.client, None, None
        try:
            if self._paused and client is not None:
                client.http.resume()
        except Exception as exc:   # noqa: BLE001 - destroy must release the rest anyway
            log.warning("destroy: resuming the server failed: %s: %s", type(exc).__name__, exc)
        finally:
            if engine is not None:
                engine.shutdown()
            if client is not None:
                client.close()

    def _engine(self) -> CkptTrainerWeightTransferEngine:
        if self._closed:
            raise ClosedError("this CkptWeightTransfer was destroyed")
        if self.engine is None:
            raise ConfigError("call init_weight_transfer() first (AsyncGRPOTrainer does, at train begin)")
        return self.engine


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
