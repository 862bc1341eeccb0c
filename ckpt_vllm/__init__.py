"""vLLM adapter of ckpt-engine: worker extension, ``ckpt`` weight-transfer backend, requester.

Serve with ``--worker-extension-cls ckpt_vllm.VllmColocateWorkerExtension`` and
``VLLM_SERVER_DEV_MODE=1``; push with a :class:`ckpt_core.ParameterServer` whose ``req_func``
is :meth:`VllmClient.req_func`::

    client = VllmClient("http://127.0.0.1:8000")
    client.wait_ready(timeout=300)
    ps.update("step-7", client.req_func(rank=ps.rank))   # req_func runs on every rank; rank 0 posts

Importing this package does not import vLLM (the requester runs in the trainer's environment).
"""

from __future__ import annotations

from .client import UpdateReport, VllmClient
from .worker import VllmColocateWorkerExtension

__all__ = ["VllmColocateWorkerExtension", "VllmClient", "UpdateReport"]
