"""Deltas of a trainer's versions on its GPU (``register_checkpoint(..., on_device=True, base=...)``):
encoded on the device (``ckpt_core/delta/encode_device.py``), each payload byte for byte what the host
encoder writes for the same pair; then a chain of AdamW versions registered on the GPU and sent as
deltas into the GPU engine worker, each leaving it equal to the full version.

    NCCL_NVLS_ENABLE=0 python -m pytest -q -s tests/gpu/test_delta_device_encode_gpu.py
"""

from __future__ import annotations

import time

import pytest
import torch

from ckpt_core.delta.encode import ENCODINGS, encode_tensor
from ckpt_core.delta.encode_device import encode_on_device
from support.data import want_digests
from support.delta_world import DERIVED, DeltaEngine, Trainer
from support.engine import EngineFront
from support.world import PsWorld

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.float64] + (
    [torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])


@pytest.fixture(autouse=True)
def one_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: the device encode runs where the trainer's tensors lie")


def _random(n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), generator=gen, dtype=torch.uint8).view(dtype)


def _mutate(base, positions):
    new = base.clone()
    new.view(torch.uint8).view(-1, base.element_size())[positions, 0] ^= 1
    return new


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("encoding", [None, *ENCODINGS[1:]])
def test_the_gpu_encode_writes_the_host_encoders_payload(dtype, encoding):
    gen = torch.Generator().manual_seed(5)
    pairs = []
    for n, k in ((4099, 40), (70_000, 3), (1 << 16, 1 << 14), (333, 333)):
        base = _random(n, dtype, n)
        pairs.append((_mutate(base, torch.randperm(n, generator=gen)[:k]), base))
    got = encode_on_device([(a.cuda(), b.cuda()) for a, b in pairs], force=encoding)
    for (new, old), (payload, info) in zip(pairs, got):
        want, want_info = encode_tensor(new, old, force=encoding)
        assert info == want_info and payload.device.type == "cuda"
        assert torch.equal(payload.cpu(), want), f"{dtype} {new.numel()} {info}"


def test_a_large_tensor_at_two_percent_the_gpu_against_the_host():
    """Figures only (printed): 256 Mi bf16 elements (512 MiB), 2 % changed."""
    n = 1 << 28
    base = torch.randint(-(1 << 15), 1 << 15, (n,), dtype=torch.int16, device="cuda").view(torch.bfloat16)
    new = base.clone()
    pos = torch.randperm(n, device="cuda")[: n // 50]
    new.view(torch.int16)[pos] ^= 1
    encode_on_device([(new, base)])   # warm-up: kernels, coefficient tables
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    [(payload, info)] = encode_on_device([(new, base)])
    torch.cuda.synchronize()
    gpu_s = time.perf_counter() - t0
    host_new, host_base = new.cpu(), base.cpu()
    t0 = time.perf_counter()
    want, _ = encode_tensor(host_new, host_base)
    host_s = time.perf_counter() - t0
    assert torch.equal(payload.cpu(), want)
    print(f"\ndevice encode of 512 MiB bf16 at 2 %: {gpu_s * 1e3:.1f} ms on the GPU, {host_s * 1e3:.1f} ms on the "
          f"host (one thread); {info}")


def test_a_chain_of_versions_on_the_gpu_goes_as_deltas_bit_exact():
    trainer = Trainer(seed=21, world=1)
    front = EngineFront("cuda", 1, behavior={"derived": DERIVED}, engine_cls=DeltaEngine)
    try:
        with PsWorld("cuda", 1) as ps:
            v = {"A": trainer.version()}
            got = ps.all("call", ("support.delta_world", "register_on_device", ("A", v["A"][0])))
            assert all(o.ok and o.value["on_device"] for o in got.values()), got
            assert all(o.ok for o in ps.all("gather", "A").values())
            got = ps.update("A", front, 120, {0: {"version": "A"}})
            assert all(o.ok for o in got.values()), got
            prev = "A"
            for name, lr in (("B", 1e-5), ("C", 1e-4)):
                trainer.step(lr)
                v[name] = trainer.version()
                got = ps.all("call", ("support.delta_world", "register_on_device", (name, v[name][0], prev)))
                assert all(o.ok for o in got.values()), got
                assert all(o.ok for o in ps.all("gather", name).values())
                got = ps.all("call", ("support.delta_world", "delta_update", (name, front.address, 120, None, True)),
                             timeout=240)
                assert all(o.ok for o in got.values()), got
                fig = got[0].value["delta"]
                print(f"\n{name}: {fig['changed_elements']} of {fig['elements']} elements changed, payload "
                      f"{fig['payload_bytes']} of {fig['full_bytes']} bytes, encoded in {fig['encode_s'] * 1e3:.1f} ms")
                assert fig["base"] == prev and 0 < fig["payload_bytes"] < fig["full_bytes"], fig
                assert front.digests(0) == want_digests(*v[name].values()), f"the engine differs from {name}"
                prev = name
    finally:
        front.close()
