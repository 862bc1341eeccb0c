"""A delta payload turns the base into the new version bit for bit, in every dtype and encoding,
is no larger than the tensor, and a corrupted payload is refused before anything is written."""

import pytest
import torch

from support.data import random_bits

from ckpt_core.checkpoint.safetensors import WIRE_DTYPES
from ckpt_core.delta.encode import (ENCODINGS, apply_decoded, bytes_of, changed_mask, decode, encode_tensor,
                                    undo_decoded)
from ckpt_core.delta.lin64 import lin64
from ckpt_core.errors import CheckpointFormatError

DTYPES = sorted({dt for dt in WIRE_DTYPES.values()}, key=str)




def _mutate(base, density, gen):
    new = base.clone()
    words = new.reshape(-1).view(torch.uint8).view(-1, base.element_size())
    n = base.numel()
    k = int(n * density)
    if k:
        pos = torch.randperm(n, generator=gen)[:k]
        words[pos, 0] ^= 1   # flip one bit of the first byte: a change in every dtype (bool: 0 <-> 1)
    return new


def _same_bytes(a, b):
    return torch.equal(bytes_of(a.contiguous()), bytes_of(b.contiguous()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("encoding", ENCODINGS[1:])
def test_every_dtype_round_trips_in_every_encoding(dtype, encoding):
    gen = torch.Generator().manual_seed(hash((str(dtype), encoding)) % 2**31)
    base = random_bits((37, 11), dtype, gen)
    new = _mutate(base, 0.1, gen)
    payload, info = encode_tensor(new, base, force=encoding)
    assert info["encoding"] == encoding and info["count"] == int(changed_mask(new, base).sum()) > 0
    d = decode(payload, "t")
    live = base.clone()
    old = apply_decoded(live, d)
    assert _same_bytes(live, new) and lin64(live) == d.digest
    undo_decoded(live, d, old)
    assert _same_bytes(live, base)


@pytest.mark.parametrize("density", [0.0005, 0.01, 0.03, 0.2, 0.6, 1.0])
def test_the_smallest_encoding_is_chosen_and_never_larger_than_the_tensor(density):
    gen = torch.Generator().manual_seed(int(density * 1e4))
    base = random_bits((256, 512), torch.bfloat16, gen)
    new = _mutate(base, density, gen)
    payload, info = encode_tensor(new, base)
    sizes = {e: encode_tensor(new, base, force=e)[0].numel() for e in ENCODINGS[1:]}
    assert payload.numel() <= min(sizes.values())
    assert payload.numel() <= new.numel() * 2 + 4096   # a dense delta goes whole: tensor + header
    if density == 1.0:   # bf16: a bitmap pays off up to 15/16 of the elements changed
        assert info["encoding"] == "whole" and info["count"] == new.numel()
    dense = _mutate(base, 0.97, gen)   # most, not all, changed: sent whole, applied whole
    dense_payload, dense_info = encode_tensor(dense, base)
    assert dense_info["encoding"] == "whole" and dense_info["count"] < dense.numel()
    live = base.clone()
    apply_decoded(live, decode(dense_payload))
    assert _same_bytes(live, dense)
    live = base.clone()
    apply_decoded(live, decode(payload))
    assert _same_bytes(live, new)


def test_runs_win_on_a_contiguous_block_and_bitmap_on_scattered_changes():
    gen = torch.Generator().manual_seed(3)
    base = random_bits((1 << 16,), torch.bfloat16, gen)
    block = base.clone()
    block.view(torch.int16)[1000:3000] ^= 1
    assert encode_tensor(block, base)[1]["encoding"] == "runs"
    assert encode_tensor(_mutate(base, 0.2, gen), base)[1]["encoding"] == "bitmap"
    assert encode_tensor(_mutate(base, 0.01, gen), base)[1]["encoding"] == "gap16"
    far = torch.zeros(1 << 20, dtype=torch.bfloat16)
    sparse = far.clone()
    sparse.view(torch.int16)[[5, 300_000, 900_000]] = 1   # gaps beyond 16 bits: positions as int32
    assert encode_tensor(sparse, far)[1]["encoding"] == "idx"
    with pytest.raises(ValueError, match="gap16"):
        encode_tensor(sparse, far, force="gap16")
    live = far.clone()
    apply_decoded(live, decode(encode_tensor(sparse, far)[0]))
    assert _same_bytes(live, sparse)


def test_unchanged_tensor_sends_nothing_and_bytes_not_values_decide():
    x = torch.tensor([1.0, float("nan"), 0.0, 2.0], dtype=torch.float32)
    assert encode_tensor(x.clone(), x) == (None, {"encoding": None, "count": 0, "numel": 4, "bytes": 0})
    y = x.clone()
    y[2] = -0.0   # equal as a value, different bytes: a change
    payload, info = encode_tensor(y, x)
    assert info["count"] == 1
    z = x.clone()
    z.view(torch.int32)[1] ^= 1   # another NaN: a change
    assert encode_tensor(z, x)[1]["count"] == 1


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,)])
def test_empty_and_zero_d_tensors(shape):
    gen = torch.Generator().manual_seed(5)
    base = random_bits(shape, torch.bfloat16, gen)
    new = _mutate(base, 1.0, gen)
    payload, info = encode_tensor(new, base)
    if base.numel() == 0:
        assert payload is None
        payload, info = encode_tensor(new, None)   # a new empty tensor still goes (whole, 0 bytes of body)
    live = torch.empty_like(base) if base.numel() == 0 else base.clone()
    apply_decoded(live, decode(payload))
    assert _same_bytes(live, new) and tuple(live.shape) == shape


def test_new_or_reshaped_tensors_go_whole():
    gen = torch.Generator().manual_seed(7)
    new = random_bits((4, 6), torch.float16, gen)
    for old in (None, new.reshape(6, 4).clone(), new.float()):
        payload, info = encode_tensor(new, old)
        assert info["encoding"] == "whole"
        d = decode(payload)
        live = torch.empty_like(new)
        apply_decoded(live, d)
        assert _same_bytes(live, new)


def test_large_sparse_tensor_round_trips():
    gen = torch.Generator().manual_seed(11)
    base = random_bits((1 << 22,), torch.bfloat16, gen)
    new = _mutate(base, 0.02, gen)
    payload, info = encode_tensor(new, base)
    assert info["encoding"] == "gap16" and payload.numel() < 0.05 * base.numel() * 2   # 4 bytes per change
    live = base.clone()
    apply_decoded(live, decode(payload))
    assert _same_bytes(live, new)


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("where", ["magic", "header", "body", "truncated", "appended"])
def test_a_corrupted_payload_is_refused(encoding, where):
    gen = torch.Generator().manual_seed(13)
    base = random_bits((64, 64), torch.bfloat16, gen)
    new = _mutate(base, 0.05, gen)
    payload, _ = encode_tensor(new, None if encoding == "whole" else base, force=None if encoding == "whole" else encoding)
    bad = payload.clone()
    if where == "magic":
        bad[0] ^= 0xFF
    elif where == "header":
        bad[12] ^= 0x01
    elif where == "body":
        bad[-3] ^= 0x10
    elif where == "truncated":
        bad = bad[:-8]
    else:
        bad = torch.cat([bad, torch.zeros(8, dtype=torch.uint8)])
    with pytest.raises(CheckpointFormatError, match="delta payload refused.*'w'"):
        decode(bad, "w")
