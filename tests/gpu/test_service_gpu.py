"""The HTTP service on CUDA: `ckpt-engine serve --device cuda` ranks, one per GPU (up to 2), driven over
Unix sockets; an update through the service lands bit-exact in engine workers on the same GPUs."""

import os

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("fastapi")
from support.data import FAULT_DTYPES, fresh_tensor, want_digests  # noqa: E402
from support.service_world import HttpEngineFront, ServiceWorld  # noqa: E402
from ckpt_core.checkpoint.safetensors import write_file  # noqa: E402


def test_register_gather_update_through_the_service_on_cuda(tmp_path):
    world = min(2, torch.cuda.device_count())
    gen = torch.Generator().manual_seed(16)
    svc = ServiceWorld(world, str(tmp_path), device="cuda", env={"NCCL_NVLS_ENABLE": "0"})
    front = HttpEngineFront(world, kind="cuda")
    try:
        data, bodies = {}, []
        for r in range(world):
            ts = {f"g{r}.{i}": fresh_tensor((1 << 20,) if i % 2 else (512, 1024), FAULT_DTYPES[i % 4], gen)
                  for i in range(16)}
            path = os.path.join(str(tmp_path), f"g{r}.safetensors")
            write_file(path, ts)
            data.update(ts)
            bodies.append({"files": [path]})
        assert [r.status_code for r in svc.all("POST", "/v1/checkpoints/g/files", bodies)] == [200] * world
        assert [r.status_code for r in svc.all("POST", "/v1/checkpoints/g/gather-metas")] == [200] * world
        for _ in range(2):
            bodies = [{"timeout": 120} for _ in range(world)]
            bodies[0]["update_url"] = front.url    # rank 0 posts for the one engine (reference contract)
            got = svc.all("POST", "/v1/checkpoints/g/update", bodies)
            assert [r.status_code for r in got] == [200] * world, [r.text for r in got]
        held = {}
        for i in range(world):
            held.update(front.engine.digests(i))
        assert held == want_digests(data)
        status = svc.clients[0].get("/v1/status").json()
        assert status["device_key"].startswith("GPU-") and status["updates"] == 2
        print("service update on cuda:", got[0].json()["result"]["seconds"])
    finally:
        front.close()
        assert svc.close() == [0] * world
