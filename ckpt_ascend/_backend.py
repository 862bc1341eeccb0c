"""The ``npu`` device kind: torch_npu device calls, HCCL collectives, NPU IPC buffers.

Registered through the ``ckpt_core.devices`` entry point (pyproject.toml), so the
core has no NPU branch. ``torch_npu`` is imported on first use, never at import
time: loading the entry point must stay cheap and harmless on hosts without it.

IPC: torch_npu shares an NPU buffer like CUDA does; ``reduce_tensor`` yields
``(rebuild_npu_tensor, args)`` where ``args[6]`` is the device index. The PS sends
the plain fields of ``args`` as JSON (bytes in base64, classes by allow-listed
name: no pickle crosses the wire) and the worker calls ``rebuild_npu_tensor`` with
its own device index at argument 6.

Host memory: NPU memory cannot be pinned in place (no ``cudaHostRegister``
counterpart), so host buffers are allocated pinned (``pin_memory=True``) and filled
by copying; ``pins_in_place = False`` makes the core copy in-place ``/dev/shm``
checkpoints into pinned memory too (logged) instead of mapping them pageable.
"""

from __future__ import annotations

import base64
import gc
import importlib
import importlib.util
import logging
import threading
from typing import Any

import torch

from ckpt_core.devices import DeviceBackend, HostPin, IpcBuffer
from ckpt_core.errors import ConfigError, TransportError

from . import _npusmi

__all__ = ["NpuBackend"]

log = logging.getLogger("ckpt_ascend")

_B64_FIELDS = ("handle", "ref_counter_handle", "event_handle")
_STORAGE_CLASSES = {"TypedStorage": lambda: torch.storage.TypedStorage, "UntypedStorage": lambda: torch.UntypedStorage}
_REBUILD = "torch_npu.multiprocessing.reductions"


def _torch_npu():
    """Import torch_npu (registers torch.npu, the ``npu`` device type and the ``hccl`` backend)."""
    try:
        return importlib.import_module("torch_npu")
    except Exception as exc:   # CANN missing or mismatched: torch_npu raises all kinds of errors
        raise ConfigError(f"the npu device kind needs torch_npu (CANN >= 8.3.RC1), which failed to import: "
                          f"{type(exc).__name__}: {exc}") from exc


def _rebuild_npu_tensor():
    return importlib.import_module(_REBUILD).rebuild_npu_tensor


class NpuBackend(DeviceBackend):
    """Ascend NPUs through torch_npu; the entry point ``npu = ckpt_ascend:NpuBackend``."""

    kind = "npu"
    collective_backend = "hccl"
    pins_host_memory = True
    pins_in_place = False   # the core copies /dev/shm files into pinned memory instead
    # Mooncake transport for P2P (issue 11, not landed): the P2P store should read this rather
    # than name device kinds. ascend_direct needs no RDMA NIC list. See docs/ascend.md.
    p2p_transport = "ascend_direct"

    def __init__(self):
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def _warn_once(self, what: str, msg: str, *args) -> None:
        with self._lock:
            if what in self._warned:
                return
            self._warned.add(what)
        log.warning(msg, *args)

    # -- the device ----------------------------------------------------------
    def is_available(self) -> bool:
        if importlib.util.find_spec("torch_npu") is None:
            return False
        try:
            _torch_npu()
            return bool(torch.npu.is_available())
        except Exception as exc:   # a broken install must not hide the built-in kinds
            log.warning("torch_npu is installed but unusable, the npu kind is off: %s", exc)
            return False

    def device(self, index: int) -> torch.device:
        return torch.device("npu", index)

    def set_device(self, index: int) -> None:
        _torch_npu()
        try:
            torch.npu.set_device(index)
        except RuntimeError as exc:
            raise ConfigError(f"cannot use npu:{index} ({_npusmi.VISIBLE_ENV}="
                              f"{_npusmi.visible_devices()}): {exc}") from exc

    def synchronize(self, index: int) -> None:
        torch.npu.synchronize(index)

    def mem_get_info(self, index: int) -> tuple[int, int]:
        free, total = torch.npu.mem_get_info(index)
        return int(free), int(total)

    def device_key(self, index: int) -> str:
        """``NPU-{ip}-{chip}``, from npu-smi for this process (see ``ckpt_ascend._npusmi``)."""
        return _npusmi.device_key(index)

    # -- host memory ----------------------------------------------------------
    def empty_host(self, nbytes: int) -> torch.Tensor:
        """Pinned host memory from torch_npu's host allocator; pageable (logged) if that fails."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except (RuntimeError, NotImplementedError) as exc:
            self._warn_once("alloc", "npu: cannot allocate pinned host memory (%s); host buffers are pageable, "
                            "host-to-device copies will be several times slower", exc)
            return super().empty_host(nbytes)

    def pin(self, tensor: torch.Tensor) -> HostPin:
        """No in-place registration on NPU: pinned memory is already pinned, anything else stays pageable."""
        if tensor.numel() == 0 or tensor.is_pinned() or "alloc" in self._warned:
            return HostPin()   # (after a failed pinned allocation everything is pageable: said once already)
        self._warn_once("pin", "npu: existing host memory cannot be pinned in place (%d bytes at %#x stay "
                        "pageable); register /dev/shm checkpoints with use_inplace_pin_memory=False to copy "
                        "them into pinned memory", tensor.numel() * tensor.element_size(), tensor.data_ptr())
        return HostPin()

    # -- the IPC buffer ---------------------------------------------------------
    def alloc_ipc(self, nbytes: int, index: int, name: str) -> IpcBuffer:
        from torch.multiprocessing.reductions import reduce_tensor  # torch_npu replaces it on import

        _torch_npu()
        try:
            tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device(index))
        except RuntimeError as exc:
            raise TransportError(f"cannot allocate a {nbytes}-byte IPC buffer on npu:{index}: {exc}") from exc
        fn, args = reduce_tensor(tensor)
        if fn is not _rebuild_npu_tensor():
            raise TransportError(f"torch_npu did not export the npu:{index} buffer for IPC "
                                 f"(reduce_tensor gave {getattr(fn, '__qualname__', fn)!r})")
        storage_cls = args[4].__name__
        if storage_cls not in _STORAGE_CLASSES or args[5] != torch.uint8:
            raise TransportError(f"unexpected NPU IPC export: storage {storage_cls}, dtype {args[5]}")
        desc = {
            "kind": "npu", "nbytes": nbytes, "storage_class": storage_cls, "storage_offset": int(args[9]),
            "storage_size": int(args[8]), "handle": args[7], "ref_counter_handle": args[11],
            "ref_counter_offset": int(args[12]), "event_handle": args[13], "event_sync_required": bool(args[14]),
        }
        for key in _B64_FIELDS:
            desc[key] = base64.b64encode(desc[key] or b"").decode("ascii")
        return IpcBuffer(tensor, desc)

    def open_ipc(self, descriptor: dict[str, Any], index: int):
        """Rebuild the PS's buffer on this process's ``npu:index`` (argument 6 of ``rebuild_npu_tensor``)."""
        _torch_npu()
        try:
            raw = {k: base64.b64decode(descriptor[k], validate=True) for k in _B64_FIELDS}
            nbytes = int(descriptor["nbytes"])
            args = (torch.Tensor, (nbytes,), (1,), 0, _STORAGE_CLASSES[descriptor["storage_class"]](),
                    torch.uint8, int(index), raw["handle"], int(descriptor["storage_size"]),
                    int(descriptor["storage_offset"]), False, raw["ref_counter_handle"],
                    int(descriptor["ref_counter_offset"]), raw["event_handle"] or None,
                    bool(descriptor["event_sync_required"]))
        except (KeyError, ValueError, TypeError) as exc:
            raise TransportError(f"malformed NPU IPC descriptor: {type(exc).__name__}: {exc}") from exc
        try:
            tensor = _rebuild_npu_tensor()(*args)
        except RuntimeError as exc:
            raise TransportError(f"cannot map the NPU IPC buffer on npu:{index}: {exc}") from exc
        if tensor.numel() != nbytes:
            raise TransportError(f"the NPU IPC buffer mapped on npu:{index} has {tensor.numel()} bytes, "
                                 f"the PS announced {nbytes}")
        return tensor, None

    # -- streams, events, caches -----------------------------------------------
    def new_stream(self, index: int):
        return torch.npu.Stream(device=index)

    def stream_context(self, stream):
        return torch.npu.stream(stream)

    def new_event(self):
        return torch.npu.Event()

    def empty_cache(self) -> None:
        # Buffers are returned to torch_npu's caches only once no Python object holds them.
        gc.collect()
        torch.npu.empty_cache()
