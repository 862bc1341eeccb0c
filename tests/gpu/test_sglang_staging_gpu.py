"""ckpt_sglang.staging's receiver and commit on a GPU: our PS (stock wire, CUDA IPC) -> the stock
checkpoint-engine 0.4.2 worker loop in the receiver thread (its own CUDA stream) -> a staging area
in device memory up to the limit, pinned host memory beyond it -> the commit's ``load_weights``.

No SGLang runs on the GPU machine, so two things are stood in: SGLang's checkpoint-engine worker
extension (only its device key and index are read: ``GPU-<uuid>``, as SGLang's own) and the model
(a module whose ``load_weights`` copies each tensor into its parameter of that name, as a plain
SGLang layer's weight loader does). Needs ``CKPT_STOCK_CE="0.4.2=DIR"`` (see test_compat_gpu.py).
Prints ``SGLANG-STAGING-GPU`` lines with the figures.
"""

import sys
import time
import types

import pytest
import torch

from support.ports import free_port
from support.stock_workers import stock_dirs

pytestmark = pytest.mark.gpu


class Model(torch.nn.Module):
    def __init__(self, shapes: dict, device):
        super().__init__()
        self.p = torch.nn.ParameterDict({n.replace(".", "_"): torch.nn.Parameter(
            torch.zeros(s, dtype=torch.bfloat16, device=device), requires_grad=False) for n, s in shapes.items()})

    def load_weights(self, weights):
        for name, t in weights:
            self.p[name.replace(".", "_")].data.copy_(t)

    def parameters(self, recurse=True):
        return self.p.parameters()


def _stand_in_sglang(device_index: int) -> None:
    ext = types.ModuleType("sglang.srt.checkpoint_engine.checkpoint_engine_worker")

    class Ext:
        def __init__(self, _runner):
            pass

        def get_device_uuid(self):
            return f"GPU-{torch.cuda.get_device_properties(device_index).uuid}"

        def get_device_id(self):
            return device_index

    ext.SGLangCheckpointEngineWorkerExtensionImpl = Ext
    for name in ("sglang", "sglang.srt", "sglang.srt.checkpoint_engine"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules[ext.__name__] = ext


def _checkpoint(gib: int, n: int = 32) -> dict:
    numel = gib * (1 << 30) // 2 // n
    gen = torch.Generator().manual_seed(7)
    return {f"layer.{i}.weight": torch.randn(numel, generator=gen).to(torch.bfloat16) for i in range(n)}


def _ps_process(gib: int, port: int, conn) -> None:
    """The PS rank, in its own process (CUDA IPC is opened by another process than the exporter)."""
    from ckpt_core import ParameterServer

    with ParameterServer(rank=0, world_size=1, device="cuda", wire="stock", master_addr="127.0.0.1",
                         master_port=port) as ps:
        ps.register_checkpoint("g", named_tensors=_checkpoint(gib))
        ps.gather_metas("g")

        def req_func(handles):
            conn.send(list(handles))   # the engine side starts its receiver
            assert conn.recv() == "receiving"

        t0 = time.perf_counter()
        result = ps.update("g", req_func, timeout=300)
        conn.send({"seconds": result["seconds"], "wall": time.perf_counter() - t0})


@pytest.mark.parametrize("gib, device_gib", [(4, 8), (4, 2)])
def test_a_stage_lands_in_device_memory_up_to_its_limit_and_the_commit_loads_exact_bytes(gib, device_gib):
    import multiprocessing as mp

    folder = stock_dirs().get("0.4.2")
    if folder is None:
        pytest.skip("stock checkpoint-engine 0.4.2 not installed: set CKPT_STOCK_CE (see test_compat_gpu.py)")
    sys.path.insert(0, folder)
    _stand_in_sglang(0)
    from ckpt_sglang.staging import EngineStaging

    tensors = _checkpoint(gib)
    model = Model({k: v.shape for k, v in tensors.items()}, "cuda:0")
    engine = EngineStaging()
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    ps = ctx.Process(target=_ps_process, args=(gib, free_port(), theirs), daemon=True)
    ps.start()
    try:
        assert ours.poll(300), "the PS never posted its handles"
        handles = dict(ours.recv())
        engine.stage(model, {"weights": "g1", "handles": handles, "device_bytes": device_gib << 30,
                             "receive_timeout": 300})
        ours.send("receiving")
        assert ours.poll(300), "the PS update did not end"
        result = ours.recv()
    finally:
        ps.join(60)
    assert ps.exitcode == 0
    state = engine.state(model, {})
    staged = state["staged"]
    assert staged is not None and staged["version"] == "g1" and staged["tensors"] == 32, state
    assert 0 < staged["device_bytes"] <= device_gib << 30
    assert (staged["host_bytes"] == 0) == (device_gib >= gib), staged
    assert all(float(p.abs().sum()) == 0 for p in model.p.values()), "the stage touched a live parameter"
    commit = engine.commit(model, {"weights": "g1"})
    for name, t in tensors.items():
        assert torch.equal(model.p[name.replace(".", "_")].cpu(), t), f"{name} differs after the commit"
    load_s = commit["seconds"]["load"]
    print(f"SGLANG-STAGING-GPU | {gib} GiB, staging limit {device_gib} GiB: {staged['device_bytes'] / 2**30:.2f} GiB "
          f"staged on the device, {staged['host_bytes'] / 2**30:.2f} GiB in pinned host memory | stage: PS update "
          f"{result['seconds']['total']:.3f} s (wall {result['wall']:.3f} s) | commit load_weights {load_s * 1e3:.1f} ms "
          f"({gib * 2**30 / load_s / 1e9:.0f} GB/s)", flush=True)
