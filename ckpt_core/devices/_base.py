"""The device-backend interface and the small no-op helpers host-only kinds use."""

from __future__ import annotations

import itertools
import mmap
from abc import ABC, abstractmethod
from contextlib import nullcontext
from typing import Any, ContextManager

import torch

# Successive host buffers start at one of HOST_COLORS offsets into their mappings, HOST_COLOR_PAGES pages
# apart, in turn: two versions of a checkpoint (a delta's base and new version) compared word by word
# whose buffers lay a multiple of 1 GiB apart (mmap placed them so) were compared 1.8x slower on the
# 2-core CPU machine (854 MB of bf16 at 2 %: 297-306 ms against 167-209 ms for the same bytes one page or
# more off that distance). The unused pages before a buffer are never touched, so cost no memory.
HOST_COLORS = 8
HOST_COLOR_PAGES = 17
_colors = itertools.count(1)


class NullEvent:
    """Event stand-in for kinds whose work is synchronous on the host."""

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class NullStream:
    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


class HostPin:
    """Handle of one pinned host range; ``release()`` is idempotent."""

    def __init__(self, release=None):
        self._release = release

    def release(self) -> None:
        fn, self._release = self._release, None
        if fn is not None:
            fn()


class IpcBuffer:
    """A device buffer the PS rank owns and a colocated worker maps.

    ``tensor`` is a flat uint8 tensor; ``descriptor`` is a JSON-able dict that
    the backend's ``open_ipc`` turns back into a tensor in the worker process.
    """

    def __init__(self, tensor: torch.Tensor, descriptor: dict[str, Any], close=None):
        self.tensor = tensor
        self.descriptor = descriptor
        self._close = close

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def close(self) -> None:
        fn, self._close = self._close, None
        self.tensor = None
        if fn is not None:
            fn()


class DeviceBackend(ABC):
    """What the transfer core needs to know about one kind of device."""

    kind: str = ""
    collective_backend: str = ""   # torch.distributed backend name for the data plane
    pins_host_memory: bool = False  # whether host buffers should be pinned for fast copies
    # whether existing host memory (an in-place /dev/shm file) can be pinned where it lies (CUDA's
    # cudaHostRegister); a kind that pins but cannot do that (npu) gets such files copied into
    # pinned memory instead
    pins_in_place: bool = True

    @abstractmethod
    def is_available(self) -> bool: ...

    @abstractmethod
    def device(self, index: int) -> torch.device: ...

    def set_device(self, index: int) -> None:
        pass

    def synchronize(self, index: int) -> None:
        pass

    @abstractmethod
    def mem_get_info(self, index: int) -> tuple[int, int]:
        """(free, total) bytes of device memory."""

    @abstractmethod
    def device_key(self, index: int) -> str: ...

    def pin(self, tensor: torch.Tensor) -> HostPin:
        """Pin an existing contiguous host tensor in place (no copy)."""
        return HostPin()

    def empty_host(self, nbytes: int) -> torch.Tensor:
        """A pageable, page-aligned host uint8 buffer; callers fill it, then ``pin()`` it in pieces.

        Pageable allocation + cudaHostRegister is ~10x faster than allocating pinned
        memory (pin_memory=True) on the GPU hosts we measured. Page alignment lets
        adjacent pieces be pinned separately (two registrations may not share a page).
        The mapping is unmapped when the last tensor viewing it is freed. Successive
        buffers start at different offsets into their mappings (``HOST_COLORS``).
        """
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        step = HOST_COLOR_PAGES * mmap.PAGESIZE
        mm = mmap.mmap(-1, nbytes + HOST_COLORS * step, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return torch.frombuffer(mm, dtype=torch.uint8, offset=(next(_colors) % HOST_COLORS) * step, count=nbytes)

    @abstractmethod
    def alloc_ipc(self, nbytes: int, index: int, name: str) -> IpcBuffer: ...

    @abstractmethod
    def open_ipc(self, descriptor: dict[str, Any], index: int) -> tuple[torch.Tensor, Any]:
        """Map a buffer exported by ``alloc_ipc``; returns (uint8 tensor, a closer object or None)."""

    def copy_pitched(self, dst: torch.Tensor, host: torch.Tensor, copies) -> None:
        """Issue ``copies`` (``planning.boxcopy.Pitched``: rows of the flat uint8 host tensor
        ``host``, placed into the flat uint8 device tensor ``dst``) on the current stream: one strided
        copy each, of its ``depth`` blocks of rows at once."""
        for c in copies:
            src = host.as_strided((c.depth, c.height, c.width), (c.step, c.pitch or c.width, 1),
                                  host.storage_offset() + c.src)
            dst.as_strided((c.depth, c.height, c.width), (c.dstep, c.dpitch or c.width, 1),
                           dst.storage_offset() + c.dst).copy_(src, non_blocking=True)

    def new_stream(self, index: int):
        return NullStream()

    def stream_context(self, stream) -> ContextManager:
        return nullcontext()

    def new_event(self):
        return NullEvent()

    def empty_cache(self) -> None:
        pass
