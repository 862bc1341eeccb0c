"""How a target reads its slices on the P2P path (``p2p/slices.py``), on CPU: the routing per owner,
the contiguous runs of each box, the spans read with their holes and gathered, replayed over host
bytes against the packed boxes."""

from __future__ import annotations

import math
import random

import pytest
import torch

from ckpt_core.errors import ConfigError
from ckpt_core.p2p import slices as ps
from ckpt_core.planning.buckets import TensorMeta, align_up
from ckpt_core.planning.slices import SliceKey, box_extent, box_offsets, split_plan
from ckpt_core.planning.slice_routes import BoxCopy, SlicedBucket
from ckpt_core.transfer.pipeline import byte_box


def world(shapes: dict, tp: int, dims: dict, owners: int, seed: int):
    """Metas of ``owners`` owners (tensors dealt round-robin, packed in region 0 with 256-byte
    alignment), their host bytes, and a ``tp``-rank plan splitting tensor n along ``dims[n]``."""
    metas = [[] for _ in range(owners)]
    pos = [0] * owners
    for i, (n, shape) in enumerate(shapes.items()):
        o = i % owners
        nbytes = math.prod(shape) * 4
        metas[o].append(TensorMeta(n, "F32", shape, nbytes, 4, 0, pos[o]))
        pos[o] = align_up(pos[o] + nbytes)
    gen = torch.Generator().manual_seed(seed)
    host = [torch.randint(0, 256, (max(p, 1),), dtype=torch.uint8, generator=gen) for p in pos]
    plan = split_plan(SliceKey("m", f"tp={tp}", "t"), {n: ("F32", s, 4) for n, s in shapes.items()}, tp, dims)
    return metas, host, plan


def replay(bucket: SlicedBucket, reads: ps.SliceReads, host: torch.Tensor) -> torch.Tensor:
    """What a target's slot holds after ``reads``: the descriptors' bytes, then the gathers."""
    land_at = align_up(bucket.nbytes)
    slot = torch.zeros(land_at + reads.landing, dtype=torch.uint8)
    for r in reads.direct:
        slot[r.offset: r.offset + r.nbytes] = host[r.base_offset: r.base_offset + r.nbytes]
    for spans, gathers in reads.rounds:
        slot[land_at:] = 0
        for s in spans:
            slot[land_at + s.offset: land_at + s.offset + s.nbytes] = host[s.base_offset: s.base_offset + s.nbytes]
        for g in gathers:
            src = slot.as_strided((g.count, g.nbytes), (g.stride, 1), land_at + g.src)
            slot[g.dst: g.dst + g.count * g.nbytes].view(g.count, g.nbytes).copy_(src)
    return slot[: bucket.nbytes]


def packed(bc: BoxCopy, host: torch.Tensor) -> torch.Tensor:
    return byte_box(host[bc.base_offset:], bc.shape, box_offsets(bc.shape, bc.box), box_extent(bc.shape, bc.box),
                    bc.itemsize).contiguous().view(-1)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("gap", [0, 64, ps.GAP_BYTES])
def test_every_slice_read_with_its_holes_and_gathered_equals_its_packed_box(seed, gap):
    rng = random.Random(seed)
    tp = rng.choice([1, 2, 3, 4])
    shapes, dims = {}, {}
    for i in range(rng.randint(2, 7)):
        nd = rng.randint(1, 3)
        shape = tuple(rng.choice([1, 2, 3, 5]) * (tp if d == 0 or rng.random() < 0.5 else 1) for d in range(nd))
        shapes[f"t{i}"] = shape
        split = [d for d, n in enumerate(shape) if n % tp == 0 and n >= tp]
        dims[f"t{i}"] = rng.choice(split + [None]) if split else None
    owners = rng.randint(1, 3)
    metas, host, plan = world(shapes, tp, dims, owners, seed)
    landing = rng.choice([64, 256, ps.LANDING_BYTES])
    routed, whose = ps.route(metas, plan, 1 << 16)
    whole = sorted(p.meta.name for b in routed.buckets if not isinstance(b, SlicedBucket) for p in b.placements)
    assert whole == sorted(n for n in shapes if dims[n] is None or tp == 1), "whole tensors go in ordinary buckets"
    for b, o in zip(routed.buckets, whose):
        if not isinstance(b, SlicedBucket):
            continue
        reads = ps.slice_reads(b, gap=gap, landing=landing)
        slot = replay(b, reads, host[o])
        for bc, p in zip(b.boxes, b.placements):
            assert torch.equal(slot[bc.offset: bc.offset + p.meta.nbytes], packed(bc, host[o])), (p.meta.name, bc)
        assert reads.nbytes >= sum(p.meta.nbytes for p in b.placements)
        assert all(s.offset + s.nbytes <= max(landing, reads.landing) for sp, _ in reads.rounds for s in sp)


def test_a_slice_of_rows_is_one_descriptor_and_of_columns_one_span_or_one_per_row_past_the_hole_limit():
    shape = (64, 512)                                       # rows of 2 KiB
    for box, gap, want in ((((0, 32, 32),), 0, (1, 0)),     # half the rows: one run
                           (((1, 256, 256),), 0, (64, 0)),  # half the columns, holes not read: a run per row
                           (((1, 256, 256),), 1024, (0, 1))):  # holes of 1 KiB read: one span, gathered
        bc = BoxCopy(0, 0, shape, box, 4, 0)
        n = math.prod(box_extent(shape, box)) * 4
        b = SlicedBucket(0, nbytes=n, dest=0, boxes=(bc,))
        reads = ps.slice_reads(b, gap=gap)
        assert (len(reads.direct), sum(len(s) for s, _ in reads.rounds)) == want, (box, gap, reads)
        if reads.rounds:
            assert len(reads.rounds[0][1]) == 1 and reads.rounds[0][1][0].count == 64, "one strided gather"
            assert reads.nbytes == 64 * 2048 - 1024


def test_the_routing_refuses_what_it_cannot_route_before_anything_moves():
    metas, _, plan = world({"a": (4, 4), "b": (6,)}, 2, {"a": 0}, 2, 1)
    with pytest.raises(ConfigError, match="2 engine ranks but the P2P update has 3 target"):
        ps.check_call(plan, (0, 1, 2), metas)
    with pytest.raises(ConfigError, match="recorded for another checkpoint.*'a'"):
        ps.check_call(plan, (0, 1), [[metas[0][0]._replace(shape=(4, 2), nbytes=32)], metas[1]])
    with pytest.raises(ConfigError, match="the checkpoint lacks"):
        ps.check_call(plan, (0, 1), [metas[0], []])
    with pytest.raises(ConfigError, match="SlicePlan"):
        ps.check_call({"version": 1}, (0, 1), metas)
