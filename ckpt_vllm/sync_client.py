"""vLLM's ``VLLMWeightSyncClient`` protocol over ckpt_vllm's own HTTP client (TCP or a Unix socket).

vLLM's trainer engines drive the server through four methods (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``). vLLM >= 0.26 ships an HTTP
client for them (``HTTPVLLMWeightSyncClient``, over ``requests``); this one does the same on
:class:`ckpt_vllm.VllmClient`, so it also serves Unix sockets and frameworks whose environment has
no ``requests``. Errors are ckpt_core's (``VllmClient``'s).

    client = VllmSyncClient("http://127.0.0.1:8000")          # or VllmSyncClient(uds="/run/vllm.sock")
    engine = CkptTrainerWeightTransferEngine.trainer_init(CkptTrainerInitInfo(rank=0), client=client, source=...)
"""

from __future__ import annotations

from typing import Any

from .client import VllmClient

__all__ = ["VllmSyncClient"]


class VllmSyncClient:
    """The four weight-sync routes of one vLLM server; ``base_url`` and ``http`` (the
    :class:`VllmClient`) serve the routes the protocol lacks. ``close()`` is idempotent."""

    def __init__(self, endpoint: str = "http://127.0.0.1:8000", *, uds: str | None = None, timeout: float = 600.0):
        self.http = VllmClient(endpoint, uds=uds, timeout=timeout)
        self.base_url = None if uds else self.http.endpoint   # a Unix socket: set engine_url-free routes via http

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.http._post("/init_weight_transfer_engine", {"init_info": dict(init_info)})

    def start_weight_update(self) -> None:
        self.http._post("/start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        wait = float(update_info.get("timeout_s") or self.http.timeout)
        self.http._post("/update_weights", {"update_info": dict(update_info)}, timeout=wait + 30.0)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.http._post("/finish_weight_update", None if weight_version is None else {"weight_version": weight_version})

    def close(self) -> None:
        self.http.close()
