"""verl's ckpt backend on CUDA, without verl: the parts of ``ckpt_verl`` that touch a device.

A trainer process (a world of one over its own gloo group, as verl's actor group) hands CUDA
tensors to ``take_share`` (moved to host memory), registers and serves them; a rollout process
(its own world of one, as a CheckpointEngineWorker's) pulls them as a P2P update into its CUDA
IPC buffer and reads every bucket through ``BucketStream`` in the same process (the CUDA IPC
buffer opened by its own exporter). The tensors it yields must be CUDA tensors equal, byte for
byte, to the trainer's. Both processes on GPU 0 (two worlds on one device, as the P2P joiner case).

Needs Mooncake's CUDA build (``mooncake-transfer-engine-cuda13``) and one GPU. Run:
``PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 python -m pytest tests/gpu/test_verl_stream_gpu.py -q``.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import os

import pytest
import torch

pytestmark = pytest.mark.gpu
ENV = {"PS_P2P_HOST": "127.0.0.1", "NCCL_IB_DISABLE": "1", "LOCAL_RANK": "0", "NCCL_NVLS_ENABLE": "0"}


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {f"layers.{i}.w": (512, 384 + 64 * i) for i in range(12)} | {"embed": (1000, 256)}
    return {n: (torch.randn(s, generator=gen) * 0.5).to(torch.bfloat16 if i % 2 else torch.float32)
            for i, (n, s) in enumerate(shapes.items())}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _world_of_one(port: int) -> None:
    import torch.distributed as dist
    os.environ.update(ENV)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _trainer(port: int, q, seed: int) -> None:
    try:
        from ckpt_core import ParameterServer
        from ckpt_verl._plan import take_share
        from ckpt_verl._rendezvous import Rendezvous
        _world_of_one(port)
        cuda = {n: t.cuda() for n, t in _weights(seed).items()}   # what verl's FSDP generator yields
        mine, local = asyncio.run(take_share(iter(cuda.items()), 0, 1))
        assert local is None and all(t.device.type == "cpu" for t in mine.values())
        ps = ParameterServer(rank=0, world_size=1, auto_pg=False, serve_p2p=True, max_bucket_gb=4 / 1024)
        ps.register_checkpoint("verl-weights", named_tensors=mine, use_shared_memory_pool=True)
        ps.gather_metas("verl-weights")
        store = Rendezvous("127.0.0.1", 0, serve=True, timeout_s=120)
        q.put(("store", store.port))
        store.publish_metas("r1", "verl-weights", ps.get_metas())
        store.wait_rollouts("r1", 1, 120)
        q.put(("trainer", {n: _digest(t) for n, t in cuda.items()}))
        ps.close()
    except BaseException as exc:   # noqa: BLE001
        q.put(("trainer", f"{type(exc).__name__}: {exc}"))


def _rollout(port: int, store_port: int, q) -> None:
    try:
        from ckpt_core import ParameterServer
        from ckpt_verl._receive import BucketStream
        from ckpt_verl._rendezvous import Rendezvous
        _world_of_one(port)
        ps = ParameterServer(rank=0, world_size=1, auto_pg=False, max_bucket_gb=4 / 1024)
        store = Rendezvous("127.0.0.1", store_port, serve=False, timeout_s=120)
        name, doc = store.wait_metas("r1", 120)
        ps.load_metas(doc)

        async def receive() -> tuple[dict, int]:
            got = {}
            stream = BucketStream(ps, name, 120).start()
            async for n, t in stream:
                assert t.is_cuda, f"{n} arrived on {t.device}"
                got[n] = _digest(t)
            return got, stream.buckets
        got, buckets = asyncio.run(receive())
        store.report_done("r1")
        q.put(("rollout", {"digests": got, "buckets": buckets}))
        ps.close()
    except BaseException as exc:   # noqa: BLE001
        q.put(("rollout", f"{type(exc).__name__}: {exc}"))


def test_a_rollout_on_cuda_reads_the_trainers_cuda_weights_bit_exact_through_the_stream():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"Mooncake's CUDA build (mooncake-transfer-engine-cuda13) is not installed: {exc}")
    from support.ports import free_port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    trainer = ctx.Process(target=_trainer, args=(free_port(), q, 7))
    trainer.start()
    kind, port = q.get(timeout=300)
    assert kind == "store", port
    rollout = ctx.Process(target=_rollout, args=(free_port(), port, q))
    rollout.start()
    got = dict(q.get(timeout=300) for _ in range(2))
    for p in (trainer, rollout):
        p.join(60)
    assert isinstance(got["trainer"], dict), got["trainer"]
    assert isinstance(got["rollout"], dict), got["rollout"]
    assert got["rollout"]["digests"] == got["trainer"]
    assert got["rollout"]["buckets"] >= 3   # 4 MiB buckets: the ring of slots was used, not one bucket
