"""FAKE torch_npu, for tests on machines without an Ascend NPU. It is NOT torch_npu.

The real torch_npu cannot be installed here (merely installing it breaks
``import torch``), so the NPU backend is tested against this stand-in. It mimics the
real names and signatures the backend uses and maps them onto the CPU:

- like the real one, importing it renames torch's PrivateUse1 backend to ``npu``
  (``torch.device("npu", i)`` works) and registers ``torch.npu`` (= ``torch_npu.npu``);
- ``torch.empty(..., device="npu:i")`` returns CPU memory in a /dev/shm file, so
  another process can map it (the fake "device memory");
- the ``hccl`` distributed backend is gloo;
- ``torch.multiprocessing.reductions.reduce_tensor`` of a fake NPU tensor returns
  ``(torch_npu.multiprocessing.reductions.rebuild_npu_tensor, args)`` with the device
  index at ``args[6]``; the rebuild maps the file and refuses a device index whose
  physical chip (through ``ASCEND_RT_VISIBLE_DEVICES``) is not the buffer's chip;
- ``torch.npu.set_device`` records the chip in the fake board that the fake
  ``npu-smi`` reads (tests/fakes/npu_board.py).
Pinned host memory is not faked (torch offers no Python hook for it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing.reductions as _torch_reductions
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

from . import npu
from .multiprocessing import reductions as _reductions

__version__ = "0.0.0+fake"

_setup_privateuseone_for_python_backend(rename="npu", backend_module=npu)

_lib = torch.library.Library("aten", "IMPL")
_lib.impl("empty.memory_format", npu._empty, "PrivateUse1")


def _hccl_on_gloo(store, rank, world_size, timeout):
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


if "hccl" not in dist.Backend.backend_list:
    dist.Backend.register_backend("hccl", _hccl_on_gloo, devices=["cpu"])

_torch_reductions.reduce_tensor = _reductions._npu_reduce_tensor
