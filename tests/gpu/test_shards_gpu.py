"""Registering straight from CUDA training shards: real FSDP2 on NCCL, one rank per GPU (up to two),
the parameter server inside each trainer process. The local shards are copied device-to-host
straight into the PS's pinned memory; every engine worker then holds every full tensor bit-exact
against ``full_tensor()`` computed before registration, and nothing gathers (``DTensor.full_tensor``
and ``redistribute`` are patched to raise). Skipped without CUDA (tests/conftest.py).

    NCCL_NVLS_ENABLE=0 python -m pytest -q tests/gpu/test_shards_gpu.py
"""

import pytest
import torch

from support.engine import EngineFront
from support.shards_world import run_trainers

pytestmark = pytest.mark.gpu


def test_cuda_fsdp2_shards_reach_every_engine_worker_whole_and_bit_exact():
    world = min(2, torch.cuda.device_count())
    front = EngineFront("cuda", world)
    try:
        res = run_trainers(world, front.address, steps=2, kind="cuda", timeout=600)
        for r in range(world):
            assert all(isinstance(x, dict) for x in res[r]), res[r]
        final = res[0][-1]["want"]
        for i in range(world):
            assert front.digests(i) == final, f"engine worker {i} holds every full tensor, bit-exact"
        last = [res[r][-1] for r in range(world)]
        assert [x["registered"] for x in last] == [x["local"] for x in last], "each rank registered its own shard"
        assert sum(x["registered"] for x in last) == last[0]["bytes"]
        assert all(x["plans"] == 1 for x in last), "the second step reused the plan"
    finally:
        front.close()


def test_a_cuda_shard_is_copied_straight_into_pinned_host_memory():
    """No host copy on the way: the registered region is pinned and the source never went through .cpu()."""
    from ckpt_core.checkpoint.sources import build_checkpoint
    from ckpt_core.checkpoint.shards import TensorShard
    from ckpt_core.devices import get_backend
    backend = get_backend("cuda")
    local = torch.randn(1000, 64, device="cuda")
    calls = []
    orig = torch.Tensor.cpu
    torch.Tensor.cpu = lambda self, *a, **k: (calls.append(self.shape), orig(self, *a, **k))[1]
    try:
        ckpt = build_checkpoint("c", backend, named_tensors={"w": TensorShard(local, (3000, 64), (1000, 0))})
    finally:
        torch.Tensor.cpu = orig
    try:
        assert calls == [], "the shard went through a host copy"
        (region,) = ckpt.regions.values()
        assert region.tensor.is_pinned()
        (m,) = ckpt.metas
        got = ckpt.host_tensor(m)
        assert torch.equal(got.view(torch.uint8), local.cpu().view(torch.uint8)) and m.box == ((3000, 64), (1000, 0))
    finally:
        ckpt.release()
