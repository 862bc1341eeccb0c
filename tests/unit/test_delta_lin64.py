"""The delta's post-apply digest (``ckpt_core/delta/lin64.py``): its definition (a plain-Python
reference) computed alike by the numpy and the torch paths in every wire dtype and at chunk
borders, every single-element change detected, a non-contiguous tensor refused, a payload without a
lin64 digest refused, and an apply that drops one changed element refused and undone."""

import random

import pytest
import torch
from support.data import lin64_reference

import ckpt_core.delta.lin64 as lin
from ckpt_core.checkpoint.safetensors import WIRE_DTYPES
from ckpt_core.delta.apply import DeltaReceiver
from ckpt_core.delta.encode import decode, encode_tensor, read_header
from ckpt_core.delta.lin64 import CHUNK, ROW, is_lin64, lin64, lin64_many
from ckpt_core.delta.versions import PAYLOAD, manifest_name
from ckpt_core.errors import CheckpointFormatError, ConfigError

DTYPES = sorted({dt for dt in WIRE_DTYPES.values()}, key=str)
NAMED = [torch.bfloat16, torch.float16, torch.float32, torch.int8] + (
    [torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])


def _random(n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), generator=gen, dtype=torch.uint8)
    return (raw % 2).bool() if dtype == torch.bool else raw.view(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_both_paths_compute_the_definition_in_every_wire_dtype(dtype):
    for n in (0, 1, 7, ROW - 1, ROW, ROW + 1, 2 * ROW + 5):
        t = _random(n, dtype, n)
        want = lin64_reference(t)
        assert is_lin64(want)
        assert lin64(t) == want and lin64(t, engine="torch") == want, (dtype, n)


# lin64 reads 8-byte words: a bf16 tensor has 4 elements per word
@pytest.mark.parametrize("n", [4 * 3 * 2 * ROW - 1, 4 * 3 * 2 * ROW, 4 * 3 * 2 * ROW + 1, 4 * 5 * 2 * ROW + 7,
                               4 * 2 * ROW + 3, 4 * ROW - 2])
def test_chunk_borders_and_the_thread_pool_keep_the_definition(monkeypatch, n):
    monkeypatch.setattr(lin, "CHUNK", 2 * ROW)              # chunks of two rows: many chunks, small tensors
    monkeypatch.setattr(lin, "_NP_THREADS_MIN_WORDS", 1)   # and the numpy path on its thread pool
    monkeypatch.setenv("PS_DELTA_THREADS", "3")
    t = _random(n, torch.bfloat16, n)
    want = lin64_reference(t)
    assert lin.lin64(t) == want and lin.lin64(t, engine="torch") == want


@pytest.mark.parametrize("offset", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("chunk", [None, 2 * ROW])
def test_bytes_not_8_byte_aligned_in_their_storage_keep_the_definition(monkeypatch, offset, chunk):
    """A contiguous view starting inside a word of its storage (a slice of a fused parameter, a payload's
    body at an odd offset): the torch path reads it through aligned copies of each chunk."""
    if chunk:
        monkeypatch.setattr(lin, "CHUNK", chunk)
    store = _random(4 * 5 * ROW + 13, torch.int8, offset)
    view = store[offset:]
    assert view.storage_offset() % 8
    want = lin64_reference(view)
    assert lin64(view) == want and lin64(view, engine="torch") == want == lin64(view.clone())
    halves = _random(4 * 3 * ROW + 3, torch.bfloat16, offset)[offset:]   # 2 * offset bytes in
    assert lin64(halves, engine="torch") == lin64_reference(halves) == lin64(halves)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 9, 4 * ROW - 1, 4 * ROW + 1])
def test_the_paths_agree_at_odd_sizes(n):
    for dtype in NAMED + [torch.float64]:
        t = _random(n, dtype, n + 1)
        assert lin64(t) == lin64(t, engine="torch"), (dtype, n)


@pytest.mark.parametrize("words", [CHUNK - 1, CHUNK + 1])
@pytest.mark.parametrize("extra", [0, 1])
def test_the_paths_agree_at_the_real_chunk(words, extra):
    t = _random(4 * words + extra, torch.bfloat16, words + extra)
    assert lin64(t) == lin64(t, engine="torch")


def test_many_digests_read_back_together_equal_each_one():
    tensors = [_random(n, dt, n) for n, dt in [(5, torch.bfloat16), (ROW + 9, torch.float32), (0, torch.int8),
                                                 (3 * ROW, torch.float16)]]
    want = [lin64_reference(t) for t in tensors]
    assert lin64_many(tensors) == want
    assert lin64_many((t for t in tensors), engine="torch") == want   # a generator, the device path
    assert lin64_many([]) == []


def test_the_digest_depends_on_the_width_and_count_not_only_the_values():
    zeros = [lin64(torch.zeros(8, dtype=dt)) for dt in (torch.int8, torch.int16, torch.int32, torch.int64)]
    assert len(set(zeros)) == 4
    assert lin64(torch.zeros(8, dtype=torch.int16)) != lin64(torch.zeros(9, dtype=torch.int16))
    assert lin64(torch.zeros(4, dtype=torch.bfloat16)) == lin64(torch.zeros(4, dtype=torch.float16))   # bytes + width


@pytest.mark.parametrize("dtype", NAMED + [torch.float64, torch.int64, torch.int32, torch.bool], ids=str)
def test_every_single_element_change_is_detected(dtype):
    rnd = random.Random(str(dtype))
    n = 3 * ROW + 11
    t = _random(n, dtype, 7)
    before = lin64(t)
    size = t.element_size()
    positions = [0, n - 1, ROW - 1, ROW, 2 * ROW] + [rnd.randrange(n) for _ in range(200)]
    for i in positions:
        byte = rnd.randrange(size)
        mask = 1 << rnd.randrange(8)
        raw = t.view(torch.uint8)
        raw[i * size + byte] ^= mask
        assert lin64(t) != before, (i, byte, mask)
        raw[i * size + byte] ^= mask
    assert lin64(t) == before


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_every_element_replaced_by_any_other_value_is_detected(size):
    """The proof's case, whole elements: element i of item size 1-8 lies in one 8-byte word at byte
    (i * size) % 8; replacing all its bytes (the extremes too: 0, all ones, only the top bit differing)
    moves the digest, at every byte position in a word, in the padded last word, on both paths."""
    rnd = random.Random(size)
    n = (2 * ROW * 8 + 5 * size + 3) // size   # the last word is partial
    words = _random(n, {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size], size)
    raw = words.view(torch.uint8)
    before = lin64(words)
    for i in list(range(8 // size)) + [n - 1, n - 2, ROW * 8 // size] + [rnd.randrange(n) for _ in range(60)]:
        old = bytes(raw[i * size: (i + 1) * size].tolist())
        for new in (bytes(size), b"\xff" * size, bytes(old[:-1]) + bytes([old[-1] ^ 0x80]),
                    bytes(rnd.randrange(256) for _ in range(size))):
            if new == old:
                continue
            raw[i * size: (i + 1) * size] = torch.tensor(list(new), dtype=torch.uint8)
            assert lin64(words) != before and lin64(words, engine="torch") != before, (i, new)
            raw[i * size: (i + 1) * size] = torch.tensor(list(old), dtype=torch.uint8)
    assert lin64(words) == before


def test_large_tensor_flips_at_random_positions_are_detected():
    n = CHUNK + ROW + 3
    t = _random(n, torch.bfloat16, 3)
    words = t.view(torch.int16)
    before = lin64(t)
    for i in random.Random(5).sample(range(n), 20) + [CHUNK - 1, CHUNK, n - 1]:
        old = int(words[i])
        words[i] = old ^ 0x4000   # the sign or exponent: a large change, not only the low bit
        assert lin64(t) != before, i
        words[i] = old
    assert lin64(t) == before


def test_a_non_contiguous_tensor_is_refused_never_copied():
    t = torch.randn(64, 32).to(torch.bfloat16)
    for view in (t.t(), t[:, ::2], t[::2]):
        with pytest.raises(CheckpointFormatError, match="contiguous"):
            lin64(view)
    assert lin64(t[2:5]) == lin64(t[2:5].clone())   # a contiguous view is digested where it lies


def test_the_payload_carries_lin64_and_decode_refuses_another_digest():
    base = torch.randn(4096).to(torch.bfloat16)
    new = base.clone()
    new.view(torch.int16)[17] ^= 3
    payload, _ = encode_tensor(new, base)
    header, _ = read_header(payload)
    assert header["digest"] == lin64(new) == decode(payload, "w").digest
    sha = "0123456789abcdef0123456789abcdef"   # a SHA-256 digest cut to 16 bytes, as before issue 39's lin64
    text = bytes(payload.numpy()).replace(header["digest"].encode(), f"{sha[:22]}".encode())
    with pytest.raises(CheckpointFormatError, match="not a lin64 digest"):
        decode(torch.frombuffer(bytearray(text), dtype=torch.uint8), "w")
    with pytest.raises(ConfigError, match="lin64"):
        encode_tensor(new, base, digest=sha)


def _delta(base, new):
    weights = [(manifest_name("A", "B", 0, 1), torch.zeros(1, dtype=torch.uint8))]
    for n in base:
        payload, _ = encode_tensor(new[n], base[n])
        if payload is not None:
            weights.append((PAYLOAD + n, payload))
    return weights


def _drive(rx, weights):
    with rx.update(run=lambda ws: None, version=None) as cb:
        cb.on_plan([(n, t.dtype, tuple(t.shape)) for n, t in weights])
        cb.run(weights)
        cb.post_hook()


def test_an_apply_that_drops_one_changed_element_fails_the_check_and_is_undone(monkeypatch):
    gen = torch.Generator().manual_seed(11)
    base = {"s": torch.randn(128, 64, generator=gen).to(torch.bfloat16),
            "w": torch.randn(64, generator=gen).half()}
    new = {n: t.clone() for n, t in base.items()}
    for n, t in new.items():
        t.view(torch.int16).reshape(-1)[torch.randperm(t.numel(), generator=gen)[:9]] ^= 0x55
    live = {"s": base["s"].clone(), "w": base["w"].float()}   # w held widened, as vLLM-CPU does
    rx = DeltaReceiver(live=live.get, held="A")
    monkeypatch.setenv("CKPT_TEST_DELTA_DROP_ONE", "1")
    with pytest.raises(CheckpointFormatError, match="do not match the version's digest") as err:
        _drive(rx, _delta(base, new))
    assert "lin64:" in str(err.value)
    assert torch.equal(live["s"], base["s"]) and torch.equal(live["w"], base["w"].float()) and rx.held == "A"
    monkeypatch.delenv("CKPT_TEST_DELTA_DROP_ONE")
    _drive(rx, _delta(base, new))
    assert torch.equal(live["s"].view(torch.int16), new["s"].view(torch.int16))
    assert torch.equal(live["w"], new["w"].float()) and rx.held == "B"


@pytest.mark.parametrize("cuts", [[], [8], [13, 8 * ROW + 5], [8 * ROW, 16 * ROW], [3, 7, 8 * ROW * 3 - 1, 10**9]])
def test_the_host_digest_in_parts_is_the_digest_wherever_the_parts_end(cuts):
    """The PS's encode digests a tensor block by block as it compares it (``HostDigest``): any cuts,
    at or between word and row borders, give lin64 of the whole."""
    for dtype in (torch.bfloat16, torch.int8, torch.float32):
        t = _random(5 * ROW + 3, dtype, len(cuts))
        parts = lin.HostDigest(t)
        for c in cuts:
            parts.upto(c)
        assert parts.digest() == lin64(t) == lin64_reference(t), (dtype, cuts)


def test_the_encode_digests_the_new_tensor_as_it_compares_it(monkeypatch):
    import ckpt_core.delta._changes as changes

    monkeypatch.setattr(changes, "_BLOCK", 1000)   # many blocks; the first change in a later one
    base = _random(4 * ROW + 1, torch.bfloat16, 9)
    new = base.clone()
    new.view(torch.int16)[[3500, 3501, 9000]] ^= 5
    payload, _ = encode_tensor(new, base)
    assert read_header(payload)[0]["digest"] == lin64(new) == lin64_reference(new)


def test_many_small_tensors_digested_together_on_a_device_equal_each_digest():
    """queue_many (a bucket's payload bodies on a GPU): concatenated, each word's coefficient from its
    index in its own tensor; any sizes (empty, not whole words, over a row), alone or many."""
    sizes = [0, 1, 7, 8, 13, 8 * ROW - 1, 8 * ROW + 9, 3 * 8 * ROW, 5]
    tensors = [_random(n, torch.uint8, n) for n in sizes] + [_random(77, torch.bfloat16, 1)]
    for group in (tensors, tensors[::-1], tensors[5:6], tensors[:1]):
        queued = lin.queue_many(group, engine="torch")
        got = [q.digest(v) for q, v in zip(queued, lin.read_ints([q.total for q in queued]))]
        assert got == [lin64_reference(t) for t in group]
    assert lin.queue_many([]) == []


@pytest.mark.parametrize("n", [0, 5, 8, 8 * ROW + 3])
def test_the_host_digest_of_raw_bytes_is_the_tensor_digest(n):
    """lin64_host (the encode's payload bodies, a numpy array of bytes) names the same digest."""
    t = _random(n, torch.uint8, n)
    assert lin.lin64_host(t.numpy()) == lin64(t) == lin64_reference(t)
    halves = _random(n, torch.bfloat16, n)
    assert lin.lin64_host(halves.view(torch.uint8).numpy(), 2) == lin64(halves)
