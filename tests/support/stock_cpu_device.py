"""The stock worker's DeviceManager, for a CPU buffer (no dependencies: imported in any venv).

Stock checkpoint-engine's ``DeviceManager()`` raises ``TypeError: The current device type is
not supported`` on a machine without a GPU or NPU, although its worker loop only calls
``synchronize``, ``ipc_collect`` and ``empty_cache`` on it. This stand-in supplies those as
no-ops; everything else the stock worker does (unpickling the frames, rebuilding the buffer,
slicing the tensors, its state machine and replies) runs unchanged.
"""

from __future__ import annotations


class _CpuDeviceModule:
    @staticmethod
    def synchronize(*_a) -> None:
        pass

    @staticmethod
    def ipc_collect() -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


class CpuDeviceManager:
    device_type = "cpu"
    device_module = _CpuDeviceModule


def install(stock_worker_module) -> None:
    """Make ``checkpoint_engine.worker`` build the CPU stand-in instead of its DeviceManager."""
    stock_worker_module.DeviceManager = CpuDeviceManager
