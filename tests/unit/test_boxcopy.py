"""The owner's copy of a slice (``planning/boxcopy.py``): a box of a host tensor as pitched copies,
none crossing a pinned piece's border, issued by the CPU backend; bit-exact against torch's own
narrowing, over random shapes, boxes, dtypes and piece sizes."""

import random

import pytest
import torch

from ckpt_core.devices.cpu import CpuBackend
from support.boxcopy_cases import experts_layer
from ckpt_core.planning.boxcopy import Pitched, box_copies, byte_dims, copied_bytes, merge_copies


def _case(rng: random.Random):
    ndim = rng.randint(1, 4)
    shape = [rng.randint(1, 7) for _ in range(ndim)]
    offsets, extent = [], []
    for n in shape:
        if rng.random() < 0.5:
            offsets.append(0)
            extent.append(n)
        else:
            a = rng.randrange(n)
            offsets.append(a)
            extent.append(rng.randint(1, n - a))
    return shape, offsets, extent


def _reference(host: torch.Tensor, base_offset: int, shape, offsets, extent, dtype) -> torch.Tensor:
    n = 1
    for x in shape:
        n *= x
    t = host[base_offset: base_offset + n * dtype.itemsize].view(dtype).view(shape)
    for d, (o, e) in enumerate(zip(offsets, extent)):
        t = t.narrow(d, o, e)
    return t.contiguous().view(torch.uint8).reshape(-1)


@pytest.mark.parametrize("seed", range(6))
def test_random_boxes_pack_bit_exact_and_no_copy_crosses_a_pinned_piece(seed):
    rng = random.Random(seed)
    backend = CpuBackend()
    host = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    for _ in range(150):
        dtype = rng.choice([torch.uint8, torch.bfloat16, torch.float32, torch.float64])
        shape, offsets, extent = _case(rng)
        chunk = rng.choice([16, 24, 64, 1 << 20])
        base = rng.randrange(0, 4096) * dtype.itemsize
        at = rng.randrange(0, 64)
        copies = box_copies(shape, offsets, extent, dtype.itemsize, base_offset=base, dst=at, pin_chunk=chunk)
        want = _reference(host, base, shape, offsets, extent, dtype)
        assert copied_bytes(copies) == want.numel()
        for c in copies:   # the source bytes of every copy lie inside one piece
            first, last = c.src, c.src + (c.height - 1) * c.pitch + c.width - 1
            assert first // chunk == last // chunk, (shape, offsets, extent, chunk, c)
        dst = torch.zeros(at + want.numel() + 8, dtype=torch.uint8)
        backend.copy_pitched(dst, host, copies)
        assert torch.equal(dst[at: at + want.numel()], want), (shape, offsets, extent, dtype, chunk)
        assert not dst[:at].any() and not dst[at + want.numel():].any()


def test_a_column_slice_is_one_pitched_copy_and_a_row_slice_one_run():
    # 8 rows of 6 float32; columns 3..5 of every row: 8 rows of 12 bytes, 24 bytes apart
    assert box_copies((8, 6), (0, 3), (8, 3), 4) == [Pitched(12, 24, 12, 8, 0, 0)]
    # rows 4..7: one run of 96 bytes
    assert box_copies((8, 6), (4, 0), (4, 6), 4) == [Pitched(96, 0, 96, 1, 0, 0)]
    # a 3-D expert tensor [experts, rows, cols], one expert's rows 2..3: one run
    assert box_copies((4, 5, 6), (1, 2, 0), (1, 2, 6), 2) == [Pitched(84, 0, 24, 1, 0, 0)]
    # the columns 0..1 of two whole experts: their rows are evenly spaced, one pitched copy
    assert box_copies((4, 5, 6), (0, 0, 0), (2, 5, 2), 2) == [Pitched(0, 12, 4, 10, 0, 0)]
    # ... of rows 1..2 of two experts: a pitched block per expert (the outer dimension unrolled)
    assert box_copies((4, 5, 6), (0, 1, 0), (2, 2, 2), 2) == [Pitched(12, 12, 4, 2, 0, 0), Pitched(72, 12, 4, 2, 8, 0)]


def test_dimensions_that_follow_each_other_merge_and_size_one_ones_drop():
    assert byte_dims((2, 3, 4), (0, 0, 0), (2, 3, 4), 2) == (0, [(48, 1)])
    assert byte_dims((2, 3, 4), (1, 0, 0), (1, 3, 4), 2) == (24, [(24, 1)])
    assert byte_dims((2, 3, 4), (0, 1, 0), (2, 2, 4), 2) == (8, [(2, 24), (16, 1)])


def test_a_run_longer_than_a_piece_is_cut_at_every_border():
    copies = box_copies((100,), (0,), (100,), 1, base_offset=10, pin_chunk=32)
    assert [(c.src, c.width) for c in copies] == [(10, 22), (32, 32), (64, 32), (96, 14)]
    assert [c.dst for c in copies] == [0, 22, 54, 86]


def test_an_empty_box_copies_nothing():
    assert box_copies((4, 0), (0, 0), (4, 0), 4) == []


# ------------------------------------------------------------------ merged copies (issue 38)
def _apply(copies, host: torch.Tensor, size: int) -> torch.Tensor:
    dst = torch.zeros(size, dtype=torch.uint8)
    CpuBackend().copy_pitched(dst, host, copies)
    return dst


def test_a_layer_of_experts_slices_is_one_copy_per_kind_of_contiguous_slice_plus_the_strided_ones():
    """Engine rank 1's slices of 16 experts: their gate rows follow each other at one step in host and
    bucket, so do the up rows; the down columns are a pitched block each, at one step too: 48 copies
    become 3, the down slices one copy of 16 blocks."""
    copies, host_bytes, size = experts_layer(16, 64, 48, t=1, tp=4)
    merged = merge_copies(copies)
    assert len(copies) == 48 and len(merged) == 2 + 1
    assert sorted(c.height for c in merged if c.dpitch) == [16, 16]
    down = [c for c in merged if c.depth > 1]
    assert [(c.depth, c.height, c.width, c.pitch, c.step) for c in down] == [(16, 48, 32, 128, 3 * 64 * 48 * 2)]
    host = torch.randint(0, 256, (host_bytes,), dtype=torch.uint8)
    assert torch.equal(_apply(merged, host, size), _apply(copies, host, size))


@pytest.mark.parametrize("seed", range(4))
def test_merged_copies_put_the_same_bytes_in_the_same_places_and_none_crosses_a_pinned_piece(seed):
    """Random boxes of tensors that lie back to back in host memory (the same kind of box often
    again, as experts repeat), packed one after another with or without gaps: merged, the same
    bytes land in the same places, from no more copies, none across a piece of pinned memory."""
    rng = random.Random(seed)
    chunk = rng.choice([24, 64, 1 << 20])
    copies, dst, host_at, box = [], 0, 0, None
    for _ in range(60):
        if box is None or rng.random() < 0.5:
            box = (rng.choice([1, 2, 4]), *_case(rng))
        itemsize, shape, offsets, extent = box
        mine = box_copies(shape, offsets, extent, itemsize, base_offset=host_at, dst=dst, pin_chunk=chunk)
        copies += mine
        dst += copied_bytes(mine) + rng.choice([0, 0, 4, 256])
        n = itemsize
        for x in shape:
            n *= x
        host_at += n + rng.choice([0, 0, 8])
    merged = merge_copies(copies, pin_chunk=chunk)
    assert len(merged) <= len(copies) and copied_bytes(merged) == copied_bytes(copies)
    for c in merged:
        assert c.src // chunk == c.last_src() // chunk, (chunk, c)
    host = torch.randint(0, 256, (host_at + 64,), dtype=torch.uint8)
    assert torch.equal(_apply(merged, host, dst + 64), _apply(copies, host, dst + 64))


@pytest.mark.parametrize("chunk", [1 << 15, 1 << 17, 1 << 20])
def test_stacks_of_column_slices_stop_at_a_pinned_piece_and_their_layers_are_the_same_copies(chunk):
    """A layer of 40 experts' down slices (one pitched block each) merges into copies of several blocks,
    cut where the host's pinned pieces are; spelled out block by block (what the CUDA backend issues), the
    same bytes land in the same places; blocks of another shape are never stacked with them."""
    copies, host_bytes, size = experts_layer(40, 32, 48, t=3, tp=8, itemsize=2, pin_chunk=chunk)
    merged = merge_copies(copies, pin_chunk=chunk)
    deep = [c for c in merged if c.depth > 1]
    assert deep and all(c.src // chunk == c.last_src() // chunk for c in merged)
    if chunk == 1 << 20:   # one piece holds the layer: its down slices are one copy
        assert len(deep) == 1 and deep[0].depth == 40
    else:
        assert len(deep) > 1
    layers = [one for c in merged for one in c.layers()]
    assert all(c.depth == 1 for c in layers) and copied_bytes(layers) == copied_bytes(copies)
    host = torch.randint(0, 256, (host_bytes,), dtype=torch.uint8)
    want = _apply(copies, host, size + 64)
    assert torch.equal(_apply(merged, host, size + 64), want)
    assert torch.equal(_apply(layers, host, size + 64), want)


def test_blocks_of_other_heights_pitches_or_uneven_steps_are_not_stacked():
    a = Pitched(0, 100, 10, 4, 0)
    same = [a, a._replace(src=1000, dst=40), a._replace(src=2000, dst=80)]
    assert merge_copies(same) == [a._replace(depth=3, step=1000, dstep=40)]
    assert merge_copies([a, a._replace(src=1000, dst=40, height=3)]) == [a, a._replace(src=1000, dst=40, height=3)]
    assert merge_copies([a, a._replace(src=1000, dst=40, pitch=90)]) == [a, a._replace(src=1000, dst=40, pitch=90)]
    uneven = [a, a._replace(src=1000, dst=40), a._replace(src=2100, dst=80)]
    assert merge_copies(uneven) == [a._replace(depth=2, step=1000, dstep=40), uneven[2]]


def test_a_stack_whose_steps_are_whole_rows_is_one_3d_copy_and_any_other_is_copied_block_by_block():
    """``cuda.block_heights`` (pure, no GPU): the driver's 3-D copy places block k at k x srcHeight rows of
    the source and k x dstHeight of the destination, so a stack is one call only where both steps are
    whole rows, at least a block tall; a layer of experts' down slices is (merged, then one call)."""
    from ckpt_core.devices.cuda import _MAX_PITCH, block_heights

    stack = Pitched(src=0, pitch=640, width=80, height=2048, dst=0, dpitch=0, depth=40, step=640 * 6144,
                    dstep=80 * 6144)
    assert block_heights(stack) == (6144, 6144)
    assert block_heights(stack._replace(dpitch=96, dstep=96 * 3000)) == (6144, 3000)
    for other in (stack._replace(depth=1, step=0, dstep=0),       # one block: a 2-D copy
                  stack._replace(step=640 * 6144 + 2),            # the source's step not whole rows
                  stack._replace(dstep=80 * 6144 + 16),           # the destination's
                  stack._replace(step=640 * 2047),                # blocks that would overlap rows
                  stack._replace(dstep=80 * 100),
                  stack._replace(pitch=_MAX_PITCH + 1, step=(_MAX_PITCH + 1) * 4096),
                  stack._replace(height=1, pitch=0)):
        assert block_heights(other) is None, other
    copies, _, _ = experts_layer(40, 320, 2048, t=1, tp=8)
    stacks = [c for c in merge_copies(copies) if c.depth > 1]
    assert stacks and all(block_heights(c) is not None for c in stacks)


def test_a_stack_the_driver_refuses_as_one_3d_copy_goes_block_by_block_and_the_refusal_is_logged_once(
        monkeypatch, caplog):
    """No GPU here: the driver is a recording stand-in (its 3-D call refuses, as CUDA answers a range it
    will not take). ``CudaBackend.copy_pitched`` then issues the stack's blocks as 2-D copies at the
    same addresses, says so once in the log, and a refused 2-D copy still raises naming the copy."""
    import logging
    import types

    from ckpt_core.devices import cuda
    from ckpt_core.errors import TransportError

    calls = []

    class Driver:
        def __init__(self, fail_2d=False):
            self.fail_2d = fail_2d

        def copy3d(self, desc, stream):
            calls.append(("3d", desc._obj.Depth))
            return 1   # CUDA_ERROR_INVALID_VALUE

        def copy2d(self, desc, stream):
            d = desc._obj
            calls.append(("2d", d.srcHost, d.dstDevice, d.Height))
            return 999 if self.fail_2d else 0

        def htod(self, *a):
            calls.append(("1d",))
            return 0

        def error_name(self, err):
            return f"CUDA_ERROR_{err}"

    monkeypatch.setattr(cuda, "_REFUSED_3D", [])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(cuda_stream=0))
    host, dst = torch.zeros(1 << 16, dtype=torch.uint8), torch.zeros(1 << 14, dtype=torch.uint8)
    stack = Pitched(src=64, pitch=128, width=16, height=3, dst=0, dpitch=0, depth=4, step=128 * 5, dstep=16 * 3)
    assert cuda.block_heights(stack) == (5, 3)
    monkeypatch.setattr(cuda, "_driver", lambda: Driver())
    with caplog.at_level(logging.WARNING, logger="ckpt_core.devices"):
        cuda.CudaBackend().copy_pitched(dst, host, [stack, stack._replace(dst=4096)])
    h, d = host.data_ptr(), dst.data_ptr()
    assert calls == [("3d", 4)] + [("2d", h + 64 + k * 640, d + k * 48, 3) for k in range(4)] + [("3d", 4)] + [
        ("2d", h + 64 + k * 640, d + 4096 + k * 48, 3) for k in range(4)]
    assert len([r for r in caplog.records if "cuMemcpy3DAsync refused" in r.getMessage()]) == 1
    monkeypatch.setattr(cuda, "_driver", lambda: Driver(fail_2d=True))
    with pytest.raises(TransportError, match="1 block\\(s\\) of 3 row\\(s\\) of 16 bytes.*CUDA_ERROR_999"):
        cuda.CudaBackend().copy_pitched(dst, host, [stack])
