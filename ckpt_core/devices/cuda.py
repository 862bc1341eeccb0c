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
import ctypes
import logging
import os
import weakref
from typing import Any

import torch

from ckpt_core.errors import TransportError

from ._base import DeviceBackend, HostPin, IpcBuffer

log = logging.getLogger("ckpt_core.devices")

_B64_FIELDS = ("handle", "ref_counter_handle", "event_handle")
# handle (base64) -> the exported buffer, for workers in the exporting process; weak: the PS owns it
_EXPORTED: "weakref.WeakValueDictionary[str, torch.Tensor]" = weakref.WeakValueDictionary()
_MAX_PITCH = (1 << 31) - 1   # cuMemcpy2D's pitch limit (CU_DEVICE_ATTRIBUTE_MAX_PITCH on every GPU we know)
_MEMORYTYPE_HOST, _MEMORYTYPE_DEVICE = 1, 2


class _Memcpy2D(ctypes.Structure):
    """The driver API's CUDA_MEMCPY2D (cuda.h)."""
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t), ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
                ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64),
                ("dstArray", ctypes.c_void_p), ("dstPitch", ctypes.c_size_t), ("WidthInBytes", ctypes.c_size_t),
                ("Height", ctypes.c_size_t)]


class _Memcpy3D(ctypes.Structure):
    """The driver API's CUDA_MEMCPY3D (cuda.h): blocks of pitched rows, each ``srcHeight`` rows after the
    one before in the source and ``dstHeight`` rows in the destination."""
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcZ", ctypes.c_size_t),
                ("srcLOD", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int), ("srcHost", ctypes.c_void_p),
                ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p), ("reserved0", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t), ("srcHeight", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstZ", ctypes.c_size_t),
                ("dstLOD", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p),
                ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p), ("reserved1", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t), ("dstHeight", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t), ("Depth", ctypes.c_size_t)]


def block_heights(c) -> tuple[int, int] | None:
    """``(srcHeight, dstHeight)`` when the copy of ``depth`` blocks is one ``cuMemcpy3DAsync``: each block
    starts a whole number of rows after the one before, in the source (``step``) and in the destination
    (``dstep``), at least ``height`` rows on, with both pitches in the driver's range; else None (one 2-D
    copy per block)."""
    dpitch = c.dpitch or c.width
    if (c.depth < 2 or c.height < 2 or not 0 < c.pitch <= _MAX_PITCH or dpitch > _MAX_PITCH
            or c.step % c.pitch or c.dstep % dpitch):
        return None
    src_h, dst_h = c.step // c.pitch, c.dstep // dpitch
    return (src_h, dst_h) if src_h >= c.height and dst_h >= c.height else None


class _Driver:
    """The few driver-API calls torch does not expose, from the driver library the CUDA runtime
    already loaded (``libcuda.so.1``), on the calling thread's current (primary) context."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self.copy2d = lib.cuMemcpy2DAsync_v2
        self.copy2d.argtypes, self.copy2d.restype = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p], ctypes.c_int
        self.copy3d = lib.cuMemcpy3DAsync_v2
        self.copy3d.argtypes, self.copy3d.restype = [ctypes.POINTER(_Memcpy3D), ctypes.c_void_p], ctypes.c_int
        self.htod = lib.cuMemcpyHtoDAsync_v2
        self.htod.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.htod.restype = ctypes.c_int
        self._name = lib.cuGetErrorName
        self._name.argtypes, self._name.restype = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)], ctypes.c_int

    def error_name(self, err: int) -> str:
        text = ctypes.c_char_p()
        self._name(err, ctypes.byref(text))
        return f"{(text.value or b'CUDA_ERROR_?').decode()} ({err})"


_DRIVER: list[_Driver] = []


def _driver() -> _Driver:
    if not _DRIVER:
        _DRIVER.append(_Driver())
    return _DRIVER[0]


def _copy2d(drv: _Driver, base: int, out: int, c, stream) -> int:
    """One block of ``c``'s rows: a run by ``cuMemcpyHtoDAsync``, rows by ``cuMemcpy2DAsync`` (row by
    row where a pitch is past the driver's range); the driver's error code."""
    dpitch = c.dpitch or c.width   # 0: rows back to back
    if c.height == 1:
        return drv.htod(out + c.dst, base + c.src, c.width, stream)
    if c.pitch > _MAX_PITCH or dpitch > _MAX_PITCH:
        err = 0
        for r in range(c.height):
            err = err or drv.htod(out + c.dst + r * dpitch, base + c.src + r * c.pitch, c.width, stream)
        return err
    desc = _Memcpy2D(srcMemoryType=_MEMORYTYPE_HOST, srcHost=base + c.src, srcPitch=c.pitch,
                     dstMemoryType=_MEMORYTYPE_DEVICE, dstDevice=out + c.dst, dstPitch=dpitch,
                     WidthInBytes=c.width, Height=c.height)
    return drv.copy2d(ctypes.byref(desc), stream)


def _refused_3d(drv: _Driver, err: int, c) -> None:
    """The driver refused a 3-D copy (say, a host range it checks past the last block's rows): logged
    once, and the caller copies the blocks one by one (a 2-D refusal then raises)."""
    if not _REFUSED_3D:
        _REFUSED_3D.append(err)
        log.warning("cuMemcpy3DAsync refused a stack of %d blocks of %d rows of %d bytes (pitch %d): %s; such "
                    "stacks are copied block by block", c.depth, c.height, c.width, c.pitch, drv.error_name(err))


_REFUSED_3D: list[int] = []


def _check(drv: _Driver, err: int, c) -> None:
    if err:
        raise TransportError(f"a host-to-device copy of {c.depth} block(s) of {c.height} row(s) of {c.width} "
                             f"bytes (pitch {c.pitch}, destination pitch {c.dpitch or c.width}) failed: "
                             f"{drv.error_name(err)}")


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

    def copy_pitched(self, dst: torch.Tensor, host: torch.Tensor, copies) -> None:
        """Every copy straight through the driver on the current stream: a run with
        ``cuMemcpyHtoDAsync``, a block of pitched rows with ``cuMemcpy2DAsync`` (pinned rows at the
        link's rate; torch's strided ``copy_`` gathers through a pageable temporary at a tenth of
        it), a copy of ``depth`` blocks whose steps are whole rows with one ``cuMemcpy3DAsync`` (a
        layer's experts' column slices; ``block_heights``), else one 2-D copy per block. One driver
        call per copy: a slice of a small tensor costs microseconds, not a view and a dispatch. No copy
        crosses a pinned piece's border (``planning/boxcopy.py``). A source on the device (a checkpoint
        registered ``on_device``) takes the base class's strided ``copy_`` instead: a device-to-device
        copy kernel per box, on the current stream."""
        if host.is_cuda:   # a device-resident checkpoint (on_device): device-to-device copies through torch
            super().copy_pitched(dst, host, copies)
            return
        drv = _driver()
        base, out = host.data_ptr(), dst.data_ptr()
        stream = torch.cuda.current_stream().cuda_stream
        for deep in copies:
            heights = block_heights(deep)
            if heights is not None:   # a layer's experts' column slices: one driver call for the lot
                desc3 = _Memcpy3D(srcMemoryType=_MEMORYTYPE_HOST, srcHost=base + deep.src, srcPitch=deep.pitch,
                                  srcHeight=heights[0], dstMemoryType=_MEMORYTYPE_DEVICE, dstDevice=out + deep.dst,
                                  dstPitch=deep.dpitch or deep.width, dstHeight=heights[1],
                                  WidthInBytes=deep.width, Height=deep.height, Depth=deep.depth)
                err = drv.copy3d(ctypes.byref(desc3), stream)
                if not err:
                    continue
                _refused_3d(drv, err, deep)   # nothing was queued: the blocks one by one, as below
            for c in deep.layers():   # a copy of blocks at other steps: one 2-D copy each
                _check(drv, _copy2d(drv, base, out, c, stream), c)

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
