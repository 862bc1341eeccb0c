"""FAKE ``torch_npu.npu`` device module (see ``torch_npu`` in this folder): NPU calls mapped onto the CPU."""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import weakref

import torch

import npu_board  # the fakes share one board (tests/fakes is on sys.path)

_current = 0
_seq = itertools.count()
allocations: dict[int, tuple[str, int, int]] = {}   # data_ptr -> (file, nbytes, physical chip)


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    pass


def _is_in_bad_fork() -> bool:
    return False


def manual_seed_all(seed: int) -> None:
    pass


def device_count() -> int:
    return len(npu_board.visible())


def current_device() -> int:
    return _current


def set_device(device) -> None:
    """Like aclrtSetDevice: opens the chip, after which npu-smi lists this process on it."""
    global _current
    index = torch.device(device).index if not isinstance(device, int) else device
    npu_board.record_open(os.getpid(), npu_board.physical(index))
    _current = index


def synchronize(device=None) -> None:
    if device is not None:
        npu_board.physical(device if isinstance(device, int) else torch.device(device).index)


def mem_get_info(device=None) -> tuple[int, int]:
    npu_board.physical(_current if device is None else device)
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def empty_cache() -> None:
    pass


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class Stream:
    def __init__(self, device=None, priority: int = 0):
        self.device_index = _current if device is None else device
        npu_board.physical(self.device_index)

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def stream(s):
    yield s


def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """``aten::empty`` for device ``npu``: CPU memory in a /dev/shm file another process can map."""
    index = _current if device is None or device.index is None else device.index
    chip = npu_board.physical(index)
    dtype = dtype or torch.get_default_dtype()
    numel = 1
    for n in size:
        numel *= n
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.empty(size, dtype=dtype)
    path = f"/dev/shm/fake-npu-{os.getpid()}-{next(_seq)}-c{chip}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    weakref.finalize(mm, _unlink, path)
    tensor = torch.frombuffer(mm, dtype=torch.uint8).view(dtype).reshape(size)
    allocations[tensor.data_ptr()] = (path, nbytes, chip)
    return tensor


def _unlink(path: str) -> None:
    for ptr, entry in list(allocations.items()):
        if entry[0] == path:
            del allocations[ptr]
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
