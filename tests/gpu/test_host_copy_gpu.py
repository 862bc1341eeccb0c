"""The host copier's device path (``ckpt_core/delta/host_copy.py``: ``CudaMover`` on a side stream, the
staging registered with cudaHostRegister): copies of CUDA tensors are byte-equal to their sources in
every dtype, at chunk borders and packed tiny; a copy sees what the current stream wrote before it (the
side stream waits for it); the staging is page-locked, allocated once, reused, and unregistered on close;
non-contiguous device tensors take the plain path."""

import pytest
import torch

from ckpt_core.delta.host_copy import ALIGN, HostCopier, copier_from_settings

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.int8, torch.int64, torch.uint8, torch.bool,
          torch.float8_e4m3fn]
CHUNK = 1 << 20


def _random(n, dtype, gen):
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), generator=gen, dtype=torch.uint8, device="cuda")
    return (raw % 2).bool() if dtype == torch.bool else raw.view(dtype)


def _same(src, dst):
    return (dst.device.type == "cpu" and dst.dtype == src.dtype and dst.shape == src.shape
            and torch.equal(src.contiguous().reshape(-1).view(torch.uint8).cpu(),
                            dst.contiguous().reshape(-1).view(torch.uint8)))


def _copier(**kw):
    return HostCopier(chunk_bytes=kw.pop("chunk", CHUNK), chunks=kw.pop("chunks", 3), threads=kw.pop("threads", 4),
                      **kw)


def test_device_tensors_copy_byte_equal_through_the_registered_staging_in_every_dtype():
    gen = torch.Generator(device="cuda").manual_seed(7)
    sizes = [0, 1, 3, 255, 256, 257, CHUNK // 2 + 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17] + [5] * 300
    named = [(f"t{i}.{d}", _random(n, d, gen)) for i, n in enumerate(sizes) for d in DTYPES[:3]]
    named += [(f"d.{d}", _random(4099, d, gen).reshape(-1)) for d in DTYPES]
    copier = _copier()
    for _ in range(3):
        out = copier.copy(named, timeout=60)
        assert all(_same(s, d) for (_, s), d in zip(named, out))
        assert copier.last["staged_bytes"] == sum(t.nbytes for _, t in named)
    assert copier.allocations == 1
    staging = copier._staging
    assert staging and all(buf.is_pinned() for buf in staging), "the staging is not page-locked"
    copier.close()
    assert copier._staging is None


def test_a_copy_sees_what_the_current_stream_wrote_before_it():
    copier = _copier(chunk=4 * CHUNK)
    for _ in range(3):
        t = torch.zeros(16 * CHUNK // 2, dtype=torch.bfloat16, device="cuda")
        torch.cuda._sleep(50_000_000)   # the current stream is busy for a while ...
        t.fill_(3.0)                    # ... then writes what the copy must see
        (out,) = copier.copy([("late", t)], timeout=60)
        assert bool((out == 3.0).all()), "the side stream copied before the current stream's write"
    copier.close()


def test_non_contiguous_device_tensors_take_the_plain_path_and_are_equal():
    gen = torch.Generator(device="cuda").manual_seed(3)
    base = _random(64 * 48, torch.float32, gen).reshape(64, 48)
    named = [("t", base.t()), ("s", base.reshape(-1)[::3]), ("c", base)]
    copier = _copier()
    out = copier.copy(named, timeout=60)
    assert all(_same(s, d) for (_, s), d in zip(named, out))
    assert copier.last["staged_bytes"] == base.nbytes
    copier.close()


def test_the_copier_from_settings_copies_a_model_sized_set_equal(monkeypatch):
    monkeypatch.setenv("CKPT_HOST_COPY_MIB", "64")
    monkeypatch.setenv("CKPT_HOST_COPY_THREADS", "4")
    gen = torch.Generator(device="cuda").manual_seed(11)
    named = [(f"layer.{i}", _random(n, torch.bfloat16, gen)) for i, n in
             enumerate([(37 << 20) // 2, 4096, (5 << 20) // 2 + 3, 11] * 6)]
    copier = copier_from_settings()
    assert copier.chunk_bytes % ALIGN == 0 and copier.chunk_bytes > 0
    out = copier.copy(named, timeout=120)
    assert all(_same(s, d) for (_, s), d in zip(named, out))
    assert copier.last["bytes"] == sum(t.nbytes for _, t in named)
    copier.close()
