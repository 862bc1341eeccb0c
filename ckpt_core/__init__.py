"""ckpt-engine's transfer core: parameter-server ranks that stream checkpoints into inference engines.

Public API (names kept from MoonshotAI's checkpoint-engine)::

    from ckpt_core import ParameterServer, update_weights_from_ipc, request_inference_to_update

The names that need torch are imported on first use (PEP 562), so that ``import ckpt_core``, the
error classes and ``ckpt-engine --help`` / ``--version`` do not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt_core import errors
from ckpt_core.errors import *  # noqa: F401,F403  (the whole hierarchy is public; its names live in errors.__all__)
from ckpt_core.ops.lazy import lazy_exports

__version__ = "0.1.0"

# public name -> the module that defines it (imported when the name is first read)
_LAZY = {
    "ParameterServer": "ckpt_core._ps",
    "update_weights_from_ipc": "ckpt_core.wire.worker",
    "request_inference_to_update": "ckpt_core.engines.requests",
    "split_checkpoint_files": "ckpt_core.checkpoint.sources",
    "TensorShard": "ckpt_core.checkpoint.shards",
    "local_device_key": "ckpt_core.devices",
}

if TYPE_CHECKING:   # what type checkers and IDEs see: the eager imports
    from ckpt_core._ps import ParameterServer
    from ckpt_core.checkpoint.shards import TensorShard
    from ckpt_core.checkpoint.sources import split_checkpoint_files
    from ckpt_core.devices import local_device_key
    from ckpt_core.engines.requests import request_inference_to_update
    from ckpt_core.wire.worker import update_weights_from_ipc

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


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
