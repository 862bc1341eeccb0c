"""A fold of a chain of deltas (``delta/fold.py``) turns the chain's oldest version into its newest bit
for bit, in every wire dtype: equal to ``encode_tensor(D, A)`` byte for byte when no element changes
back, a superset of it (harmless: D's values) when one does; new and reshaped tensors go whole, an
unchanged tensor sends nothing, and a corrupted step is refused naming its tensor."""

import numpy as np
import pytest
import torch

from ckpt_core.checkpoint.safetensors import WIRE_DTYPES
from ckpt_core.delta.encode import ENCODINGS, apply_decoded, bytes_of, decode, encode_changes, encode_tensor
from ckpt_core.delta.fold import fold_tensor, host_positions
from ckpt_core.delta.lin64 import lin64
from ckpt_core.errors import CheckpointFormatError

DTYPES = sorted({dt for dt in WIRE_DTYPES.values()}, key=str)


def _random(shape, dtype, gen):
    n = int(np.prod(shape))
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), generator=gen, dtype=torch.uint8)
    return (raw % 2).bool().reshape(shape) if dtype == torch.bool else raw.view(dtype).reshape(shape)


def _flip(t, positions):
    """``t`` with one bit of the first byte of each element at ``positions`` flipped: a change in every dtype
    (flipping it again gives the element back)."""
    new = t.clone()
    words = new.reshape(-1).view(torch.uint8).view(-1, t.element_size())
    words[torch.as_tensor(positions, dtype=torch.int64), 0] ^= 1
    return new


def _same(a, b):
    return torch.equal(bytes_of(a.contiguous()), bytes_of(b.contiguous()))


def _apply(base, payload):
    d = decode(payload)
    out = torch.empty(d.shape, dtype=d.dtype) if base is None or d.positions is None else base.clone()
    apply_decoded(out, d)
    assert d.digest == lin64(out)   # what the engine worker checks after the apply
    return out, d


def _chain(versions):
    return [encode_tensor(new, old)[0] for old, new in zip(versions, versions[1:])]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_fold_of_disjoint_steps_is_the_direct_delta_byte_for_byte(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (37, 53)
    n = 37 * 53
    a = _random(shape, dtype, gen)
    perm = torch.randperm(n, generator=gen)
    sizes = [int(x) for x in torch.randint(1, n // 4, (3,), generator=gen)]   # densities up to 25 % per step
    versions, at = [a], 0
    for k in sizes:   # each step changes positions no other step touches
        versions.append(_flip(versions[-1], perm[at: at + k]))
        at += k
    folded, info = fold_tensor(versions[-1], _chain(versions), "w")
    direct, direct_info = encode_tensor(versions[-1], a)
    assert folded is not None and torch.equal(folded, direct), (info, direct_info)
    out, _ = _apply(a, folded)
    assert _same(out, versions[-1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_overlapping_steps_and_elements_that_change_back_fold_to_the_newest_version(dtype):
    gen = torch.Generator().manual_seed(39)
    n = 4096
    a = _random((n,), dtype, gen)
    b = _flip(a, torch.randperm(n, generator=gen)[:400])
    c = _flip(b, torch.randperm(n, generator=gen)[:400])   # some of B's changes flipped back to A's value
    d = _flip(c, torch.randperm(n, generator=gen)[:50])
    folded, info = fold_tensor(d, _chain([a, b, c, d]), "w")
    out, dec = _apply(a, folded)
    assert _same(out, d)
    direct = decode(encode_tensor(d, a)[0]).positions
    assert set(direct.tolist()) <= set(dec.positions.tolist())   # a superset of the real changes...
    union = set()
    for old, new in ((a, b), (b, c), (c, d)):
        union |= set(torch.nonzero(bytes_of(new).view(-1, new.element_size()).ne(
            bytes_of(old).view(-1, old.element_size())).any(1)).reshape(-1).tolist())
    assert set(dec.positions.tolist()) == union   # ...exactly the chain's union
    assert info["count"] == len(union) > direct.numel()


def test_a_tensor_that_changes_back_to_its_base_is_sent_with_its_base_values():
    gen = torch.Generator().manual_seed(5)
    a = _random((1000,), torch.bfloat16, gen)
    pos = torch.randperm(1000, generator=gen)[:30]
    b = _flip(a, pos)
    c = _flip(b, pos)   # back to A
    assert encode_tensor(c, a)[0] is None
    folded, info = fold_tensor(c, _chain([a, b, c]), "w")
    out, dec = _apply(a, folded)
    assert _same(out, a) and info["count"] == 30   # A's bytes: the engine holds the same after the apply


def test_new_reshaped_and_unchanged_tensors():
    gen = torch.Generator().manual_seed(6)
    b = _random((64, 8), torch.bfloat16, gen)
    c = _flip(b, [3, 9])
    d = _flip(c, [100])
    # new in the chain (B's payload whole, against nothing): D's tensor goes whole
    steps = [encode_tensor(b, None)[0], encode_tensor(c, b)[0], encode_tensor(d, c)[0]]
    folded, info = fold_tensor(d, steps, "w")
    assert info["encoding"] == "whole"
    out, _ = _apply(None, folded)
    assert _same(out, d)
    # reshaped in the chain: whole
    a = _random((8, 64), torch.bfloat16, gen)
    folded, info = fold_tensor(d, [encode_tensor(b, a)[0], steps[1], steps[2]], "w")
    assert info["encoding"] == "whole" and _same(_apply(a, folded)[0], d)
    # no step changed it: nothing to send
    assert fold_tensor(d, [None, None], "w") == (None, {"encoding": None, "count": 0, "numel": 512, "bytes": 0})
    # a step that is not in the chain any more (None) between two that are
    folded, _ = fold_tensor(d, [steps[1], None, steps[2]], "w")
    assert _same(_apply(b, folded)[0], d)


def test_the_smallest_encoding_is_picked_as_encode_tensor_does():
    gen = torch.Generator().manual_seed(8)
    n = 1 << 16
    a = _random((n,), torch.bfloat16, gen)
    for k, want in ((300, "gap16"), (n // 5, "bitmap")):
        b = _flip(a, torch.randperm(n, generator=gen)[: k // 2])
        c = _flip(b, torch.randperm(n, generator=gen)[: k // 2])
        folded, info = fold_tensor(c, _chain([a, b, c]), "w")
        assert info["encoding"] == want and _same(_apply(a, folded)[0], c)
    block = _flip(a, torch.arange(1000, 9000))
    folded, info = fold_tensor(block, _chain([a, _flip(a, torch.arange(1000, 5000)), block]), "w")
    assert info["encoding"] == "runs" and _same(_apply(a, folded)[0], block)


def test_a_corrupted_step_is_refused_naming_its_tensor():
    gen = torch.Generator().manual_seed(9)
    a = _random((500,), torch.float32, gen)
    b = _flip(a, [1, 2, 3])
    c = _flip(b, [7])
    steps = _chain([a, b, c])
    steps[0] = steps[0].clone()
    steps[0][-1] ^= 0x5A
    with pytest.raises(CheckpointFormatError, match=r"body's check.*tensor 'r1.w'"):
        fold_tensor(c, steps, "r1.w")


def test_encode_changes_refuses_positions_out_of_order_or_range():
    t = torch.arange(10, dtype=torch.float32)
    for bad in ([3, 3], [5, 2], [-1], [10]):
        with pytest.raises(ValueError, match="strictly increasing and in range"):
            encode_changes(t, np.array(bad))
    assert encode_changes(t, np.array([], dtype=np.int64))[0] is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_the_hosts_decode_of_positions_is_the_engines(dtype, encoding):
    gen = torch.Generator().manual_seed(10)
    a = _random((3, 700), dtype, gen)
    b = _flip(a, torch.cat([torch.arange(5, 60), torch.randperm(2100, generator=gen)[:200]]).unique())
    payload, _ = encode_tensor(b, a, force=encoding)
    d, h = decode(payload), host_positions(payload)
    assert (h.dtype, h.shape, h.digest) == (d.dtype, d.shape, d.digest)
    assert (h.positions is None) == (d.positions is None)
    if d.positions is not None:
        assert np.array_equal(h.positions, d.positions.numpy())
    bad = payload.clone()
    bad[-1] ^= 0x5A
    with pytest.raises(CheckpointFormatError, match="body's check"):
        host_positions(bad, "w")
