"""Every piece of a host region is pinned (cudaHostRegister), not only the first.

torch's is_pinned() answers for a tensor's storage, not for a view into it; pinning pieces of
one region must not trust it (a regression once left all but the first 512 MiB pageable and
every update ~6x slower).
"""

import ctypes

import pytest
import torch

pytestmark = pytest.mark.gpu


class _Attrs(ctypes.Structure):
    # cudaPointerAttributes; newer CUDA versions append reserved fields: leave room for them
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p),
                ("reserved", ctypes.c_char * 512)]


def _cudart():
    torch.cuda.init()
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    if not paths:
        pytest.skip("libcudart is not loaded as a shared library here (statically linked torch?)")
    lib = ctypes.CDLL(sorted(paths)[0])
    lib.cudaPointerGetAttributes.argtypes = [ctypes.POINTER(_Attrs), ctypes.c_void_p]
    return lib


def memory_type(lib, ptr: int) -> int:
    a = _Attrs()
    assert lib.cudaPointerGetAttributes(ctypes.byref(a), ptr) == 0
    return a.type   # 0 unregistered, 1 host (pinned/registered)


def test_every_piece_of_a_region_is_registered_and_released():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from ckpt_core.checkpoint.host import fill_and_pin, new_region, populate_jobs
    from ckpt_core.planning.buckets import PIN_CHUNK
    from ckpt_core.devices import get_backend

    lib = _cudart()
    backend = get_backend("cuda")
    region = new_region(backend, 0, 3 * PIN_CHUNK + (1 << 20))
    fill_and_pin(backend, region, populate_jobs(region))
    base, n = region.tensor.data_ptr(), region.nbytes
    probes = [base + a for k in range(0, n, PIN_CHUNK) for a in (k, min(k + PIN_CHUNK, n) - 1)]
    assert [memory_type(lib, p) for p in probes] == [1] * len(probes)
    region.release()
    # the mapping may be gone now: ask about a fresh region of the same shape instead
    other = new_region(backend, 1, PIN_CHUNK + 4096)
    assert memory_type(lib, other.tensor.data_ptr() + PIN_CHUNK) in (0,)   # never pinned
    other.release()


def test_registration_on_cuda_reports_pinning_and_copy_progress_in_bytes():
    """The pinning kind's extra phase (fault in + cudaHostRegister) is reported, in bytes, before
    the copy; both reach their totals."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from ckpt_core import ParameterServer
    from support.ports import free_port
    calls = []
    with ParameterServer(0, 1, device="cuda", master_addr="127.0.0.1", master_port=free_port()) as ps:
        ps.progress = lambda *a: calls.append(a)
        ps.register_checkpoint("c", named_tensors={"w": torch.ones(600 << 18, dtype=torch.int32)})   # 600 MiB
    phases = [p for op, p, _, _ in calls if op == "register"]
    assert phases[0] == "validate" and phases[-1] == "done", phases
    assert phases.index("populate and pin") < phases.index("fill"), phases
    for phase in ("populate and pin", "fill"):
        last = [(d, t) for op, p, d, t in calls if p == phase][-1]
        assert last[0] == last[1] >= 600 << 20, (phase, last)
