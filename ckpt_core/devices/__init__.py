"""Device backends: one small interface, one file per device kind.

A backend knows its collective library, how to pin host memory, how to export
an IPC buffer to a colocated engine worker and how that worker maps it back.
Kinds shipped here: ``cpu`` and ``cuda``. Other packages add kinds through the
entry-point group ``ckpt_core.devices`` (name = kind, value = a zero-argument
callable returning a :class:`DeviceBackend`), e.g. ``ckpt_ascend`` adds ``npu``.
"""

from __future__ import annotations

import threading
from importlib.metadata import entry_points
from typing import Callable

from ckpt_core.errors import ConfigError

from ._base import DeviceBackend, HostPin, IpcBuffer, NullEvent, NullStream

__all__ = [
    "DeviceBackend", "HostPin", "IpcBuffer", "NullEvent", "NullStream",
    "register_backend", "get_backend", "available_kinds", "default_kind", "local_device_key",
]

ENTRY_POINT_GROUP = "ckpt_core.devices"

_factories: dict[str, Callable[[], DeviceBackend]] = {}
_instances: dict[str, DeviceBackend] = {}
_lock = threading.Lock()
_entry_points_loaded = False


def _builtin_cpu() -> DeviceBackend:
    from .cpu import CpuBackend
    return CpuBackend()


def _builtin_cuda() -> DeviceBackend:
    from .cuda import CudaBackend
    return CudaBackend()


_factories.update(cpu=_builtin_cpu, cuda=_builtin_cuda)


def register_backend(kind: str, factory: Callable[[], DeviceBackend]) -> None:
    """Add (or replace) a device kind. Used by plugins and by tests' fakes."""
    with _lock:
        _factories[kind] = factory
        _instances.pop(kind, None)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _factories:
            _factories[ep.name] = ep.load()


def available_kinds() -> list[str]:
    with _lock:
        _load_entry_points()
        return sorted(_factories)


def get_backend(kind: str) -> DeviceBackend:
    """The process-wide backend instance of ``kind``; raises ConfigError for unknown kinds."""
    with _lock:
        _load_entry_points()
        if kind not in _instances:
            if kind not in _factories:
                raise ConfigError(f"unknown device kind {kind!r}; known kinds: {sorted(_factories)}")
            backend = _factories[kind]()
            if backend.kind != kind:
                raise ConfigError(f"device backend registered as {kind!r} reports kind {backend.kind!r}")
            _instances[kind] = backend
        return _instances[kind]


def default_kind() -> str:
    """The best kind present on this machine: any plugin kind that is available, else cuda, else cpu."""
    for kind in available_kinds():
        if kind in ("cpu", "cuda"):
            continue
        try:
            if get_backend(kind).is_available():
                return kind
        except Exception:  # a broken plugin must not stop the built-in kinds
            continue
    return "cuda" if get_backend("cuda").is_available() else "cpu"


def local_device_key(kind: str, index: int) -> str:
    """The identity key of device ``index`` of ``kind`` on this host.

    The PS rank publishes it as ``device_uuid`` and the engine worker beside it
    computes the same key to find its own ZeroMQ handle.
    """
    return get_backend(kind).device_key(index)
