"""The layout of a sliced update (issue 38): buckets sized by what each owner sends under the slice
plan (``slice_routes.sliced_sizes``), not by its whole share, so that an engine rank receiving an
eighth of the checkpoint gets it in several buckets (the owner's copies overlap the worker's loads)."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ckpt_core.errors import ConfigError
from ckpt_core.planning.buckets import ALIGN, TensorMeta, choose_layout, layout_sizes
from ckpt_core.planning.slice_routes import SlicedBucket, plan_sliced, received_bytes, sliced_sizes
from ckpt_core.planning.slices import SliceKey, split_plan
from ckpt_core.transfer.plan_cache import PlanCache

KEY = SliceKey("model-abc", "tp", "sim")


def world(tensors: dict, owners: list[int], W: int) -> list[list[TensorMeta]]:
    """Each tensor whole on rank ``owners[i] % W``, back to back in that rank's buffer 0."""
    metas: list[list[TensorMeta]] = [[] for _ in range(W)]
    at = [0] * W
    for (name, (dtype, shape, k)), o in zip(tensors.items(), owners):
        r = o % W
        n = math.prod(shape) * k
        metas[r].append(TensorMeta(name, dtype, tuple(shape), n, k, 0, at[r]))
        at[r] += n
    return metas


@settings(max_examples=120, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2]), st.data())
def test_the_largest_unit_is_exactly_what_a_bucket_must_hold_and_each_owner_total_bounds_what_it_sends(T, R, data):
    """With the buckets of ``sliced_sizes``' largest unit, plan_sliced plans; one byte less and it refuses
    the tensor; what each owner stages under the plan never exceeds its total."""
    layout = data.draw(st.lists(st.tuples(st.integers(1, 6), st.sampled_from([None, 0, 1]), st.sampled_from([2, 4]),
                                          st.integers(0, 7)), min_size=1, max_size=8))
    tensors, dims, owners = {}, {}, []
    for i, (k, d, itemsize, owner) in enumerate(layout):
        tensors[f"t{i}"] = ("BF16" if itemsize == 2 else "F32", (8 * k, 24) if d is not None or i % 2 else (8 * k,),
                            itemsize)
        dims[f"t{i}"] = d
        owners.append(owner)
    plan = split_plan(KEY, tensors, T, dims)
    metas = world(tensors, owners, R * T)
    largest, total = sliced_sizes(metas, plan)
    routed = plan_sliced(metas, plan, largest)
    with pytest.raises(ConfigError, match="does not fit a bucket"):
        plan_sliced(metas, plan, largest - 1)
    for owner in range(R * T):
        staged = sum(align_up_sum(b, owner) for b in routed.buckets)
        assert staged <= total


def align_up_sum(bucket, owner: int) -> int:
    """Bytes of tensors and slices ``owner`` stages into ``bucket``, each aligned as packed."""
    if isinstance(bucket, SlicedBucket):
        return sum(-(-p.nbytes // ALIGN) * ALIGN for p in bucket.segments if p.rank == owner)
    return sum(-(-p.meta.nbytes // ALIGN) * ALIGN for p in bucket.placements) if bucket.owner == owner else 0


def moe_like(experts: int = 16) -> tuple[dict, dict]:
    tensors, dims = {"norm": ("BF16", (64,), 2)}, {"norm": None}
    for e in range(experts):
        for kind, shape, d in (("gate", (64, 32), 0), ("up", (64, 32), 0), ("down", (32, 64), 1)):
            tensors[f"layers.0.experts.{e}.{kind}"] = ("BF16", shape, 2)
            dims[f"layers.0.experts.{e}.{kind}"] = d
    return tensors, dims


def test_one_owner_feeding_one_of_eight_engine_ranks_plans_buckets_for_an_eighth_not_for_its_whole_share():
    """The serial simulation of ``update_bench --tp 8`` on one device: the sizes are those of the eighth
    the engine rank receives, and so are the buckets (here at most a quarter of the whole layout's)."""
    tensors, dims = moe_like()
    plan8 = split_plan(KEY, tensors, 8, dims)
    from dataclasses import replace
    from ckpt_core.planning.slices import SlicePlan
    one = SlicePlan(KEY, tensors, (replace(plan8.ranks[3], rank=0),))
    metas = world(tensors, [0] * len(tensors), 1)
    whole_largest, whole_total = layout_sizes(metas)
    largest, total = sliced_sizes(metas, one)
    routed = plan_sliced(metas, one, largest)
    assert received_bytes(routed, 0) <= total <= received_bytes(routed, 0) + ALIGN * len(tensors)
    assert total * 4 < whole_total and largest * 4 <= whole_largest
    kw = dict(mem_fraction=0.9, max_slots=4, max_bucket_bytes=total // 8)
    assert choose_layout(1 << 30, largest_tensor=largest, largest_owner_total=total, **kw)[0] < \
        choose_layout(1 << 30, largest_tensor=whole_largest, largest_owner_total=whole_total, **kw)[0] * 2


def test_the_cache_keeps_sliced_sizes_per_slice_plan_and_whole_sizes_apart():
    tensors, dims = moe_like()
    metas = world(tensors, [0] * len(tensors), 2)
    cache = PlanCache()
    digest = cache.digest("ckpt", metas)
    two, one = split_plan(KEY, tensors, 2, dims), split_plan(SliceKey("model-abc", "tp1", "sim"), tensors, 1, dims)
    assert cache.sizes(metas, digest) == layout_sizes(metas)
    assert cache.sizes(metas, digest, two) == sliced_sizes(metas, two) != layout_sizes(metas)
    assert cache.sizes(metas, digest, one) == sliced_sizes(metas, one)
    assert cache.sizes(metas, digest, two) == sliced_sizes(metas, two)   # not the last one asked


def test_a_slice_plan_that_does_not_fit_the_checkpoint_takes_the_whole_layout_and_planning_refuses_it_as_before():
    tensors, dims = moe_like(2)
    plan = split_plan(KEY, tensors, 2, dims)
    metas = world(tensors, [0] * len(tensors), 2)
    bad = [[m._replace(shape=(1, 1), nbytes=2) if m.name == "norm" else m for m in ms] for ms in metas]
    cache = PlanCache()
    digest = cache.digest("ckpt", bad)
    assert cache.sizes(bad, digest, plan) == layout_sizes(bad)
    with pytest.raises(ConfigError, match="tensor 'norm' is BF16\\[1, 1\\] in the checkpoint, BF16\\[64\\] in the "
                                          "slice plan: record the plan for this checkpoint"):
        cache.get(bad, digest, 1 << 20, slices=plan)
    odd = world(tensors, [0] * len(tensors), 3)   # 3 PS ranks for 2 engine ranks
    assert cache.sizes(odd, cache.digest("odd", odd), plan) == layout_sizes(odd)


def test_tensors_in_pieces_count_as_one_more_owner_with_their_slices():
    full = torch.arange(16 * 8, dtype=torch.float32).view(16, 8)
    metas = [[TensorMeta("w", "F32", (8, 8), 256, 4, 0, 0, ((16, 8), (0, 0)))],
             [TensorMeta("w", "F32", (8, 8), 256, 4, 0, 0, ((16, 8), (8, 0)))]]
    plan = split_plan(KEY, {"w": ("F32", tuple(full.shape), 4)}, 2, {"w": 1})   # columns: strided in each piece
    largest, total = sliced_sizes(metas, plan)
    routed = plan_sliced(metas, plan, largest)
    assert total >= sum(b.nbytes for b in routed.buckets)
    with pytest.raises(ConfigError, match="does not fit a bucket"):
        plan_sliced(metas, plan, largest - 1)


def test_a_cached_plan_and_its_wire_blob_serve_one_checkpoint_layout_and_slice_plan_only():
    """Planned and encoded once per (metas, bucket size, slice plan, rank): asked again, the same objects;
    the checkpoint gathered again with another shape under the same name, or another slice plan, or
    another PS rank's view of it: planned and encoded anew, never the stale blob."""
    tensors, dims = moe_like(4)
    metas = world(tensors, [0, 1] * len(tensors), 2)
    cache = PlanCache()
    two = split_plan(KEY, tensors, 2, dims)
    digest = cache.digest("ckpt", metas)
    plan, wire = cache.get(metas, digest, 1 << 20, slices=two, rank=0)
    assert cache.get(metas, cache.digest("ckpt", [list(ms) for ms in metas]), 1 << 20, slices=two, rank=0) == \
        (plan, wire)
    assert cache.get(metas, digest, 1 << 20, slices=two, rank=0)[0] is plan
    other_rank = cache.get(metas, digest, 1 << 20, slices=two, rank=1)
    assert other_rank[1] != wire and other_rank[0] is not plan
    whole = cache.get(metas, digest, 1 << 20)
    assert whole[1][1] != wire[1]
    changed = dict(tensors, norm=("BF16", (512,), 2))
    regathered = world(changed, [0, 1] * len(changed), 2)
    new_digest = cache.digest("ckpt", regathered)   # the same name, gathered again
    assert new_digest != digest
    replan = split_plan(KEY, changed, 2, dims)
    got = cache.get(regathered, new_digest, 1 << 20, slices=replan, rank=0)
    assert got[1][1] != wire[1] and '"norm","BF16",[512]' in got[1][0]
    assert cache.sizes(regathered, new_digest, replan) != cache.sizes(metas, digest, two)
