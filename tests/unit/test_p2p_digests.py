"""P2P tensor digests: pieces hashed in parallel give one digest per tensor, and any changed byte changes it."""

import hashlib

import pytest
import torch

from ckpt_core.p2p import digests
from ckpt_core.p2p.digests import digest_of


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(digests, "PIECE_BYTES", 1000)


def _bytes(n, seed):
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_a_tensor_of_one_piece_is_its_sha256_and_a_larger_one_the_hash_of_its_pieces(small_pieces):
    small, large = _bytes(999, 1), _bytes(2500, 2)
    assert digest_of(small) == hashlib.sha256(small.numpy().tobytes()).digest()[:16].hex()
    parts = [hashlib.sha256(large[a:a + 1000].numpy().tobytes()).digest() for a in (0, 1000, 2000)]
    assert digest_of(large) == hashlib.sha256(b"ckpt-pieces:" + b"".join(parts)).digest()[:16].hex()


@pytest.mark.parametrize("where", [0, 999, 1000, 2499])
def test_one_changed_byte_in_any_piece_changes_the_digest(small_pieces, where):
    t = _bytes(2500, 3)
    before = digest_of(t)
    t[where] ^= 0xFF
    assert digest_of(t) != before


def test_many_tensors_hashed_together_equal_each_hashed_alone(small_pieces):
    views = [_bytes(n, n) for n in (0, 5, 1000, 1001, 4321)]
    assert digests.digests_of(views) == [digest_of(v) for v in views]


def test_a_bucket_is_refused_naming_the_tensor_whose_bytes_changed(small_pieces):
    class Meta:
        def __init__(self, name, nbytes):
            self.name, self.nbytes = name, nbytes

    class Placement:
        def __init__(self, name, offset, nbytes):
            self.meta, self.offset = Meta(name, nbytes), offset

    slot = _bytes(3000, 4)
    places = [Placement("a", 0, 1200), Placement("b", 1200, 1800)]
    published = {"a": digest_of(slot[:1200]), "b": digest_of(slot[1200:])}
    assert digests.bucket_mismatch(places, slot, published) is None
    slot[2000] ^= 1
    assert "'b' does not match" in digests.bucket_mismatch(places, slot, published)
    assert "no digest for tensor 'a'" in digests.bucket_mismatch(places, slot, {"b": published["b"]})
    assert "published no tensor digests" in digests.bucket_mismatch(places, slot, None)
