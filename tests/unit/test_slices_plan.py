"""Pure slice plans: the box arithmetic against torch, the tiling checks over random tensor-parallel
layouts (head counts with KV replication, padded vocabularies), the refusals, the cache key."""

import math
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st
from support.slices_world import slice_of

from ckpt_core.errors import CheckpointFormatError, ConfigError
from ckpt_core.planning.buckets import TensorMeta
from ckpt_core.planning.slices import (RankSlices, SliceKey, SlicePlan, Write, box_extent,
                                       box_offsets, check_plan, make_box, plan_from_json, plan_to_json,
                                       split_plan, view_box, view_in_box)
from ckpt_core.planning.slice_routes import (SlicedBucket, plan_sliced, rank_placements, received_bytes,
                                             replica_groups, replica_ranks)

KEY = SliceKey("model-abc", "tp=2", "vllm-0.32.0")


def box_indices(shape, box):
    full = torch.arange(math.prod(shape)).view(shape)
    for d, s, n in box or ():
        full = full.narrow(d, s, n)
    return sorted(full.flatten().tolist())


# --- view_box: what a strided view reads, as torch computes it -----------------------------------

@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_chain_of_narrows_is_always_read_as_its_box(data):
    ndim = data.draw(st.integers(1, 4))
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    t = torch.arange(math.prod(shape)).view(shape)
    for _ in range(data.draw(st.integers(0, 4))):
        d = data.draw(st.integers(0, ndim - 1))
        n = data.draw(st.integers(1, t.shape[d]))
        t = t.narrow(d, data.draw(st.integers(0, t.shape[d] - n)), n)
    if data.draw(st.booleans()) and ndim >= 2:   # loaders transpose too: the same box is read
        t = t.transpose(0, ndim - 1)
    box = view_box(shape, t.shape, t.stride(), t.storage_offset())
    assert box is not None
    assert box_indices(shape, box) == sorted(t.flatten().tolist())


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_strided_view_is_a_box_only_if_it_reads_exactly_that_box(data):
    ndim = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    numel = math.prod(shape)
    vdim = data.draw(st.integers(1, 3))
    size = data.draw(st.lists(st.integers(1, 4), min_size=vdim, max_size=vdim))
    stride = data.draw(st.lists(st.integers(0, numel), min_size=vdim, max_size=vdim))
    span = sum((s - 1) * k for s, k in zip(size, stride))
    if span >= numel:
        return
    offset = data.draw(st.integers(0, numel - 1 - span))
    view = torch.arange(numel).as_strided(size, stride, offset)
    box = view_box(shape, size, stride, offset)
    if box is not None:   # never a guessed box: exactly the elements the view reads, each once
        assert box_indices(shape, box) == sorted(view.flatten().tolist())


def test_a_range_of_rows_viewed_flat_is_that_range_of_rows():
    t = torch.arange(12).view(4, 3)[1:3].reshape(-1)
    assert view_box((4, 3), t.shape, t.stride(), t.storage_offset()) == ((0, 1, 2),)


def test_views_that_repeat_or_skip_elements_are_not_boxes():
    assert view_box((4, 3), (2, 2), (1, 1), 0) is None          # repeats
    assert view_box((4, 3), (2,), (2,), 0) is None              # skips every other column
    assert view_box((4, 3), (3,), (0,), 0) is None              # broadcast of one element


# --- a tensor-parallel plan as vLLM's loaders make one (the oracle of the property tests) ---------

def split(n, t, T):
    """Rows of rank t when n rows are split over T ranks (n % T == 0)."""
    per = n // T
    return t * per, per


def tp_plan(T, *, nh, nkv, hd, H, inter, vocab, pad=64, tied=False, bias=True):
    q_rows, kv_rows = nh * hd, nkv * hd
    vp = -(-vocab // pad) * pad
    vp = -(-vp // T) * T
    tensors = {"q_proj.weight": ("F32", (q_rows, H), 4), "k_proj.weight": ("F32", (kv_rows, H), 4),
               "v_proj.weight": ("F32", (kv_rows, H), 4), "o_proj.weight": ("F32", (H, q_rows), 4),
               "gate_proj.weight": ("F32", (inter, H), 4), "up_proj.weight": ("F32", (inter, H), 4),
               "down_proj.weight": ("F32", (H, inter), 4), "norm.weight": ("F32", (H,), 4),
               "embed_tokens.weight": ("F32", (vocab, H), 4)}
    if bias:
        tensors.update({f"{x}_proj.bias": ("F32", (r,), 4) for x, r in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))})
    if not tied:
        tensors["lm_head.weight"] = ("F32", (vocab, H), 4)
    ranks = []
    for t in range(T):
        needs, params, writes = {}, {}, []
        q0, qn = split(q_rows, t, T)
        if nkv >= T:
            k0, kn = split(kv_rows, t, T)
        else:   # the KV heads are replicated: rank t reads head t // (T / nkv)
            k0, kn = (t // (T // nkv)) * hd, hd
        params["qkv_proj.weight"] = (qn + 2 * kn, H)
        for part, (start, n, at) in {"q": (q0, qn, 0), "k": (k0, kn, qn), "v": (k0, kn, qn + kn)}.items():
            needs[f"{part}_proj.weight"] = ((0, start, n),)
            writes.append(Write("qkv_proj.weight", ((0, at, n),), f"{part}_proj.weight"))
            if bias:
                params["qkv_proj.bias"] = (qn + 2 * kn,)
                needs[f"{part}_proj.bias"] = ((0, start, n),)
                writes.append(Write("qkv_proj.bias", ((0, at, n),), f"{part}_proj.bias"))
        c0, cn = split(q_rows, t, T)
        needs["o_proj.weight"] = ((1, c0, cn),)
        params["o_proj.weight"] = (H, cn)
        writes.append(Write("o_proj.weight", (), "o_proj.weight"))
        i0, i_n = split(inter, t, T)
        params["gate_up_proj.weight"] = (2 * i_n, H)
        for j, part in enumerate(("gate", "up")):
            needs[f"{part}_proj.weight"] = ((0, i0, i_n),)
            writes.append(Write("gate_up_proj.weight", ((0, j * i_n, i_n),), f"{part}_proj.weight"))
        needs["down_proj.weight"] = ((1, i0, i_n),)
        params["down_proj.weight"] = (H, i_n)
        writes.append(Write("down_proj.weight", (), "down_proj.weight"))
        needs["norm.weight"] = None
        params["norm.weight"] = (H,)
        writes.append(Write("norm.weight", (), "norm.weight"))
        for name in ("embed_tokens.weight",) + (() if tied else ("lm_head.weight",)):
            per = vp // T
            lo, hi = t * per, min(vocab, (t + 1) * per)
            param = name.replace(".weight", ".shard")
            params[param] = (per, H)
            if hi > lo:
                needs[name] = make_box((vocab, H), (lo, 0), (hi - lo, H))
                writes.append(Write(param, make_box((per, H), (0, 0), (hi - lo, H)), name))
            if hi - lo < per:   # padded rows: the engine zeroes them
                writes.append(Write(param, make_box((per, H), (max(hi - lo, 0), 0), (per - max(hi - lo, 0), H)), None))
        ranks.append(RankSlices(t, needs, params, tuple(writes)))
    return SlicePlan(KEY, tensors, tuple(ranks))


layouts = st.tuples(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([1, 2, 4, 8]),
                    st.sampled_from([32, 64]), st.integers(1, 700), st.booleans(), st.booleans())


@settings(max_examples=200, deadline=None)
@given(layouts)
def test_every_tp_layout_vllm_can_serve_tiles_every_parameter_and_every_tensor(layout):
    T, heads_per_rank, nkv, hd, vocab, tied, bias = layout
    nh = heads_per_rank * T
    if nkv > nh or nh % nkv or (nkv >= T and nkv % T) or (nkv < T and T % nkv):
        return
    plan = tp_plan(T, nh=nh, nkv=nkv, hd=hd, H=64, inter=32 * T, vocab=vocab, tied=tied, bias=bias)
    check_plan(plan)
    # bytes per rank: 1/T of the sharded tensors, the replicated ones whole, at most one padded block more
    total = plan.whole_bytes()
    replicated = 64 * 4 + (0 if nkv >= T else 2 * hd * (64 + bias) * 4 * (T - nkv) // T)
    for r in range(T):
        got = plan.rank_bytes(r)
        assert got <= total
        assert got <= total // T + replicated + 2 * 64 * 64 * 4 * 2 + 64 * 4


@pytest.mark.parametrize("T, nkv", [(2, 1), (4, 2), (2, 2), (8, 1)])
def test_a_k_proj_slice_starting_one_row_late_is_refused_naming_k_proj(T, nkv):
    plan = tp_plan(T, nh=8, nkv=nkv, hd=32, H=64, inter=64, vocab=333)
    check_plan(plan)
    rs = plan.ranks[T - 1]
    (d, s, n), = rs.needs["k_proj.weight"]
    late = dict(rs.needs, **{"k_proj.weight": ((d, s + 1, n - 1),)}) if s + n == nkv * 32 else \
        dict(rs.needs, **{"k_proj.weight": ((d, s + 1, n),)})
    ranks = list(plan.ranks)
    ranks[T - 1] = RankSlices(rs.rank, late, rs.params, rs.writes)
    with pytest.raises(CheckpointFormatError, match="k_proj.weight"):
        check_plan(SlicePlan(plan.key, plan.tensors, tuple(ranks)))


def mutate_writes(plan, r, fn):
    ranks = list(plan.ranks)
    rs = ranks[r]
    ranks[r] = RankSlices(rs.rank, rs.needs, rs.params, tuple(fn(list(rs.writes))))
    return SlicePlan(plan.key, plan.tensors, tuple(ranks))


def test_a_hole_in_a_parameter_is_refused_naming_it():
    plan = tp_plan(2, nh=4, nkv=2, hd=32, H=64, inter=64, vocab=100)
    holed = mutate_writes(plan, 1, lambda ws: [w for w in ws if w.source != "k_proj.weight"])
    with pytest.raises(CheckpointFormatError, match=r"qkv_proj.weight.*hole: 6144 of its 8192") as err:
        check_plan(holed)
    assert err.value.tensor == "qkv_proj.weight"


def test_a_byte_written_twice_is_refused_naming_the_parameter_and_both_writers():
    plan = tp_plan(2, nh=4, nkv=2, hd=32, H=64, inter=64, vocab=100)
    twice = mutate_writes(plan, 0, lambda ws: ws + [Write("gate_up_proj.weight", ((0, 16, 32),), "up_proj.weight")])
    with pytest.raises(CheckpointFormatError, match=r"gate_up_proj.weight with written twice.*up_proj.weight"):
        check_plan(twice)


def test_padding_the_engine_fills_counts_once_and_a_missing_fill_is_a_hole():
    plan = tp_plan(2, nh=4, nkv=2, hd=32, H=64, inter=64, vocab=100)   # 128 padded rows, 64 per rank
    check_plan(plan)
    no_fill = mutate_writes(plan, 1, lambda ws: [w for w in ws if not (w.source is None and "embed" in w.param)])
    with pytest.raises(CheckpointFormatError, match="embed_tokens.shard with a hole: 2304 of its 4096"):
        check_plan(no_fill)


def test_a_box_outside_its_tensor_and_a_tensor_the_checkpoint_lacks_are_refused():
    plan = tp_plan(2, nh=4, nkv=2, hd=32, H=64, inter=64, vocab=100)
    rs = plan.ranks[0]
    for needs, needle in ((dict(rs.needs, **{"o_proj.weight": ((1, 100, 64),)}), "lies outside"),
                          (dict(rs.needs, **{"missing.weight": None}), "does not have")):
        bad = SlicePlan(plan.key, plan.tensors, (RankSlices(0, needs, rs.params, rs.writes),) + plan.ranks[1:])
        with pytest.raises(CheckpointFormatError, match=needle):
            check_plan(bad)


def test_an_empty_plan_is_refused():
    with pytest.raises(ConfigError, match="moves nothing"):
        check_plan(SlicePlan(KEY, {}, (RankSlices(0, {}, {}, ()), RankSlices(1, {}, {}, ()))))
    with pytest.raises(ConfigError, match="moves nothing"):
        check_plan(SlicePlan(KEY, {}, ()))


def test_the_json_form_round_trips_and_a_malformed_one_is_a_config_error():
    plan = tp_plan(4, nh=8, nkv=1, hd=32, H=64, inter=64, vocab=333, tied=True)
    again = plan_from_json(plan_to_json(plan))
    assert again == plan and again.digest == plan.digest
    doc = plan_to_json(plan)
    doc["ranks"][1]["needs"]["k_proj.weight"] = [[0, -1, 32]]
    with pytest.raises(ConfigError, match="non-negative"):
        plan_from_json(doc)
    doc = plan_to_json(plan)
    doc["ranks"] = doc["ranks"][::-1]
    with pytest.raises(ConfigError, match="in order"):
        plan_from_json(doc)


def test_a_plan_is_only_ever_used_under_the_key_it_was_recorded_for():
    from ckpt_vllm._slices import check_installed   # what a vLLM worker checks when a plan is installed

    plan = tp_plan(2, nh=4, nkv=2, hd=32, H=64, inter=64, vocab=100)
    assert plan.key == KEY and plan_from_json(plan_to_json(plan)).key == KEY
    for other in (SliceKey("model-other", KEY.layout, KEY.engine), SliceKey(KEY.model, "tp=4", KEY.engine),
                  SliceKey(KEY.model, KEY.layout, "vllm-0.33.0")):
        with pytest.raises(ConfigError, match="recorded for"):
            check_installed(plan.key, other)
    check_installed(plan.key, KEY)


def test_random_boxes_tile_only_when_they_partition_the_parameter():
    rng = random.Random(24)
    for _ in range(300):
        shape = (rng.randint(1, 6), rng.randint(1, 6))
        cut = rng.randint(0, shape[0])
        boxes = [b for b in (make_box(shape, (0, 0), (cut, shape[1])), make_box(shape, (cut, 0), (shape[0] - cut, shape[1])))
                 if box_extent(shape, b)[0] > 0]
        mode = rng.choice(["ok", "drop", "dup", "shift"])
        if mode == "drop" and len(boxes) > 1:
            boxes = boxes[:1]
        elif mode == "dup":
            boxes = boxes + boxes[:1]
        elif mode == "shift" and len(boxes) == 2 and box_offsets(shape, boxes[1])[0] + box_extent(shape, boxes[1])[0] < shape[0] + 1:
            o, e = box_offsets(shape, boxes[1]), box_extent(shape, boxes[1])
            boxes[1] = make_box(shape, (o[0] - 1, 0), e) if o[0] > 0 else boxes[1]
        else:
            mode = "ok"
        ws = tuple(Write("p", b, "w") for b in boxes)
        plan = SlicePlan(KEY, {"w": ("F32", shape, 4)}, (RankSlices(0, {"w": None}, {"p": shape}, ws),))
        covered = sorted(i for b in boxes for i in box_indices(shape, b))
        if covered == list(range(math.prod(shape))):
            check_plan(plan)
        else:
            with pytest.raises(CheckpointFormatError, match="parameter p"):
                check_plan(plan)


# --- replaying a recorded view on the slice alone; routing buckets by destination ---------------

@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_view_inside_the_box_reads_the_same_elements_from_the_packed_slice(data):
    ndim = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    offsets = [data.draw(st.integers(0, n - 1)) for n in shape]
    extent = [data.draw(st.integers(1, n - o)) for n, o in zip(shape, offsets)]
    box = make_box(shape, offsets, extent)
    full = torch.arange(math.prod(shape)).view(shape)
    view = full
    for d in range(ndim):   # a loader's narrow inside the box
        lo = data.draw(st.integers(offsets[d], offsets[d] + extent[d] - 1))
        view = view.narrow(d, lo, data.draw(st.integers(1, offsets[d] + extent[d] - lo)))
    if ndim >= 2 and data.draw(st.booleans()):
        view = view.t() if ndim == 2 else view.transpose(0, 2)
    bucket = torch.cat([torch.full((7,), -1), full[tuple(slice(o, o + e) for o, e in zip(offsets, extent))].flatten()])
    packed = bucket[7:]   # a slice is a view of its bucket, at an offset
    stride, offset = view_in_box(shape, box, view.shape, view.stride(), view.storage_offset())
    assert torch.equal(packed.as_strided(view.shape, stride, packed.storage_offset() + offset), view)


def test_a_view_outside_the_box_is_refused():
    full = torch.arange(12).view(4, 3)
    with pytest.raises(ConfigError, match="outside its recorded box"):
        view_in_box((4, 3), ((0, 0, 2),), full[1:3].shape, full[1:3].stride(), full[1:3].storage_offset())


def meta(name, shape, base=0, at=0, itemsize=4):
    n = math.prod(shape) * itemsize
    return TensorMeta(name, "F32", tuple(shape), n, itemsize, base, at)


def test_each_rank_is_told_only_of_its_slices_and_the_tensors_sent_whole():
    plan = tp_plan(2, nh=4, nkv=1, hd=32, H=64, inter=64, vocab=100, tied=True)
    at, metas = 0, [[], []]
    for i, (name, (_, shape, _)) in enumerate(plan.tensors.items()):
        metas[i % 2].append(meta(name, shape, at=at))
        at += math.prod(shape) * 4
    routed = plan_sliced(metas, plan, 1 << 20)
    for r in range(2):
        told = [e for b in rank_placements(routed, r) for e in b]
        names = {n for n, *_ in told}
        assert names == set(plan.ranks[r].needs)
        for name, _, shape, _ in told:
            assert shape == box_extent(plan.tensors[name][1], plan.ranks[r].needs[name])
        assert received_bytes(routed, r) == plan.rank_bytes(r)
    # only the replicated norm goes to both; a bucket of slices has exactly one destination
    whole = [b for b in routed.buckets if not isinstance(b, SlicedBucket)]
    assert {p.meta.name for b in whole for p in b.placements} == {"norm.weight"}
    assert plan.rank_bytes(0) < plan.whole_bytes() * 0.7


def test_routing_refuses_a_checkpoint_the_plan_was_not_recorded_for():
    plan = tp_plan(2, nh=4, nkv=2, hd=32, H=64, inter=64, vocab=100)
    metas = [[meta(n, s) for n, (_, s, _) in plan.tensors.items()], []]
    metas[0][0] = meta(metas[0][0].name, (1, 1))
    with pytest.raises(ConfigError, match="record the plan for this checkpoint"):
        plan_sliced(metas, plan, 1 << 20)
    with pytest.raises(ConfigError, match="2 engine ranks, the parameter server 3"):
        plan_sliced(metas + [[]], plan, 1 << 20)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.lists(st.tuples(st.integers(1, 4), st.sampled_from([None, 0, 1])),
                                              min_size=1, max_size=6))
def test_a_split_plan_tiles_every_tensor_and_each_rank_gets_its_share(tp, layout):
    tensors, dims = {}, {}
    for i, (k, d) in enumerate(layout):
        shape = (8 * k, 16) if d is not None or i % 2 else (8 * k,)
        tensors[f"t{i}"] = ("BF16", shape, 2)
        dims[f"t{i}"] = d
    plan = split_plan(KEY, tensors, tp, dims)   # merge_ranks checks it
    for name, (_, shape, _) in tensors.items():
        got = sorted(i for rs in plan.ranks for i in box_indices(shape, rs.needs[name]))
        copies = 1 if dims[name] is not None else tp
        assert got == sorted(list(range(math.prod(shape))) * copies), name
    split = sum(math.prod(s) * 2 for n, (_, s, _) in tensors.items() if dims[n] is not None)
    assert plan.rank_bytes(0) == plan.whole_bytes() - split + split // tp


def test_a_split_plan_refuses_a_dimension_it_cannot_split_evenly():
    with pytest.raises(ConfigError, match="'w' of shape \\[6, 4\\] cannot be split in 4"):
        split_plan(KEY, {"w": ("F32", (6, 4), 4)}, 4, {"w": 0})


def test_a_tensor_only_some_ranks_read_goes_to_those_ranks_only():
    """Expert parallelism: each expert is read whole by the one rank that holds it; only what every
    rank reads whole is broadcast, and a rank receives nothing of what it does not read."""
    tensors = {"e0": ("F32", (4, 8), 4), "e1": ("F32", (4, 8), 4), "norm": ("F32", (8,), 4), "q": ("F32", (8, 8), 4)}
    ranks = []
    for r in range(2):
        needs = {f"e{r}": None, "norm": None, "q": ((0, 4 * r, 4),)}
        params = {f"e{r}": (4, 8), "norm": (8,), "q": (4, 8)}
        ranks.append(RankSlices(r, needs, params, tuple(Write(p, (), p) for p in params)))
    plan = SlicePlan(KEY, tensors, tuple(ranks))
    check_plan(plan)
    metas = [[meta("e0", (4, 8)), meta("norm", (8,), at=128)], [meta("e1", (4, 8)), meta("q", (8, 8), at=128)]]
    routed = plan_sliced(metas, plan, 1 << 20)
    broadcast = {p.meta.name for b in routed.buckets if not isinstance(b, SlicedBucket) for p in b.placements}
    assert broadcast == {"norm"}
    for r in range(2):
        told = {n: shape for b in rank_placements(routed, r) for n, _, shape, _ in b}
        assert told == {f"e{r}": (4, 8), "norm": (8,), "q": (4, 8)}
        assert received_bytes(routed, r) == plan.rank_bytes(r) == (32 + 8 + 32) * 4


# --- data-parallel replicas: a PS world of R x T ranks feeds R copies of a T-rank engine ----------

REPLICA_TENSORS = {"rows": ("F32", (8, 16), 4), "cols": ("F32", (16, 8), 4), "norm": ("F32", (8,), 4),
                   "emb": ("F32", (12, 4), 4)}
REPLICA_DIMS = {"rows": 0, "cols": 1, "emb": 0}


@pytest.mark.parametrize("R", [1, 2, 3])
@pytest.mark.parametrize("T", [1, 2, 4])
def test_ps_rank_p_feeds_engine_rank_p_mod_t_and_each_slice_is_one_bucket_for_all_replicas(R, T):
    plan = split_plan(KEY, REPLICA_TENSORS, T, REPLICA_DIMS)
    W = R * T
    metas = [[] for _ in range(W)]
    for i, (name, (_, shape, _)) in enumerate(REPLICA_TENSORS.items()):
        metas[i % W].append(meta(name, shape, base=i))
    routed = plan_sliced(metas, plan, 1 << 20)
    groups = replica_ranks(W, T)
    assert groups == [tuple(p for p in range(W) if p % T == t) for t in range(T)]
    for p in range(W):
        told = {n: shape for b in rank_placements(routed, p) for n, _, shape, _ in b}
        rs = plan.ranks[p % T]
        assert told == {n: box_extent(REPLICA_TENSORS[n][1], b) for n, b in rs.needs.items()}
        assert received_bytes(routed, p) == plan.rank_bytes(p % T)
    sliced = [b for b in routed.buckets if isinstance(b, SlicedBucket)]
    assert all(b.ranks == groups[b.dest] for b in sliced)
    # every slice travels in exactly one bucket, whatever the number of replicas
    carried = sorted((p.meta.name, b.dest) for b in sliced for p in b.placements)
    assert carried == sorted((n, t) for t in range(T) for n in REPLICA_DIMS if T > 1)
    assert replica_groups(routed) == ([g for g in groups if any(b.ranks == g for b in sliced)] if R > 1 else [])


def test_a_ps_world_that_is_not_a_multiple_of_the_engine_ranks_is_refused_naming_both():
    plan = split_plan(KEY, REPLICA_TENSORS, 2, REPLICA_DIMS)
    metas = [[meta(n, s, base=i) for i, (n, (_, s, _)) in enumerate(REPLICA_TENSORS.items())], [], []]
    with pytest.raises(ConfigError, match="2 engine ranks, the parameter server 3 ranks.*multiple of 2"):
        plan_sliced(metas, plan, 1 << 20)


# --- trainer shards as the source: a slice assembled from its intersections with the pieces -------

def run_routed(routed, hosts: dict[int, dict[int, torch.Tensor]], world: int) -> dict[int, dict[str, torch.Tensor]]:
    """Play a routed plan in one process, the way the pipeline moves it: each part's rank packs its
    boxes (``byte_box``) into its own slot, the part's bytes reach every rank of the bucket's group
    (copied from the part's rank's slot), strided intersections are placed (``place_strided``); then
    what each rank's worker is told of each bucket is read out of that rank's slot."""
    from ckpt_core.transfer.pipeline import byte_box, place_strided
    got: dict[int, dict[str, torch.Tensor]] = {r: {} for r in range(world)}
    for b, bucket in enumerate(routed.buckets):
        slots = {r: torch.full((bucket.nbytes,), 0xA5, dtype=torch.uint8) for r in range(world)}
        if isinstance(bucket, SlicedBucket):
            for bc in bucket.boxes:
                rank = bucket.owner if bc.rank < 0 else bc.rank
                src = byte_box(hosts[rank][bc.base][bc.base_offset:], bc.shape, box_offsets(bc.shape, bc.box),
                               box_extent(bc.shape, bc.box), bc.itemsize)
                slots[rank][bc.offset: bc.offset + src.numel()].view(src.shape).copy_(src)
            for part in bucket.segments:
                for r in bucket.ranks:
                    if r != part.rank:
                        slots[r][part.offset: part.offset + part.nbytes] = slots[part.rank][part.offset: part.offset + part.nbytes]
            for r in bucket.ranks:
                for sc in bucket.scatters:
                    place_strided(slots[r], sc)
        else:   # whole tensors, also in pieces: every rank
            for seg in bucket.segments:
                for run in seg.runs:
                    slots[seg.rank][run.offset: run.offset + run.nbytes] = \
                        hosts[seg.rank][run.base][run.base_offset: run.base_offset + run.nbytes]
                for r in range(world):
                    slots[r][seg.offset: seg.offset + seg.nbytes] = slots[seg.rank][seg.offset: seg.offset + seg.nbytes]
            for r in range(world):
                for sc in bucket.scatters:
                    place_strided(slots[r], sc)
        for r in range(world):
            for name, _, shape, offset in rank_placements(routed, r)[b]:
                n = math.prod(shape) * 4
                got[r][name] = slots[r][offset: offset + n].view(torch.float32).view(shape).clone()
    return got


def piece_metas(full: dict[str, torch.Tensor], layout: dict, world: int):
    """Metas and host memory of tensors registered whole (layout[name] = rank) or in pieces
    (layout[name] = [(rank, offsets, extent)]); each rank's host buffer 0 holds its bytes in order."""
    metas, hosts, chunks = [[] for _ in range(world)], {}, {r: [] for r in range(world)}
    at = [0] * world
    for name, spec in layout.items():
        t = full[name]
        pieces = [(spec, None, None)] if isinstance(spec, int) else spec
        for rank, offsets, extent in pieces:
            local = t
            if offsets is not None:
                for d, (o, e) in enumerate(zip(offsets, extent)):
                    local = local.narrow(d, o, e)
            local = local.contiguous()
            raw = local.reshape(-1).view(torch.uint8)
            box = None if offsets is None else (tuple(t.shape), tuple(offsets))
            metas[rank].append(TensorMeta(name, "F32", tuple(local.shape), raw.numel(), 4, 0, at[rank], box))
            chunks[rank].append(raw)
            at[rank] += raw.numel()
    for r in range(world):
        hosts[r] = {0: torch.cat(chunks[r]) if chunks[r] else torch.empty(0, dtype=torch.uint8)}
    return metas, hosts


def needs_plan(shapes: dict[str, tuple[int, ...]], needs_per_rank: list[dict]) -> SlicePlan:
    """A plan whose engine rank t reads ``needs_per_rank[t][name]`` of each tensor into a parameter of
    that extent (checked: the boxes must tile each tensor)."""
    ranks = []
    for t, needs in enumerate(needs_per_rank):
        params = {f"p_{n}": box_extent(shapes[n], b) for n, b in needs.items()}
        ranks.append(RankSlices(t, dict(needs), params, tuple(Write(f"p_{n}", (), n) for n in needs)))
    plan = SlicePlan(KEY, {n: ("F32", s, 4) for n, s in shapes.items()}, tuple(ranks))
    check_plan(plan)
    return plan


def expected_slices(full, plan, p):
    """What PS rank ``p``'s worker must hold: the slices of engine rank p % T."""
    return slice_of(full, plan.ranks[p % len(plan.ranks)])


def row_split(n, parts):
    """``parts`` uneven consecutive ranges covering n (the last ones may be empty, as torch.chunk does)."""
    step = -(-n // parts)
    return [(min(n, i * step), min(n, (i + 1) * step) - min(n, i * step)) for i in range(parts)]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_slices_of_tensors_in_pieces_arrive_bit_exact_for_any_tiling_and_any_slices(data):
    """Random tilings (rows, columns, rows x columns, uneven, empty pieces) read by random slices
    (rows, columns, one rank reading whole), T in 1, 2, 3 and R in 1, 2: every PS rank receives
    exactly its engine rank's slices; every piece's bytes leave their owner once."""
    T, R = data.draw(st.sampled_from([1, 2, 3])), data.draw(st.sampled_from([1, 2]))
    W = T * R
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    shapes, layout, needs = {}, {}, [dict() for _ in range(T)]
    for i in range(data.draw(st.integers(1, 4))):
        name = f"t{i}"
        shape = (data.draw(st.integers(T, 9)), data.draw(st.integers(T, 7)))
        shapes[name] = shape
        cut = data.draw(st.sampled_from(["rows", "cols", "grid", "whole"]))
        ranks = [data.draw(st.integers(0, W - 1)) for _ in range(4)]
        if cut == "whole":
            layout[name] = ranks[0]
        else:
            rows = row_split(shape[0], 2) if cut in ("rows", "grid") else [(0, shape[0])]
            cols = row_split(shape[1], 2) if cut in ("cols", "grid") else [(0, shape[1])]
            layout[name] = [(ranks[(i * 2 + j) % 4], (r0, c0), (rn, cn)) for i, (r0, rn) in enumerate(rows)
                            for j, (c0, cn) in enumerate(cols)]
        read = data.draw(st.sampled_from(["rows", "cols", "whole", "one-whole"]))
        for t in range(T):
            if read == "whole" or (read == "one-whole" and T == 1):
                needs[t][name] = None
            elif read == "one-whole":   # rank 0 reads it whole, every other rank reads rows of it
                needs[t][name] = None if t == 0 else ((0, 0, shape[0]),)
            else:
                d = 0 if read == "rows" else 1
                lo, n = row_split(shape[d], T)[t]
                if n:
                    needs[t][name] = ((d, lo, n),) if n < shape[d] else None
    full = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    try:
        plan = needs_plan(shapes, needs)
    except CheckpointFormatError:
        return   # one rank reading whole, the others a box of it: not a tiling
    metas, hosts = piece_metas(full, layout, W)
    routed = plan_sliced(metas, plan, 1 << 16)
    got = run_routed(routed, hosts, W)
    for p in range(W):
        want = expected_slices(full, plan, p)
        assert set(got[p]) == set(want), p
        for name in want:
            assert torch.equal(got[p][name].view(torch.uint8), want[name].view(torch.uint8)), (p, name)
        assert received_bytes(routed, p) == plan.rank_bytes(p % T)
    # each part is sent once: the parts of the buckets of slices carry every byte of the slices once
    for b in routed.buckets:
        if isinstance(b, SlicedBucket):
            assert sum(part.payload for part in b.segments) == sum(pl.meta.nbytes for pl in b.placements)


def test_dim0_pieces_read_by_dim1_slices_assemble_each_slice_from_both_owners():
    full = {"w": torch.randn(6, 8)}
    layout = {"w": [(0, (0, 0), (3, 8)), (1, (3, 0), (3, 8))]}
    plan = needs_plan({"w": (6, 8)}, [{"w": ((1, 0, 4),)}, {"w": ((1, 4, 4),)}])
    metas, hosts = piece_metas(full, layout, 2)
    routed = plan_sliced(metas, plan, 1 << 16)
    sliced = [b for b in routed.buckets if isinstance(b, SlicedBucket)]
    assert len(sliced) == 2 and all(sorted(p.rank for p in b.segments) == [0, 1] for b in sliced)
    assert all(not b.scatters for b in sliced), "rows of a column slice are runs of it: packed in place"
    got = run_routed(routed, hosts, 2)
    for r in range(2):
        assert torch.equal(got[r]["w"], full["w"][:, 4 * r: 4 * r + 4])


def test_a_slice_of_a_tensor_in_pieces_too_large_for_the_bucket_is_refused_naming_it():
    full = {"w": torch.randn(8, 8)}
    layout = {"w": [(0, (0, 0), (8, 4)), (1, (0, 4), (8, 4))]}   # columns: every row slice is strided in them
    plan = needs_plan({"w": (8, 8)}, [{"w": ((0, 0, 4),)}, {"w": ((0, 4, 4),)}])
    metas, _ = piece_metas(full, layout, 2)
    with pytest.raises(ConfigError, match="slice of tensor 'w' for engine rank 0 \\(128 bytes, 128 more"):
        plan_sliced(metas, plan, 200)
