"""Our PS with the compat codec (wire="stock") drives the stock checkpoint-engine 0.4.2 worker on GPUs.

Nothing stood in: the stock worker rebuilds our CUDA IPC buffer from torch's ``reduce_tensor``
handle (device index at argument 6) and uses its own DeviceManager. Needs the stock release in a
folder named by ``CKPT_STOCK_CE`` (``scripts/stock_ce_env.sh 0.4.2``, or offline:
``pip install --no-deps --target DIR checkpoint_engine-0.4.2-*.whl loguru-*.whl`` and
``CKPT_STOCK_CE="0.4.2=DIR"``). Prints ``COMPAT-GPU`` lines with the update figures.
"""

import time

import pytest
import torch

from support.asserts import assert_every_rank_failed
from support.engine import EngineFront
from support.world import FreshCheckpoints, PsWorld
from support.stock_workers import StockSimEngine, stock_dirs

pytestmark = pytest.mark.gpu


def _stock_dir() -> str:
    folder = stock_dirs().get("0.4.2")
    if folder is None:
        pytest.skip("stock checkpoint-engine 0.4.2 not installed: set CKPT_STOCK_CE (see the module docstring)")
    return folder


@pytest.mark.parametrize("world", [1, 2])
def test_stock_workers_on_cuda_receive_exact_weights_and_switch(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    folder = _stock_dir()
    with PsWorld("cuda", world, init={"wire": "stock"}) as ps:
        front = EngineFront("cuda", world, behavior={"stock_dir": folder}, engine_cls=StockSimEngine)
        try:
            ckpts = FreshCheckpoints(ps, seed=31, per_rank=24, numel=1 << 22)
            for step in range(3):
                name, want = ckpts.new("gpu-step")
                t0 = time.perf_counter()
                got = ps.update(name, front, timeout=300)
                wall = time.perf_counter() - t0
                assert all(o.ok for o in got.values()), got
                for i in range(world):
                    assert front.digests(i) == want, f"engine {i} holds other bytes after step {step}"
                r = got[0].value
                print(f"COMPAT-GPU | world {world} | step {step} | {r['bytes'] / 2**30:.3f} GiB in {r['buckets']} "
                      f"buckets | PS update {r['seconds']['total']:.3f} s ({r['gbps']:.1f} GB/s) | wall {wall:.2f} s",
                      flush=True)
                ckpts.drop(name)
            name, _ = ckpts.new("gpu-fail")
            got = ps.update(name, front, timeout=120, behaviors={world - 1: {"fail_bucket": 0}})
            assert_every_rank_failed(got, "RemoteWorkerError", f"rank {world - 1}", "injected engine failure")
        finally:
            front.close()
