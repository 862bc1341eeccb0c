"""ckpt-engine's transfer core: parameter-server ranks that stream checkpoints into inference engines.

Public API (names kept from MoonshotAI's checkpoint-engine)::

    from ckpt_core import ParameterServer, update_weights_from_ipc, request_inference_to_update
"""

from ckpt_core.checkpoint.sources import split_checkpoint_files
from ckpt_core.checkpoint.shards import TensorShard
from ckpt_core._ps import ParameterServer
from ckpt_core.engines.requests import request_inference_to_update
from ckpt_core.wire.worker import update_weights_from_ipc
from ckpt_core.devices import local_device_key
from ckpt_core import errors
from ckpt_core.errors import *  # noqa: F401,F403  (the whole hierarchy is public; its names live in errors.__all__)

__version__ = "0.1.0"

__all__ = [
    "ParameterServer",
    "update_weights_from_ipc",
    "request_inference_to_update",
    "split_checkpoint_files",
    "TensorShard",
    "local_device_key",
    *errors.__all__,
    "__version__",
]
