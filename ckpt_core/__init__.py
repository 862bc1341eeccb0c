"""ckpt-engine's transfer core: parameter-server ranks that stream checkpoints into inference engines.

Public API (names kept from MoonshotAI's checkpoint-engine)::

    from ckpt_core import ParameterServer, update_weights_from_ipc, request_inference_to_update
"""

from ._checkpoint import split_checkpoint_files
from ._ps import ParameterServer
from ._requests import request_inference_to_update
from ._worker import update_weights_from_ipc
from .devices import local_device_key
from . import errors
from .errors import *  # noqa: F401,F403  (the whole hierarchy is public; its names live in errors.__all__)

__version__ = "0.1.0"

__all__ = [
    "ParameterServer",
    "update_weights_from_ipc",
    "request_inference_to_update",
    "split_checkpoint_files",
    "local_device_key",
    *errors.__all__,
    "__version__",
]
