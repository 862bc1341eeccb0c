"""A staging area on CUDA copies a bucket in runs (``wire/staging.py``): views of a device buffer (as
the worker hands them over) staged into device memory up to the limit, then pinned host memory, each
tensor then holding its own bytes, dtype and shape after the buffer is overwritten."""

import pytest
import torch

from ckpt_core.wire.staging import StagingArea

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def one_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def test_buckets_of_neighbouring_views_stage_bit_exact_on_the_device_and_in_pinned_host_memory():
    torch.cuda.set_device(0)
    gen = torch.Generator(device="cuda").manual_seed(11)
    buf = torch.randint(0, 256, (1 << 22,), dtype=torch.uint8, device="cuda", generator=gen)
    dtypes = [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int64]
    buckets, at = [], 0
    for b in range(4):
        weights = []
        for i in range(300):
            dtype = dtypes[(i * 7 + b) % len(dtypes)]
            shape = (1 + i % 5, 3 + i % 7)
            n = dtype.itemsize * shape[0] * shape[1]
            at = (at + 255) // 256 * 256 + (4096 if i % 97 == 0 else 0)   # now and then a hole wider than a run
            weights.append((f"b{b}.t{i}", buf[at: at + n].view(dtype).view(shape)))
            at += n
        weights.insert(5, (f"b{b}.transposed", buf[:64].view(torch.float32).view(4, 4).t()))
        buckets.append(weights)
    want = [[(n, t.dtype, tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).cpu().clone()) for n, t in w]
            for w in buckets]
    area = StagingArea("v", torch.device("cuda", 0), device_limit=at // 2)   # about half fits on the device
    for w in buckets:
        area.add(w)
    buf.zero_()
    torch.cuda.synchronize()
    assert area.device_bytes > 0 and area.host_bytes > 0
    assert {t.device.type for b in area.buckets for _, t in b} == {"cuda", "cpu"}
    for got, exp in zip(area.buckets, want):
        assert [(n, t.dtype, tuple(t.shape)) for n, t in got] == [e[:3] for e in exp]
        for (n, t), e in zip(got, exp):
            assert torch.equal(t.contiguous().reshape(-1).view(torch.uint8).cpu(), e[3]), n
