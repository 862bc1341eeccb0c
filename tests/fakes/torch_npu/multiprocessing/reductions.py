"""FAKE ``torch_npu.multiprocessing.reductions``: NPU IPC export and rebuild over /dev/shm files.

Same shapes as the real module: ``_npu_reduce_tensor`` (installed as torch's
``reduce_tensor``) returns ``(rebuild_npu_tensor, args)`` with 15 args, the device
index at ``args[6]`` and the allocation's handle at ``args[7]``.
"""

from __future__ import annotations

import mmap
import os

import torch
import torch.multiprocessing.reductions as _torch_reductions

import npu_board  # the fakes share one board (tests/fakes is on sys.path)
from .. import npu

__all__ = ["rebuild_npu_tensor"]

_cpu_reduce_tensor = _torch_reductions.reduce_tensor
rebuilt_on: list[int] = []   # device indices passed at argument 6, in call order (for tests)


def _npu_reduce_tensor(tensor):
    storage = tensor.untyped_storage()
    entry = npu.allocations.get(storage.data_ptr())
    if entry is None:
        return _cpu_reduce_tensor(tensor)
    path, nbytes, chip = entry
    index = npu_board.visible().index(chip)
    return (rebuild_npu_tensor, (type(tensor), tensor.size(), tensor.stride(), tensor.storage_offset(),
                                 type(tensor._typed_storage()), tensor.dtype, index,
                                 f"{path}|{chip}".encode(), nbytes, 0, tensor.requires_grad,
                                 b"fake-ref-counter", 0, b"", False))


def rebuild_npu_tensor(tensor_cls, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype,
                       storage_device, storage_handle, storage_size_bytes, storage_offset_bytes,
                       requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
                       event_sync_required):
    rebuilt_on.append(storage_device)
    path, _, chip = storage_handle.decode().rpartition("|")
    if not path.startswith("/dev/shm/fake-npu-"):
        raise RuntimeError(f"fake NPU IPC: invalid handle {storage_handle!r}")
    mine = npu_board.physical(storage_device)
    if mine != int(chip):
        raise RuntimeError(f"fake NPU IPC: the buffer lives on chip {chip}, device index {storage_device} "
                           f"of this process is chip {mine}")
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), os.fstat(f.fileno()).st_size)
    data = torch.frombuffer(mm, dtype=torch.uint8)[storage_offset_bytes: storage_offset_bytes + storage_size_bytes]
    t = data.view(dtype).as_strided(tensor_size, tensor_stride, tensor_offset)
    t.requires_grad = requires_grad
    return t
