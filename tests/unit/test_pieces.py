"""Pure planning of tensors in pieces: tiling checks, boxes of DTensor layouts as torch computes them,
buckets filled by several owners."""

import itertools

import pytest
import torch

from ckpt_core import TensorShard
from ckpt_core.checkpoint.shards import _runs_to_boxes, dim_indices
from ckpt_core.errors import CheckpointFormatError, ConfigError
from ckpt_core.planning.buckets import SHARED, TensorMeta, layout_sizes, plan_buckets
from ckpt_core.planning.pieces import contiguous_start, group_pieces
from ckpt_core.transfer.pipeline import place_strided


def piece(name, gshape, offsets, extent, *, dtype="F32", itemsize=4, base=0, at=0):
    n = itemsize
    for e in extent:
        n *= e
    return TensorMeta(name, dtype, tuple(extent), n, itemsize, base, at, (tuple(gshape), tuple(offsets)))


def test_boxes_that_tile_are_grouped_in_order_of_first_appearance():
    metas = [[piece("b", (4,), (0,), (2,)), piece("a", (2, 3), (0, 0), (2, 1))],
             [piece("a", (2, 3), (0, 1), (2, 2)), piece("b", (4,), (2,), (2,))]]
    got = group_pieces(metas)
    assert [t.name for t in got] == ["b", "a"]
    assert [p.rank for p in got[1].pieces] == [0, 1] and got[1].nbytes == 24


@pytest.mark.parametrize("boxes, needle", [
    ([((0,), (3,)), ((2,), (2,))], "overlap"),
    ([((0,), (2,)), ((3,), (1,))], "cover 3 of its 4 elements"),
    ([((0,), (2,)), ((2,), (3,))], "lies outside"),
])
def test_overlaps_gaps_and_boxes_outside_are_format_errors_naming_tensor_and_ranks(boxes, needle):
    metas = [[piece("w", (4,), o, e)] for o, e in boxes]
    with pytest.raises(CheckpointFormatError, match=needle) as err:
        group_pieces(metas)
    assert "'w'" in str(err.value)


def test_two_dimensional_overlap_is_found_even_when_row_ranges_only_touch_partly():
    metas = [[piece("w", (4, 4), (0, 0), (3, 2))], [piece("w", (4, 4), (2, 1), (2, 3))],
             [piece("w", (4, 4), (0, 2), (2, 2))]]
    with pytest.raises(CheckpointFormatError, match="rank 0 .* and rank 1 .* overlap"):
        group_pieces(metas)


def test_contiguous_boxes_are_row_ranges_and_column_boxes_are_strided():
    assert contiguous_start((6, 4), (2, 0), (3, 4)) == 8
    assert contiguous_start((6, 4), (2, 1), (1, 2)) == 9      # part of one row
    assert contiguous_start((6, 4), (0, 2), (6, 2)) is None
    assert contiguous_start((2, 3, 4), (1, 1, 0), (1, 2, 4)) == 16


def test_a_bucket_of_pieces_has_one_segment_per_owner_run_and_scatters_for_strided_pieces():
    # w: rows from ranks 0 and 1 (direct); d: column halves (strided, into scratch)
    metas = [[piece("w", (4, 8), (0, 0), (2, 8), at=0), piece("d", (4, 8), (0, 0), (4, 4), at=256)],
             [piece("w", (4, 8), (2, 0), (2, 8), at=0), piece("d", (4, 8), (0, 4), (4, 4), at=256)],
             [TensorMeta("x", "F32", (3,), 12, 4, 0, 0)]]
    plan = plan_buckets(metas, 1 << 20)
    shared = [b for b in plan.buckets if b.owner == SHARED]
    (b,) = shared
    assert [(p.meta.name, p.meta.shape, p.offset) for p in b.placements] == [("w", (4, 8), 0), ("d", (4, 8), 256)]
    assert [(s.rank, s.offset, s.nbytes) for s in b.segments] == [(0, 0, 64), (1, 64, 64), (0, 512, 64), (1, 768, 64)]
    assert len(b.scatters) == 2 and {sc.dst for sc in b.scatters} == {256}
    assert [bb.owners() for bb in plan.buckets if bb.owner != SHARED] == [[2]]
    assert plan.total_bytes == 128 + 128 + 12
    assert layout_sizes(metas) == (128 + 128, 256 + 256 + 128)   # d: whole + its strided scratch; aligned


def test_placing_strided_pieces_rebuilds_the_whole_tensor_bit_exact_for_any_dtype():
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64):
        full = (torch.randn(5, 6, generator=gen) * 9).to(dtype)
        metas = [[piece("t", (5, 6), (0, 0), (5, 2), itemsize=full.element_size(), at=0)],
                 [piece("t", (5, 6), (0, 2), (5, 4), itemsize=full.element_size(), at=0)]]
        (b,) = plan_buckets(metas, 1 << 16).buckets
        slot = torch.zeros(b.nbytes, dtype=torch.uint8)
        for seg, part in zip(b.segments, (full[:, :2], full[:, 2:])):   # what the owners broadcast
            raw = part.contiguous().reshape(-1).view(torch.uint8)
            slot[seg.offset: seg.offset + seg.nbytes] = raw
        for sc in b.scatters:
            place_strided(slot, sc)
        got = slot[:full.numel() * full.element_size()].view(dtype).view(5, 6)
        assert torch.equal(got.view(torch.uint8), full.view(torch.uint8)), dtype


def test_dtensor_boxes_are_torchs_for_shard_strided_shard_and_uneven_sizes():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as torch_box
    from torch.distributed.tensor.placement_types import _StridedShard
    for gs, ms in itertools.product([(7, 3), (13, 5), (2, 4), (1, 1)], [(2, 2), (3, 2), (2, 3)]):
        layouts = [(_StridedShard(0, split_factor=ms[1]), Shard(0)), (Shard(0), Shard(1)), (Shard(0), Replicate()),
                   (_StridedShard(1, split_factor=ms[1]), Shard(1))]
        for pl in layouts:
            cover = torch.zeros(gs, dtype=torch.int32)
            for c in itertools.product(range(ms[0]), range(ms[1])):
                shape, off = torch_box(gs, ms, list(c), pl)
                idx = dim_indices(gs, ms, c, pl)
                assert tuple(len(i) for i in idx) == tuple(shape)
                assert all(not i or i[0] == o for i, o in zip(idx, off)), (gs, ms, pl, c)
                local = torch.zeros(shape)
                if isinstance(pl[1], Replicate) and c[1]:
                    continue
                for view, offsets in _runs_to_boxes(local, idx):
                    region = cover
                    for d, (o, e) in enumerate(zip(offsets, view.shape)):
                        region = region.narrow(d, o, e)
                    region += 1
            assert bool((cover == 1).all()), (gs, ms, pl)   # the boxes of all coordinates tile the tensor once


def test_tensor_shard_refuses_boxes_outside_the_tensor_and_mismatched_ranks():
    with pytest.raises(ConfigError, match="outside the global shape"):
        TensorShard(torch.zeros(3, 2), (4, 2), (2, 0))
    with pytest.raises(ConfigError, match="must agree"):
        TensorShard(torch.zeros(3, 2), (4, 2, 1), (0, 0))
    with pytest.raises(ConfigError, match="non-negative ints"):
        TensorShard(torch.zeros(3), (4,), (-1,))


def test_pieces_round_trip_through_the_metas_document_and_a_bad_tiling_there_is_refused():
    import json
    from ckpt_core.p2p import metas as _metas
    from ckpt_core.transfer.prechecks import parse_metas
    good = [[piece("w", (4, 2), (0, 0), (2, 2))], [piece("w", (4, 2), (2, 0), (2, 2))]]
    doc = json.loads(json.dumps(_metas.dump({"c": good}, {})))
    assert doc["checkpoints"]["c"]["owners"][1]["tensors"][0][7] == [[4, 2], [2, 0]]
    assert _metas.parse(doc)["c"].metas == good
    assert parse_metas(_metas.to_legacy(_metas.parse(doc)), 2)["c"] == good
    bad = [[piece("w", (4, 2), (0, 0), (3, 2))], [piece("w", (4, 2), (2, 0), (2, 2))]]
    with pytest.raises(CheckpointFormatError, match="overlap"):
        _metas.parse(json.loads(json.dumps(_metas.dump({"c": bad}, {}))))
    with pytest.raises(CheckpointFormatError, match="overlap"):
        parse_metas({"c": [[m._asdict() | {"box": [list(m.box[0]), list(m.box[1])]} for m in ms] for ms in bad]}, 2)
