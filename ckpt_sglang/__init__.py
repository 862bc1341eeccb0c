"""SGLang adapter of ckpt-engine: requester and update launcher (``python -m ckpt_sglang.update``).

SGLang's engine embeds the stock checkpoint-engine worker, so the parameter server speaks the
stock wire (``ParameterServer(wire="stock")``, see ``ckpt_core.wire.stock``)::

    client = SglangClient("http://127.0.0.1:19730")
    client.wait_ready(timeout=300)            # GET /model_info
    ps = ParameterServer(wire="stock")
    ps.update("step-7", client.req_func(weight_version="7"))

Importing this package does not import SGLang (the requester runs in the trainer's environment).
"""

from __future__ import annotations

from .client import BUSY_MODES, COMMIT_PAUSE_MODES, PAUSE_MODES, SglangClient, UpdateReport

__all__ = ["SglangClient", "UpdateReport", "BUSY_MODES", "PAUSE_MODES", "COMMIT_PAUSE_MODES"]
