"""vLLM plugin entry point: registers the ``ckpt`` weight-transfer backend, both sides.

Declared in pyproject.toml::

    [project.entry-points."vllm.general_plugins"]
    ckpt_engine = "ckpt_vllm.plugin:register"

vLLM calls ``register()`` in every process it starts (API server, engine core, workers), so it
must be cheap, idempotent and never fail: on a vLLM without the weight-transfer API it only logs.
It registers the engine side (``WeightTransferEngineFactory``: the workers' receiver,
:mod:`ckpt_vllm.transfer_engine`) and, where vLLM has it (0.26 and later), the trainer side
(``WeightTransferTrainerFactory``: :mod:`ckpt_vllm.trainer`). A trainer process is not one vLLM
starts: importing :mod:`ckpt_vllm.trainer` (for ``CkptTrainerInitInfo``) registers it there.
Both registrations are lazy: vLLM imports our module only when the backend is selected.
"""

from __future__ import annotations

import logging

__all__ = ["BACKEND_NAME", "register", "register_trainer"]

BACKEND_NAME = "ckpt"
log = logging.getLogger("ckpt_vllm")


def register() -> bool:
    """Register ``ckpt`` with vLLM's weight-transfer factories; True if the engine side is (now) registered."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        log.info("this vLLM has no weight-transfer API; the %r backend is not available "
                 "(the worker extension still is)", BACKEND_NAME)
        return False
    _register(WeightTransferEngineFactory, "ckpt_vllm.transfer_engine", "CkptWeightTransferEngine")
    register_trainer()
    return True


def register_trainer() -> bool:
    """Register ``ckpt`` with vLLM's ``WeightTransferTrainerFactory`` (0.26 has an earlier form of it,
    ``trainer_init(backend, config, init_info, ...)``, which works too); False where vLLM lacks it
    (call ``CkptTrainerWeightTransferEngine.trainer_init`` directly there)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError:
        log.debug("this vLLM has no WeightTransferTrainerFactory; the %r trainer engine is used directly",
                  BACKEND_NAME)
        return False
    _register(WeightTransferTrainerFactory, "ckpt_vllm.trainer", "CkptTrainerWeightTransferEngine")
    return True


def _register(factory, module: str, cls: str) -> None:
    if BACKEND_NAME in getattr(factory, "_registry", {}):
        return
    try:
        factory.register_engine(BACKEND_NAME, module, cls)
    except ValueError:  # registered concurrently (another plugin load in this process)
        pass
