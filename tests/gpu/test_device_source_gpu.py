"""Device-resident checkpoints on CUDA (``register_checkpoint(..., on_device=True)``): the caller's GPU
tensors are registered where they lie (no host copy, no pinned memory) and every update copies them
device-to-device into the IPC buffer the GPU engine worker reads; bit-exact, and an in-place rewrite
between updates is what the next one sends.

    NCCL_NVLS_ENABLE=0 python -m pytest -q tests/gpu/test_device_source_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from support.engine import EngineFront
from support.world import PsWorld

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
CASES = "support.device_source_cases"


def need(n: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, this machine has {torch.cuda.device_count()}")


def _want(reports: dict) -> dict[str, str]:
    from support.device_source_cases import shared_digest
    want = {n: d for r in sorted(reports) for n, d in reports[r].value["digests"].items()}
    want["shared.w"] = shared_digest([reports[r].value["piece"] for r in sorted(reports)])
    return want


@pytest.mark.parametrize("world", [1, 2])
def test_cuda_tensors_registered_on_device_update_the_gpu_worker_bit_exact_without_a_host_copy(world):
    need(world)
    front = EngineFront("cuda", world)
    try:
        with PsWorld("cuda", world, init={"max_bucket_gb": (8 << 10) / (1 << 30)}) as ps:
            reg = ps.all("call", (CASES, "register", ("dev", 1)))
            assert all(o.ok for o in reg.values()), reg
            for r, o in reg.items():   # the regions are the caller's CUDA storage: nothing on the host
                v = o.value
                assert v["same_storage"] and v["devices"] == ["cuda"] and v["on_device"], v
                assert v["no_pool"] and v["pool_bytes"] == 0 and v["registered_bytes"] == 0, v
            assert all(o.ok for o in ps.all("gather", "dev").values())
            got = ps.update("dev", front, 120)
            assert all(o.ok for o in got.values()), got
            for i in range(world):
                assert front.digests(i) == _want(reg), f"engine worker {i}"
            again = ps.all("call", (CASES, "rewrite", ("dev", 2)))   # an optimizer step, in place
            assert all(o.ok and o.value["same_storage"] for o in again.values()), again
            got = ps.update("dev", front, 120)
            assert all(o.ok for o in got.values()), got
            for i in range(world):
                assert front.digests(i) == _want(again), f"engine worker {i} missed the in-place rewrite"
            failed = ps.update("dev", front, 120, {0: {"fail_bucket": 1}})   # every rank fails, engines keep theirs
            assert all(not o.ok and o.error == "RemoteWorkerError" for o in failed.values()), failed
            third = ps.all("call", (CASES, "rewrite", ("dev", 3)))   # ordered after the failed update's reads
            assert all(o.ok for o in third.values()), third
            got = ps.update("dev", front, 120)
            assert all(o.ok for o in got.values()), got
            for i in range(world):
                assert front.digests(i) == _want(third), f"engine worker {i}"
    finally:
        front.close()


def test_a_sliced_update_packs_strided_boxes_from_device_resident_cuda_tensors():
    """Strided boxes (columns) copied device-to-device (``CudaBackend.copy_pitched``'s device path)."""
    need(2)
    from support.slices_world import plan, sliced_update_lands
    front = EngineFront("cuda", 2, slices=(plan().digest, [0, 1]))
    try:
        with PsWorld("cuda", 2) as ps:
            got = ps.all("call", (CASES, "register_slices", ("s", 7)))
            assert all(o.ok and o.value for o in got.values()), got
            assert all(o.ok for o in ps.all("gather", "s").values())
            sliced_update_lands(ps, front, "s", 7, timeout=120)
    finally:
        front.close()


def test_a_cpu_tensor_with_on_device_is_refused_on_a_cuda_parameter_server():
    need(1)
    with PsWorld("cuda", 1) as ps:
        got = ps.all("register", ("c", {"named_tensors": {"w": torch.randn(64)}, "on_device": True}))
        assert not got[0].ok and got[0].error == "DeviceResidentError" and "lies on cpu" in got[0].message, got
        assert ps.all("checkpoints")[0].value == []
