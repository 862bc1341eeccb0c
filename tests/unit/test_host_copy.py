"""Host copies through the reusable staging (``ckpt_core/delta/host_copy.py``), run on the CPU with a
plain host tensor as the staging and the host mover standing in for the device's copy engine: the
plan covers every byte of every tensor once, inside its chunk; every copy is byte-equal to its source
in every dtype and shape, at chunk borders and packed tiny; the staging is allocated once and reused;
a chunk's slot is not refilled before its threads copied it out; a failed or stuck device copy raises
a typed error naming the tensor, and the next call works; close releases once."""

import gc
import random
import threading
import time

import pytest
import torch

from ckpt_core.delta.host_copy import (
    ALIGN,
    HostCopier,
    HostMover,
    Piece,
    copier_from_settings,
    plan_chunks,
    split_shares,
)
from ckpt_core.errors import ClosedError, ConfigError, TransportError, UpdateTimeoutError

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.int8, torch.int64, torch.uint8, torch.bool] + (
    [torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])
CHUNK = 4096


def _random(shape, dtype, gen):
    n = 1
    for s in shape:
        n *= s
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), generator=gen, dtype=torch.uint8)
    t = (raw % 2).bool() if dtype == torch.bool else raw.view(dtype)
    return t.reshape(shape)


def _gen():
    return torch.Generator().manual_seed(random.randrange(1 << 62))


class Staging:
    """A plain host tensor as staging, counting allocations and releases."""

    def __init__(self):
        self.allocs, self.released, self.buffers = 0, 0, []

    def __call__(self, nbytes):
        self.allocs += 1
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.buffers.append(buf)
        return buf, self.release

    def release(self):
        self.released += 1


def _copier(staging=None, mover=None, chunk=CHUNK, chunks=2, threads=3):
    return HostCopier(chunk_bytes=chunk, chunks=chunks, threads=threads, alloc=staging or Staging(),
                      mover=mover or (lambda device: HostMover()), stage_devices=("cpu",), min_share=64)


def _same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _check_plan(sizes, chunks, chunk_bytes):
    covered = {i: [] for i, n in enumerate(sizes) if n}
    for pieces in chunks:
        spans = sorted((p.at, p.at + p.nbytes) for p in pieces)
        assert spans and all(0 <= a < b <= chunk_bytes for a, b in spans)
        assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:])), "pieces of one chunk overlap"
        for p in pieces:
            covered[p.tensor].append(p)
    for i, pieces in covered.items():
        assert pieces[0].start == 0 and pieces[0].at % ALIGN == 0
        assert all(a.start + a.nbytes == b.start for a, b in zip(pieces, pieces[1:]))
        assert pieces[-1].start + pieces[-1].nbytes == sizes[i]
        if sizes[i] <= chunk_bytes:
            assert len(pieces) == 1, f"tensor {i} of {sizes[i]} bytes fits one chunk but was split"


@pytest.mark.parametrize("sizes", [
    [CHUNK], [CHUNK + 1], [CHUNK - 1, 2], [1] * 1000, [0, 0, 5, 0], [3 * CHUNK + 17, 1, CHUNK, CHUNK - 255, 256],
    [random.randrange(1, 3 * CHUNK) for _ in range(200)],
])
def test_the_plan_covers_every_byte_of_every_tensor_once_inside_its_chunk(sizes):
    chunks = plan_chunks(sizes, CHUNK)
    _check_plan(sizes, chunks, CHUNK)
    assert len(chunks) >= -(-sum(sizes) // CHUNK)


def test_one_chunk_exactly_is_one_piece_and_one_byte_more_is_two_chunks():
    assert plan_chunks([CHUNK], CHUNK) == [[Piece(0, 0, 0, CHUNK)]]
    assert plan_chunks([CHUNK + 1], CHUNK) == [[Piece(0, 0, 0, CHUNK)], [Piece(0, CHUNK, 0, 1)]]
    assert len(plan_chunks([1] * 16, CHUNK)) == 1   # 16 tiny tensors packed at 256-byte steps


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_the_shares_cover_a_chunk_exactly(parts):
    pieces = plan_chunks([random.randrange(1, 2000) for _ in range(30)], 1 << 16)[0]
    shares = split_shares(pieces, parts, min_share=100)
    assert 1 <= len(shares) <= parts
    got = sorted((p.at, p.nbytes, p.start, p.tensor) for s in shares for p in s)
    bytes_of = {}
    for at, n, start, t in got:
        for k in range(n):
            bytes_of[(t, start + k)] = at + k
    want = {(p.tensor, p.start + k): p.at + k for p in pieces for k in range(p.nbytes)}
    assert bytes_of == want


def test_every_copy_equals_its_source_in_every_dtype_and_shape():
    gen = _gen()
    shapes = [(), (0,), (1,), (3, 0, 5), (7,), (33, 17), (CHUNK // 2 + 3,), (2, CHUNK + 1), (5, 3, CHUNK // 4)]
    named = [(f"t{i}.{d}", _random(s, d, gen)) for i, (s, d) in enumerate((s, d) for s in shapes for d in DTYPES)]
    random.shuffle(named)
    staging = Staging()
    copier = _copier(staging)
    out = copier.copy(named, timeout=60)
    assert len(out) == len(named)
    for (name, src), dst in zip(named, out):
        assert _same_bytes(src, dst), name
        assert dst.device.type == "cpu" and dst.data_ptr() != src.data_ptr() or dst.numel() == 0
    assert copier.last["staged_bytes"] == sum(t.nbytes for _, t in named)
    assert copier.last["chunks"] > 2   # the two slots were each refilled
    copier.close()


@pytest.mark.parametrize("sizes", [[CHUNK], [CHUNK + 1], [CHUNK - 1, 1, CHUNK + 1], [1] * 3000, [5 * CHUNK + 3]])
def test_copies_at_chunk_borders_and_packed_tiny_are_byte_equal(sizes):
    gen = _gen()
    named = [(f"w{i}", _random((n,), torch.uint8, gen)) for i, n in enumerate(sizes)]
    out = _copier().copy(named, timeout=60)
    assert all(_same_bytes(s, d) for (_, s), d in zip(named, out))


def test_views_into_a_shared_buffer_are_staged_and_non_contiguous_ones_copied_plainly():
    gen = _gen()
    buf = _random((3 * CHUNK,), torch.uint8, gen)   # like the tensors of an IPC bucket: views into one buffer
    a = buf[6: 6 + 2 * 1000].view(torch.bfloat16).reshape(40, 25)
    b = buf[2049: 2049 + CHUNK]
    t = _random((64, 48), torch.float32, gen).t()   # transposed
    s = _random((100,), torch.int8, gen)[::3]       # strided
    named = [("a", a), ("b", b), ("t", t), ("s", s)]
    copier = _copier()
    out = copier.copy(named, timeout=60)
    for (name, src), dst in zip(named, out):
        assert _same_bytes(src, dst), name
        assert dst.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    assert copier.last["staged_bytes"] == a.nbytes + b.nbytes


def test_the_staging_is_allocated_once_and_reused_across_calls():
    staging = Staging()
    copier = _copier(staging)
    gen = _gen()
    for _ in range(4):
        named = [(f"x{i}", _random((random.randrange(1, 3 * CHUNK),), torch.bfloat16, gen)) for i in range(20)]
        out = copier.copy(named, timeout=60)
        assert all(_same_bytes(s, d) for (_, s), d in zip(named, out))
    assert staging.allocs == 1 and copier.allocations == 1 and staging.released == 0
    copier.close()
    copier.close()
    assert staging.released == 1
    with pytest.raises(ClosedError):
        copier.copy([("x", torch.ones(3))], timeout=1)


class LateMover(HostMover):
    """Each chunk's copies report done a while after they were queued (a busy copy engine). ``eager``:
    the bytes land in the staging at once, so a slot refilled before its threads copied it out corrupts
    the copies; else they land only once the chunk reports done, so threads that copy out before the
    chunk's event corrupt them."""

    def __init__(self, eager, delay=0.003):
        self.eager, self.delay, self.stage = eager, delay, []

    def copy(self, dst, src):
        if self.eager:
            dst.copy_(src)
        else:
            self.stage.append((dst, src))

    def record(self):
        pending, self.stage = self.stage, []
        at = time.monotonic() + self.delay
        lock = threading.Lock()

        class Done:
            def query(self):
                with lock:
                    if time.monotonic() < at:
                        return False
                    while pending:
                        d, s = pending.pop()
                        d.copy_(s)
                    return True
        return Done()


@pytest.mark.parametrize("eager", [True, False], ids=["bytes-land-at-once", "bytes-land-at-the-event"])
def test_a_slot_is_copied_out_after_its_event_and_refilled_only_after_that(eager):
    gen = _gen()
    named = [(f"y{i}", _random((random.randrange(1, 2 * CHUNK),), torch.float32, gen)) for i in range(40)]
    copier = _copier(mover=lambda device: LateMover(eager))
    out = copier.copy(named, timeout=60)
    assert all(_same_bytes(s, d) for (_, s), d in zip(named, out))
    assert copier.last["chunks"] > 4


class FailingMover(HostMover):
    def __init__(self, bad):
        self.bad = bad

    def copy(self, dst, src):
        if src.data_ptr() == self.bad:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        dst.copy_(src)


def test_a_failed_device_copy_names_the_tensor_and_the_next_call_works():
    gen = _gen()
    named = [(f"z{i}", _random((700,), torch.int8, gen)) for i in range(30)]
    staging = Staging()
    copier = _copier(staging, mover=lambda device: FailingMover(named[17][1].data_ptr()))
    with pytest.raises(TransportError, match="'z17'") as err:
        copier.copy(named, timeout=60)
    assert isinstance(err.value.__cause__, RuntimeError) and "illegal memory access" in str(err.value)
    again = copier.copy(named[:10], timeout=60)   # a fresh staging: the failed one may still be written into
    assert all(_same_bytes(s, d) for (_, s), d in zip(named, again))
    assert staging.allocs == 2 and staging.released == 0
    copier.close()
    assert staging.released == 1   # the abandoned staging is never released


class StuckMover(HostMover):
    def record(self):
        class Never:
            def query(self):
                return False
        return Never()


def test_a_device_copy_that_never_finishes_times_out_naming_the_tensor():
    gen = _gen()
    named = [("only.weight", _random((3 * CHUNK,), torch.bfloat16, gen))]
    copier = _copier(mover=lambda device: StuckMover())
    t0 = time.monotonic()
    with pytest.raises(UpdateTimeoutError, match="'only.weight'"):
        copier.copy(named, timeout=0.2)
    assert time.monotonic() - t0 < 30   # generous: the wait is bounded, not forever
    copier.close()


def test_a_copier_dropped_unclosed_still_releases_its_staging():
    staging = Staging()
    copier = _copier(staging)
    copier.copy([("x", _random((3 * CHUNK,), torch.uint8, _gen()))], timeout=60)
    del copier
    gc.collect()
    assert staging.released == 1


def test_sources_not_staged_are_plain_copies():
    gen = _gen()
    named = [("c", _random((9, 9), torch.bfloat16, gen))]
    copier = HostCopier(chunk_bytes=CHUNK, alloc=Staging())   # stages CUDA tensors only
    out = copier.copy(named, timeout=5)
    assert _same_bytes(named[0][1], out[0]) and out[0].data_ptr() != named[0][1].data_ptr()
    assert copier.last["staged_bytes"] == 0 and copier.allocations == 0


def test_the_settings_size_the_staging_and_zero_turns_it_off(monkeypatch):
    monkeypatch.setenv("CKPT_HOST_COPY_MIB", "8")
    monkeypatch.setenv("CKPT_HOST_COPY_THREADS", "6")
    c = copier_from_settings()
    assert (c.chunk_bytes, c.chunks, c.threads) == (2 << 20, 4, 6)
    monkeypatch.setenv("CKPT_HOST_COPY_MIB", "0")
    assert copier_from_settings().chunk_bytes == 0
    for bad in ("-1", "x", "70000"):
        monkeypatch.setenv("CKPT_HOST_COPY_MIB", bad)
        with pytest.raises(ConfigError, match="CKPT_HOST_COPY_MIB"):
            copier_from_settings()
