"""The delta's digest on CUDA (``ckpt_core/delta/lin64.py``): the same value as on the host in every
named dtype and at odd sizes, each single-element change detected on the device, a non-contiguous
device tensor refused, and the post-apply check of a delta scattered into a CUDA tensor computed
there (the host path is never taken) and failing when one changed element is dropped."""

import random

import pytest
import torch
from support.data import lin64_reference

import ckpt_core.delta.lin64 as lin
from ckpt_core.delta.apply import DeltaReceiver
from ckpt_core.delta.encode import encode_tensor
from ckpt_core.delta.lin64 import CHUNK, ROW, lin64, lin64_many
from ckpt_core.delta.versions import PAYLOAD, manifest_name
from ckpt_core.errors import CheckpointFormatError

pytestmark = pytest.mark.gpu

NAMED = [torch.bfloat16, torch.float16, torch.float32, torch.int8] + (
    [torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])


@pytest.fixture(autouse=True)
def one_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: lin64's device path runs on the tensor's CUDA device")


def _random(n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), generator=gen, dtype=torch.uint8).view(dtype)


@pytest.mark.parametrize("dtype", NAMED, ids=str)
def test_the_gpu_digest_equals_the_host_digest(dtype):
    for n in (0, 1, 7, ROW - 1, ROW + 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5):
        host = _random(n, dtype, n)
        assert lin64(host.cuda()) == lin64(host), (dtype, n)
    small = _random(ROW + 3, dtype, 1)
    assert lin64(small.cuda()) == lin64_reference(small)


@pytest.mark.parametrize("n", [4 * CHUNK - 1, 4 * CHUNK, 4 * CHUNK + 1, 4 * 3 * CHUNK + 5])
def test_the_gpu_digest_equals_the_host_digest_at_word_chunk_borders_and_unaligned(n):
    """lin64 reads 8-byte words (4 bf16 elements each): chunk borders in words, and a view whose bytes
    start inside a word of its storage (read through aligned copies of each chunk)."""
    host = _random(n, torch.bfloat16, n)
    dev = host.cuda()
    assert lin64(dev) == lin64(host)
    assert lin64(dev[1:]) == lin64(host[1:]) == lin64(host[1:].clone())
    assert lin64(dev[3:ROW + 5]) == lin64_reference(host[3:ROW + 5])


def test_many_digests_on_the_gpu_and_the_host_read_back_together():
    host = [_random(n, torch.bfloat16, n) for n in (3, ROW + 1, CHUNK + 7)]
    mixed = [host[0], host[1].cuda(), host[2].cuda()]
    assert lin64_many(mixed) == [lin64(t) for t in host]


@pytest.mark.parametrize("dtype", NAMED, ids=str)
def test_every_single_element_change_is_detected_on_the_device(dtype):
    rnd = random.Random(str(dtype))
    n = CHUNK + ROW + 3
    t = _random(n, dtype, 9).cuda()
    before = lin64(t)
    raw = t.view(torch.uint8)
    size = t.element_size()
    for i in [0, n - 1, CHUNK - 1, CHUNK] + [rnd.randrange(n) for _ in range(50)]:
        at = i * size + rnd.randrange(size)
        mask = 1 << rnd.randrange(8)
        raw[at] ^= mask
        assert lin64(t) != before, i
        raw[at] ^= mask
    assert lin64(t) == before


def test_a_non_contiguous_device_tensor_is_refused():
    t = torch.randn(256, 128, device="cuda").to(torch.bfloat16)
    with pytest.raises(CheckpointFormatError, match="contiguous"):
        lin64(t.t())


def test_the_post_apply_check_runs_on_the_device_and_catches_a_dropped_element(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(4096, 512, generator=gen).to(torch.bfloat16)
    new = base.clone()
    new.view(torch.int16).reshape(-1)[torch.randperm(new.numel(), generator=gen)[:5000]] ^= 0x21
    payload, _ = encode_tensor(new, base)
    # the bucket in device memory, as an engine receives it: its body check runs there too
    weights = [(manifest_name("A", "B", 0, 1), torch.zeros(1, dtype=torch.uint8)), (PAYLOAD + "w", payload.cuda())]
    live = {"w": base.cuda()}

    def no_host(*_a, **_k):
        raise AssertionError("the post-apply digest of a CUDA tensor went to the host")

    monkeypatch.setattr(lin, "_sum_numpy", no_host)

    def drive(rx):
        with rx.update(run=lambda ws: None) as cb:
            cb.on_plan([(n, t.dtype, tuple(t.shape)) for n, t in weights])
            cb.run(weights)
            cb.post_hook()

    rx = DeltaReceiver(live=live.get, held="A")
    monkeypatch.setenv("CKPT_TEST_DELTA_DROP_ONE", "1")
    with pytest.raises(CheckpointFormatError, match="do not match the version's digest"):
        drive(rx)
    assert torch.equal(live["w"].cpu(), base) and rx.held == "A"
    monkeypatch.delenv("CKPT_TEST_DELTA_DROP_ONE")
    drive(rx)
    assert torch.equal(live["w"].cpu().view(torch.int16), new.view(torch.int16)) and rx.held == "B"


def test_a_payload_in_device_memory_is_checked_there_and_a_corrupted_one_refused(monkeypatch):
    """decode() checks the body's lin64 on the payload's own device: no copy of the body to the host."""
    from ckpt_core.delta.encode import decode

    gen = torch.Generator().manual_seed(5)
    base = torch.randn(512, 512, generator=gen).to(torch.bfloat16)
    new = base.clone()
    new.view(-1)[::37] += 1
    payload, _ = encode_tensor(new, base)
    host = decode(payload, "w")
    moved = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: moved.append(t.numel()) or real_cpu(t, *a, **k))
    dev = decode(payload.cuda(), "w")
    monkeypatch.undo()   # what follows reads the result back on purpose
    assert max(moved, default=0) < 4096, moved   # only the header comes to the host
    assert dev.count == host.count and torch.equal(dev.positions.cpu(), host.positions)
    bad = payload.cuda()
    bad[-3] ^= 0x10
    with pytest.raises(CheckpointFormatError, match="body's check"):
        decode(bad, "w")


@pytest.mark.parametrize("encoding", ["idx", "gap16", "bitmap", "runs"])
def test_a_bucket_decoded_on_the_device_equals_the_host_decode_and_refuses_a_bad_bitmap(encoding):
    """decode_many on CUDA payloads (nonzero_static, runs expanded without a size read back) gives the
    host's positions; a bitmap marking one element more than its count is refused there too."""
    from ckpt_core.delta import encode as enc
    from ckpt_core.delta.encode import decode_many

    gen = torch.Generator().manual_seed(7)
    payloads = []
    for i, n in enumerate((4096, 777, 20_000)):
        base = torch.randn(n, generator=gen).to(torch.bfloat16)
        new = base.clone()
        new.view(torch.int16)[torch.randperm(n, generator=gen)[: n // 20]] ^= 1
        payloads.append((f"t{i}", encode_tensor(new, base, force=encoding)[0]))
    host = decode_many(payloads)
    dev = decode_many([(n, p.cuda()) for n, p in payloads])
    for h, d in zip(host, dev):
        assert torch.equal(d.positions.cpu(), h.positions) and torch.equal(d.values.cpu(), h.values)
    if encoding == "bitmap":
        header, start = enc.read_header(payloads[0][1])
        body = bytes(payloads[0][1][start:].numpy())
        at = next(i for i, b in enumerate(body) if b != 0xFF)
        body = body[:at] + bytes([body[at] | (body[at] + 1)]) + body[at + 1:]
        bad = enc._payload({k: v for k, v in header.items() if k not in ("body", "check")}, body)
        with pytest.raises(CheckpointFormatError, match=r"bitmap marks \d+ elements, header says"):
            decode_many([("w", bad.cuda())])

