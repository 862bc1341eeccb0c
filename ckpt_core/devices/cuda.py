"""The ``cuda`` kind: NCCL collectives, pinned host memory and CUDA IPC buffers.

The IPC descriptor carries the fields of ``UntypedStorage._share_cuda_()`` as
plain JSON (bytes in base64), so no pickle crosses the wire; the worker maps it
onto its own device index.

CUDA cannot open an IPC handle in the process that exported it, so a worker that runs in the
PS's own process (an offline engine colocated with the trainer) gets the exporting tensor back
from a process-local table instead; the descriptor carries the exporter's pid to tell.
"""

from __future__ import annotations

import base64
import os
import weakref
from typing import Any

import torch

from ckpt_core.errors import TransportError
from ._base import DeviceBackend, HostPin, IpcBuffer

_B64_FIELDS = ("handle", "ref_counter_handle", "event_handle")
# handle (base64) -> the exported buffer, for workers in the exporting process; weak: the PS owns it
_EXPORTED: "weakref.WeakValueDictionary[str, torch.Tensor]" = weakref.WeakValueDictionary()


class CudaBackend(DeviceBackend):
    kind = "cuda"
    collective_backend = "nccl"
    pins_host_memory = True

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device(self, index: int) -> torch.device:
        return torch.device("cuda", index)

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def synchronize(self, index: int) -> None:
        torch.cuda.synchronize(index)

    def mem_get_info(self, index: int) -> tuple[int, int]:
        return torch.cuda.mem_get_info(index)

    def device_key(self, index: int) -> str:
        return f"GPU-{torch.cuda.get_device_properties(index).uuid}"

    def pin(self, tensor: torch.Tensor) -> HostPin:
        # is_pinned() answers for the tensor's whole storage (its first byte), not for this
        # view: a later piece of a region whose first piece is pinned would be skipped.
        if tensor.numel() == 0 or (tensor.storage_offset() == 0 and tensor.is_pinned()):
            return HostPin()
        if not tensor.is_contiguous():
            raise TransportError("only contiguous host tensors can be pinned in place")
        cudart = torch.cuda.cudart()
        ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        err = int(cudart.cudaHostRegister(ptr, size, 0))
        if err != 0:
            raise TransportError(f"cudaHostRegister of {size} bytes failed with CUDA error {err}")

        def release() -> None:
            cudart.cudaHostUnregister(ptr)

        return HostPin(release)

    def alloc_ipc(self, nbytes: int, index: int, name: str) -> IpcBuffer:
        try:
            tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device(index))
        except torch.OutOfMemoryError as exc:
            raise TransportError(f"cannot allocate a {nbytes}-byte IPC buffer on cuda:{index}: {exc}") from exc
        storage = tensor.untyped_storage()
        (_dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = storage._share_cuda_()
        desc = {
            "kind": "cuda", "nbytes": nbytes, "storage_size": int(size), "storage_offset": int(offset),
            "handle": handle, "ref_counter_handle": rc_handle, "ref_counter_offset": int(rc_offset),
            "event_handle": ev_handle, "event_sync_required": bool(ev_sync),
        }
        for key in _B64_FIELDS:
            desc[key] = base64.b64encode(desc[key] or b"").decode("ascii")
        desc["pid"] = os.getpid()
        _EXPORTED[desc["handle"]] = tensor
        return IpcBuffer(tensor, desc)

    def open_ipc(self, descriptor: dict[str, Any], index: int):
        own = _EXPORTED.get(descriptor.get("handle", "")) if descriptor.get("pid") == os.getpid() else None
        if own is not None:
            if own.device.index != index or own.numel() != int(descriptor["nbytes"]):
                raise TransportError(f"the IPC buffer exported by this process lies on cuda:{own.device.index} "
                                     f"({own.numel()} bytes), not on cuda:{index} ({descriptor['nbytes']} bytes)")
            return own, None
        try:
            raw = {k: base64.b64decode(descriptor[k]) for k in _B64_FIELDS}
            storage = torch.UntypedStorage._new_shared_cuda(
                index, raw["handle"], int(descriptor["storage_size"]), int(descriptor["storage_offset"]),
                raw["ref_counter_handle"], int(descriptor["ref_counter_offset"]),
                raw["event_handle"] or None, bool(descriptor["event_sync_required"]),
            )
        except (KeyError, ValueError, RuntimeError) as exc:
            raise TransportError(f"cannot map the CUDA IPC buffer on cuda:{index}: {exc}") from exc
        tensor = torch.empty(0, dtype=torch.uint8, device=self.device(index)).set_(
            storage, 0, (int(descriptor["nbytes"]),), (1,))
        return tensor, None

    def new_stream(self, index: int):
        return torch.cuda.Stream(device=index)

    def stream_context(self, stream):
        return torch.cuda.stream(stream)

    def new_event(self):
        return torch.cuda.Event()

    def empty_cache(self) -> None:
        # Memory exported through IPC is held until its consumers let go; collect first.
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
