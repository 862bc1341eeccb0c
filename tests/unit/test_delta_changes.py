"""The PS's encode finds changes in numpy (``delta/_changes.py``): the same positions as a plain
compare at every block border and for items wider than 8 bytes, the gaps, runs and run bounds the
encodings are chosen by, and a registration's tensors encoded on the thread pool exactly as one by one."""

import numpy as np
import pytest
import torch

import ckpt_core.delta._changes as changes
from ckpt_core.delta._changes import Changes, changed_positions
from ckpt_core.delta.versions import DeltaVersions


@pytest.mark.parametrize("block", [7, 64, 1 << 18])
@pytest.mark.parametrize("dtype", [np.int16, np.uint8, np.int64])
def test_changed_positions_equal_a_plain_compare_at_every_block_border(monkeypatch, block, dtype):
    monkeypatch.setattr(changes, "_BLOCK", block)
    rng = np.random.default_rng(block)
    old = rng.integers(0, 100, 5000).astype(dtype)
    new = old.copy()
    hit = np.unique(np.concatenate([rng.integers(0, 5000, 200), [0, block - 1, block, 4999]]))
    hit = hit[hit < 5000]
    new[hit] += 1
    got = changed_positions(new, old)
    assert got.dtype == np.int64 and np.array_equal(got, np.flatnonzero(new != old)) and np.array_equal(got, hit)
    assert changed_positions(old, old).size == 0


def test_items_wider_than_a_word_change_when_any_of_their_words_does():
    old = np.arange(40, dtype=np.int64).reshape(20, 2)
    new = old.copy()
    new[3, 1] += 1
    new[17, 0] -= 5
    assert changed_positions(new, old).tolist() == [3, 17]


def test_gaps_runs_and_run_bounds():
    ch = Changes.of(np.array([2, 3, 4, 9, 70_000, 70_001], dtype=np.int64))
    assert ch.gaps.tolist() == [2, 1, 1, 5, 69_991, 1]
    assert (ch.max_gap, ch.runs) == (69_991, 3)
    starts, lengths = ch.run_bounds()
    assert starts.tolist() == [2, 9, 70_000] and lengths.tolist() == [3, 1, 2]
    empty = Changes.of(np.empty(0, dtype=np.int64))
    assert (empty.max_gap, empty.runs) == (0, 0)


def test_a_registration_encodes_its_tensors_on_threads_exactly_as_one_by_one(monkeypatch):
    """``DeltaVersions.encode`` (all tensors together, ``delta/batch.py``) on one thread and on three:
    the companion's tensors are ``encode_tensor``'s payload of each changed tensor, and the manifest."""
    from ckpt_core.checkpoint.sources import build_checkpoint
    from ckpt_core.delta import _payload_vector, batch
    from ckpt_core.delta.encode import encode_tensor
    from ckpt_core.devices import get_backend

    gen = torch.Generator().manual_seed(3)
    base = {f"t{i}": torch.randn(1000 + 37 * i, generator=gen).to(torch.bfloat16) for i in range(20)}
    new = {n: t.clone() for n, t in base.items()}
    for i, t in enumerate(new.values()):
        if i % 5:   # every fifth tensor unchanged
            t.view(torch.int16)[torch.randperm(t.numel(), generator=gen)[: 3 + i]] ^= 1
    new["fresh"] = torch.randn(77, generator=gen).half()
    backend = get_backend("cpu")
    a = build_checkpoint("A", backend, named_tensors=base)
    b = build_checkpoint("B", backend, named_tensors=new)
    monkeypatch.setattr(batch, "_THREADS_MIN_WORDS", 0)   # small tensors: threads all the same
    monkeypatch.setattr(_payload_vector, "_THREADS_MIN_ELEMENTS", 0)
    monkeypatch.setattr(batch, "_PIECE_WORDS", 256)
    out = {}
    try:
        for threads in ("1", "3"):
            monkeypatch.setenv("PS_DELTA_THREADS", threads)
            out[threads] = {n: t.clone() for n, t in DeltaVersions(0, 1).encode("B", b, "A", a).items()}
        assert list(out["1"]) == list(out["3"]) and len(out["1"]) == 16 + 1 + 1   # changed, fresh, manifest
        assert all(torch.equal(out["1"][n], out["3"][n]) for n in out["1"])
        for n, t in new.items():
            want, _ = encode_tensor(t, base.get(n))
            got = out["1"].get(f"ckpt.delta:{n}")
            assert (want is None and got is None) or torch.equal(got, want), n
    finally:
        a.release()
        b.release()
