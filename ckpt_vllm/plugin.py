"""vLLM plugin entry point: registers the ``ckpt`` weight-transfer backend.

Declared in pyproject.toml::

    [project.entry-points."vllm.general_plugins"]
    ckpt_engine = "ckpt_vllm.plugin:register"

vLLM calls ``register()`` in every process it starts (API server, engine core, workers), so it
must be cheap, idempotent and never fail: on a vLLM without the weight-transfer API it only logs.
"""

from __future__ import annotations

import logging

__all__ = ["BACKEND_NAME", "register"]

BACKEND_NAME = "ckpt"
log = logging.getLogger("ckpt_vllm")


def register() -> bool:
    """Register ``ckpt`` with vLLM's WeightTransferEngineFactory; True if it is (now) registered."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        log.info("this vLLM has no weight-transfer API; the %r backend is not available "
                 "(the worker extension still is)", BACKEND_NAME)
        return False
    if BACKEND_NAME in getattr(WeightTransferEngineFactory, "_registry", {}):
        return True
    try:
        # Lazy: vLLM imports the module only when the backend is selected.
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, "ckpt_vllm.transfer_engine",
                                                    "CkptWeightTransferEngine")
    except ValueError:  # registered concurrently (another plugin load in this process)
        pass
    return True
