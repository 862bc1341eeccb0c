"""A worker in the PS's own process maps the PS's buffer: CUDA cannot open an IPC handle where it was exported.

An offline engine colocated with its trainer (vLLM's ``LLM`` in the trainer's process) receives
updates from a PS in the same process; ``open_ipc`` then hands back the exported tensor itself.
A worker in another process still goes through ``cudaIpcOpenMemHandle`` (the other GPU tests).
"""

import json
import subprocess
import sys

import pytest
import torch

from ckpt_core.devices import get_backend
from ckpt_core.errors import TransportError

pytestmark = pytest.mark.gpu


def test_a_worker_in_the_exporting_process_gets_the_exported_buffer_itself():
    cuda = get_backend("cuda")
    buf = cuda.alloc_ipc(1 << 20, 0, "same-process")
    buf.tensor.copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda:0"))
    wire = json.loads(json.dumps(buf.descriptor))   # what the hello carries: plain JSON
    mapped, closer = cuda.open_ipc(wire, 0)
    assert closer is None
    assert mapped.data_ptr() == buf.tensor.data_ptr() and mapped.numel() == 1 << 20
    mapped[:8].fill_(7)   # the worker writes where the PS reads: one memory
    assert buf.tensor[:8].tolist() == [7] * 8


def test_a_descriptor_naming_another_size_is_refused_in_the_exporting_process():
    cuda = get_backend("cuda")
    buf = cuda.alloc_ipc(4096, 0, "same-process-size")
    wrong = {**buf.descriptor, "nbytes": 8192}
    with pytest.raises(TransportError, match="exported by this process"):
        cuda.open_ipc(wrong, 0)


def test_a_worker_in_another_process_still_maps_the_buffer_through_cuda_ipc():
    cuda = get_backend("cuda")
    buf = cuda.alloc_ipc(1 << 16, 0, "other-process")
    data = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, device="cuda:0")
    buf.tensor.copy_(data)
    torch.cuda.synchronize()
    code = ("import json, sys, torch; from ckpt_core.devices import get_backend; "
            "b = get_backend('cuda'); b.set_device(0); t, _ = b.open_ipc(json.loads(sys.stdin.read()), 0); "
            "print(int(t.to(torch.int64).sum()))")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(buf.descriptor), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) == int(data.to(torch.int64).sum())
