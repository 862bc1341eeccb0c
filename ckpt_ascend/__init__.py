"""Ascend NPU support: the ``npu`` device backend for ckpt_core, used under vllm-ascend.

The backend plugs into the core through the ``ckpt_core.devices`` entry point
(``npu = ckpt_ascend:NpuBackend`` in pyproject.toml); nothing in ckpt_core names
the NPU. Importing this package does not import torch_npu. See docs/ascend.md.
"""

from ._backend import NpuBackend
from ._npusmi import device_key as npu_device_key

__all__ = ["NpuBackend", "npu_device_key"]
