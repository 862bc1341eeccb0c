"""The device encode (``delta/encode_device.py``, a trainer's versions on its own device) writes, for
every pair, the very payload the host encoder writes: same header, sections and chosen encoding, in
every wire dtype and encoding, at every density, for empty, 0-d, new and reshaped tensors. Run here
on the CPU through torch (the GPU runs the same ops: tests/gpu)."""

import pytest
import torch

from support.data import random_bits

from ckpt_core.checkpoint.safetensors import WIRE_DTYPES
from ckpt_core.delta import encode_device
from ckpt_core.delta.encode import ENCODINGS, apply_decoded, bytes_of, decode, encode_tensor
from ckpt_core.delta.encode_device import encode_on_device
from ckpt_core.errors import CheckpointFormatError, ConfigError

DTYPES = sorted({dt for dt in WIRE_DTYPES.values()}, key=str)




def _mutate(base, positions):
    new = base.clone()
    words = new.reshape(-1).view(torch.uint8).view(-1, base.element_size())
    words[positions, 0] ^= 1   # one bit of the first byte: a change in every dtype (bool: 0 <-> 1)
    return new


def _same(host, device):
    if host is None or device is None:
        return host is None and device is None
    return torch.equal(host, device.cpu())


def _check(pairs, force=None):
    got = encode_on_device(pairs, force=force)
    assert len(got) == len(pairs)
    for (new, old), (payload, info) in zip(pairs, got):
        want, want_info = encode_tensor(new, old, force=force)
        assert info == want_info, (info, want_info)
        assert _same(want, payload), f"{new.dtype} {list(new.shape)} {info}: the payloads differ"
        if payload is not None and old is not None and old.shape == new.shape and old.dtype == new.dtype:
            live = old.clone()
            apply_decoded(live, decode(payload, "t"))
            assert torch.equal(bytes_of(live.contiguous()), bytes_of(new.contiguous()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("encoding", ENCODINGS[1:])
def test_every_dtype_and_encoding_gives_the_host_encoders_payload(dtype, encoding):
    gen = torch.Generator().manual_seed(hash((str(dtype), encoding)) % 2**31)
    base = random_bits((37, 11), dtype, gen)
    new = _mutate(base, torch.randperm(base.numel(), generator=gen)[:40])
    _check([(new, base)], force=encoding)


@pytest.mark.parametrize("pattern", ["one", "sparse", "block", "scattered", "all", "far", "ends", "most"])
def test_the_encoding_chosen_by_size_is_the_host_encoders(pattern):
    gen = torch.Generator().manual_seed(7)
    n = 200_000 if pattern == "far" else 4096
    base = random_bits((n,), torch.bfloat16, gen)
    where = {"one": torch.tensor([5]), "sparse": torch.randperm(n, generator=gen)[: n // 100],
             "block": torch.arange(100, 900), "scattered": torch.randperm(n, generator=gen)[: n // 3],
             "all": torch.arange(n), "far": torch.tensor([3, 100_000, 199_999]),
             "ends": torch.tensor([0, n - 1]),
             "most": torch.randperm(n, generator=gen)[: n - 3]}[pattern]   # whole wins with a changed count < numel
    _check([(_mutate(base, where), base)])


def test_a_registration_of_many_tensors_unchanged_new_reshaped_empty_and_zero_d():
    gen = torch.Generator().manual_seed(11)
    pairs = []
    for i, shape in enumerate([(64, 32), (0,), (), (3, 0, 2), (128,), (16, 16)]):
        base = random_bits(shape, torch.bfloat16, gen)
        new = _mutate(base, torch.randperm(base.numel(), generator=gen)[: max(1, base.numel() // 20)]) \
            if base.numel() else base.clone()
        pairs.append((new, base if i % 3 else base.clone()))
    pairs.append((random_bits((8, 8), torch.float32, gen), None))                           # new
    pairs.append((random_bits((8, 8), torch.float32, gen), random_bits((64,), torch.float32, gen)))   # reshaped
    pairs.append((random_bits((8, 8), torch.float16, gen), random_bits((8, 8), torch.float32, gen)))  # retyped
    same = random_bits((32,), torch.bfloat16, gen)
    pairs.append((same, same.clone()))                                                  # unchanged
    _check(pairs)


def test_groups_are_bounded_and_give_the_same_payloads(monkeypatch):
    monkeypatch.setattr(encode_device, "_GROUP_ELEMENTS", 1000)
    gen = torch.Generator().manual_seed(3)
    pairs = []
    for _ in range(7):
        base = random_bits((700,), torch.bfloat16, gen)
        pairs.append((_mutate(base, torch.randperm(700, generator=gen)[:30]), base))
    _check(pairs)


def test_bad_pairs_are_refused_before_anything_is_encoded():
    t = torch.zeros(4, 4, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="contiguous"):
        encode_on_device([(t.t(), t)])
    with pytest.raises(CheckpointFormatError, match="no wire code"):
        encode_on_device([(torch.zeros(2, dtype=torch.uint8).view(torch.bits8), None)])
    with pytest.raises(ValueError, match="unknown encoding"):
        encode_on_device([(t, t)], force="zip")


def test_digests_the_caller_has_are_used_and_the_tensors_not_read_for_them(monkeypatch):
    """A version's record (``lin64`` per tensor, taken at its registration) is passed in: the payloads are the
    host encoder's all the same, and no digest of the new tensors is computed again."""
    from ckpt_core.delta.lin64 import lin64_many

    gen = torch.Generator().manual_seed(13)
    pairs = []
    for n in (300, 4096, 17):
        base = random_bits((n,), torch.bfloat16, gen)
        pairs.append((_mutate(base, torch.randperm(n, generator=gen)[: n // 10 + 1]), base))
    pairs.append((random_bits((8, 8), torch.float32, gen), None))   # new: whole
    known = lin64_many(new for new, _ in pairs)
    seen = []
    real = encode_device.lin64_many
    monkeypatch.setattr(encode_device, "lin64_many", lambda ts: seen.append(list(ts)) or real(seen[-1]))
    got = encode_on_device(pairs, digests=known)
    assert len(seen) == 1, "only the bodies' checks are digested"   # not the new tensors: their digests were given
    for (new, old), (payload, info) in zip(pairs, got):
        want, want_info = encode_tensor(new, old)
        assert info == want_info and torch.equal(want, payload)
    with pytest.raises(ValueError, match="3 digests for 4 tensors"):
        encode_on_device(pairs, digests=known[:3])
