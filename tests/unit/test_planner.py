"""The pure planner: bucket packing, contiguity of copy runs, interleaving, sizing."""

import pytest

from ckpt_core.planning.buckets import ALIGN, TensorMeta, align_up, choose_layout, interleave, plan_buckets
from ckpt_core.errors import ConfigError


def meta(name, nbytes, *, base=0, offset=0, itemsize=2):
    return TensorMeta(name, "BF16", (nbytes // itemsize,), nbytes, itemsize, base, offset)


def packed(sizes, base=0, align=ALIGN, prefix="t"):
    out, pos = [], 0
    for i, n in enumerate(sizes):
        out.append(meta(f"{prefix}{i}", n, base=base, offset=pos))
        pos = (pos + n + align - 1) // align * align
    return out


def test_every_tensor_is_placed_once_and_inside_its_bucket():
    metas = [packed([1000, 3000, 500, 7000, 10], prefix="a"), packed([4096] * 5, prefix="b")]
    plan = plan_buckets(metas, 8192)
    names = [p.meta.name for b in plan.buckets for p in b.placements]
    assert sorted(names) == sorted(m.name for ms in metas for m in ms)
    for b in plan.buckets:
        assert b.nbytes <= 8192
        for p in b.placements:
            assert p.offset % p.meta.itemsize == 0
            assert p.offset + p.meta.nbytes <= b.nbytes
        spans = sorted((p.offset, p.offset + p.meta.nbytes) for p in b.placements)
        assert all(a[1] <= c[0] for a, c in zip(spans, spans[1:])), "placements overlap"


def test_tensors_laid_out_contiguously_in_host_memory_copy_as_one_run():
    plan = plan_buckets([packed([256, 512, 1024, 256])], 1 << 20)
    (bucket,) = plan.buckets
    runs = bucket.runs()
    assert len(runs) == 1
    assert runs[0].nbytes == bucket.nbytes


def test_tensors_from_different_host_buffers_get_separate_runs():
    metas = [[meta("x", 512, base=0), meta("y", 512, base=1), meta("z", 512, base=1, offset=512)]]
    (bucket,) = plan_buckets(metas, 1 << 20).buckets
    assert [(r.base, r.nbytes) for r in bucket.runs()] == [(0, 512), (1, 1024)]


def test_a_misaligned_neighbour_is_realigned_instead_of_kept_in_place():
    metas = [[meta("a", 3, base=0, offset=0, itemsize=1), meta("b", 4, base=0, offset=3, itemsize=4)]]
    (bucket,) = plan_buckets(metas, 4096).buckets
    offsets = {p.meta.name: p.offset for p in bucket.placements}
    assert offsets["b"] % 4 == 0 and offsets["b"] >= 3


def test_buckets_alternate_between_owners_so_all_ranks_copy_at_once():
    metas = [packed([4096] * 4, prefix="r0_"), packed([4096] * 4, prefix="r1_"), []]
    plan = plan_buckets(metas, 4096)
    assert [b.owner for b in plan.buckets] == [0, 1, 0, 1, 0, 1, 0, 1]


def test_interleave_continues_with_the_ranks_that_have_more():
    assert interleave([["a0", "a1", "a2"], ["b0"], []]) == ["a0", "b0", "a1", "a2"]


def test_a_rank_owning_nothing_gets_no_bucket():
    plan = plan_buckets([[], packed([100, 200])], 4096)
    assert {b.owner for b in plan.buckets} == {1}


def test_a_tensor_larger_than_a_bucket_is_an_error_naming_it_and_the_sizes():
    with pytest.raises(ConfigError, match=r"'big' \(10000 bytes, rank 1\) does not fit a bucket of 4096 bytes"):
        plan_buckets([packed([10]), [meta("big", 10000)]], 4096)


def test_the_same_name_on_two_ranks_is_rejected():
    with pytest.raises(ConfigError, match="'w' is registered on rank 0 and on rank 1"):
        plan_buckets([[meta("w", 8)], [meta("w", 8)]], 4096)


def test_zero_byte_tensors_are_placed():
    plan = plan_buckets([[meta("empty", 0), meta("x", 8, offset=256)]], 4096)
    assert sum(len(b.placements) for b in plan.buckets) == 2


GiB, MiB = 1 << 30, 1 << 20


def layout(free, total, largest, *, cap=8 * GiB, slots=3, fraction=0.9):
    return choose_layout(free, mem_fraction=fraction, max_slots=slots, max_bucket_bytes=cap,
                         largest_tensor=largest, largest_owner_total=total)


def test_a_delta_companion_is_sized_in_its_own_number_of_buckets_per_owner():
    """A delta's payloads (684 MB of dense16 at 2 %) take PS_DELTA_BUCKETS buckets per owner, not eight;
    still no smaller than 64 MiB nor than the largest payload, and the names that get it are the companions."""
    from ckpt_core.delta.versions import companion, fold_companion
    from ckpt_core.planning.buckets import delta_companion

    total = 684 * MiB
    kw = dict(mem_fraction=0.9, max_slots=4, max_bucket_bytes=8 * GiB, largest_tensor=2 * MiB,
              largest_owner_total=total)
    eight = choose_layout(80 * GiB, **kw)[0]
    two = choose_layout(80 * GiB, buckets_per_owner=2, **kw)[0]
    assert -(-total // eight) == 8 and -(-total // two) == 2
    assert choose_layout(80 * GiB, buckets_per_owner=64, **kw)[0] == 64 * MiB   # the floor holds
    assert choose_layout(80 * GiB, buckets_per_owner=2, **{**kw, "largest_tensor": 500 * MiB})[0] >= 500 * MiB
    assert delta_companion(companion("step-8")) and delta_companion(fold_companion("step-8", "step-2"))
    assert not delta_companion("step-8") and not delta_companion("delta-run")


def test_plenty_of_memory_gives_about_eight_buckets_per_rank_and_all_slots():
    size, slots = layout(100 * GiB, 4 * GiB, 1 * MiB)
    assert (size, slots) == (512 * MiB, 3)


def test_auto_buckets_stop_at_one_gib_unless_a_tensor_needs_more():
    assert layout(200 * GiB, 40 * GiB, 1 * MiB)[0] == 1 * GiB
    assert layout(200 * GiB, 40 * GiB, 1 * GiB + 4096)[0] == align_up(1 * GiB + 4096)


def test_the_bucket_never_exceeds_the_configured_cap():
    assert layout(500 * GiB, 400 * GiB, 1 * MiB, cap=512 * MiB) == (512 * MiB, 3)


def test_a_small_checkpoint_uses_one_bucket_no_bigger_than_it():
    size, _ = layout(100 * GiB, 10 * MiB, 1 * MiB)
    assert size == align_up(10 * MiB)


def test_scarce_memory_gives_up_slots_before_refusing_a_large_tensor():
    size, slots = layout(2 * GiB, 8 * GiB, int(1.015 * GiB))
    assert slots == 1 and size >= int(1.015 * GiB) and size <= int(2 * GiB * 0.9)


def test_two_slots_when_two_fit():
    size, slots = layout(4 * GiB, 12 * GiB, 3 * GiB // 2)
    assert slots == 2 and size == 3 * GiB // 2


def test_when_nothing_fits_the_planner_names_the_tensor():
    size, slots = layout(1 * GiB, 8 * GiB, 2 * GiB)
    assert slots == 1
    with pytest.raises(ConfigError, match="'huge'"):
        plan_buckets([[meta("huge", 2 * GiB)]], size)


def test_plan_is_deterministic_for_every_rank():
    metas = [packed([300, 5000, 70, 2048], prefix="a"), packed([999, 1], prefix="b")]
    a, b = plan_buckets(metas, 6000), plan_buckets(metas, 6000)
    assert [[(p.meta.name, p.offset) for p in x.placements] for x in a.buckets] == \
           [[(p.meta.name, p.offset) for p in x.placements] for x in b.buckets]


def test_a_cap_below_the_largest_tensor_is_raised_to_it_and_never_to_the_whole_budget():
    size, slots = layout(140 * GiB, 20 * GiB, int(1.015 * GiB), cap=GiB // 2, slots=8)
    assert size == align_up(int(1.015 * GiB)) and slots == 8


def test_the_fallback_with_one_slot_never_exceeds_what_the_plan_needs():
    size, slots = layout(1 * GiB, 8 * GiB, 2 * GiB)
    assert slots == 1 and size <= int(0.9 * GiB)


def test_two_registrations_of_one_layout_have_identical_metas_so_they_share_a_plan():
    """RL steady state: step N+1 has step N's names and shapes; its metas (region ids included)
    must be equal, so that the PS reuses the plan and the worker its validated copy."""
    import torch
    from ckpt_core.checkpoint.sources import build_checkpoint
    from ckpt_core.devices import get_backend

    backend = get_backend("cpu")
    named = {f"layer.{i}.w": torch.full((64, 3 + i), float(i)) for i in range(5)}
    a = build_checkpoint("step-1", backend, named_tensors=named)
    b = build_checkpoint("step-2", backend, named_tensors={k: v + 1 for k, v in named.items()})
    try:
        assert a.metas == b.metas
        assert plan_buckets([a.metas], 1 << 12).buckets == plan_buckets([b.metas], 1 << 12).buckets
    finally:
        a.release()
        b.release()


def test_copy_runs_never_span_two_pinned_pieces_of_a_host_region():
    from ckpt_core.planning.buckets import PIN_CHUNK, CopyRun, split_at_pin_chunks
    run = CopyRun(base=0, base_offset=PIN_CHUNK - 100, offset=4096, nbytes=2 * PIN_CHUNK + 300)
    parts = split_at_pin_chunks(run)
    assert [p.nbytes for p in parts] == [100, PIN_CHUNK, PIN_CHUNK, 200]
    assert all(p.base_offset // PIN_CHUNK == (p.base_offset + p.nbytes - 1) // PIN_CHUNK for p in parts)
    assert [p.offset - run.offset for p in parts] == [p.base_offset - run.base_offset for p in parts]
    assert split_at_pin_chunks(CopyRun(1, 0, 0, 10)) == [CopyRun(1, 0, 0, 10)]
    big = TensorMeta("t", "BF16", (3 * PIN_CHUNK // 2,), 3 * PIN_CHUNK, 2, 0, 64)
    plan = plan_buckets([[big]], 4 * PIN_CHUNK)
    runs = plan.buckets[0].copy_runs
    assert sum(r.nbytes for r in runs) == 3 * PIN_CHUNK and len(runs) == 4


def test_the_plan_cache_shares_one_plan_per_layout_and_keeps_the_most_recent():
    from ckpt_core.transfer.plan_cache import PlanCache
    cache = PlanCache(size=2)
    metas = [[TensorMeta(f"t{i}", "F32", (64,), 256, 4, 0, 256 * i) for i in range(4)]]
    same = [list(metas[0])]                      # a later step: equal metas, another list
    d1, d2 = cache.digest("step-1", metas), cache.digest("step-2", same)
    assert d1 == d2
    first = cache.get(metas, d1, 1024)
    assert cache.get(same, d2, 1024) is first     # shared, not planned again
    cache.get(metas, d1, 512)
    cache.get(metas, d1, 1024)                    # touch: 1024 is now the most recent
    cache.get(metas, d1, 2048)                    # evicts 512, the least recently used
    assert sorted(k[0] for k in cache._plans) == [1024, 2048]
    assert cache.get(metas, d1, 1024) is first
    other = [[TensorMeta("x", "F32", (64,), 256, 4, 0, 0)]]
    assert cache.digest("step-3", other) != d1


def test_the_next_checkpoint_of_a_layout_takes_the_digest_without_encoding_its_metas(monkeypatch):
    """An RL step's new checkpoint has the metas of the last (another list, equal): its digest is the
    last one's, found by comparing, even after the last was unregistered; metas that differ anywhere,
    even in the last tensor, are encoded and get their own."""
    import ckpt_core.transfer.plan_cache as pc
    cache = pc.PlanCache(size=2)
    metas = [[TensorMeta(f"t{i}", "F32", (64,), 256, 4, 0, 256 * i) for i in range(50)], []]
    first = cache.digest("step-1", metas)
    cache.forget("step-1")
    last = [list(metas[0][:-1]) + [metas[0][-1]._replace(shape=(8, 8))], []]
    from_scratch = pc.PlanCache().digest("fresh", last)
    encoded = []
    real = pc.json.dumps
    monkeypatch.setattr(pc.json, "dumps", lambda obj, **kw: encoded.append(1) or real(obj, **kw))
    same = [[TensorMeta(*m) for m in ms] for ms in metas]
    assert cache.digest("step-2", same) == first and not encoded
    other = cache.digest("step-3", last)
    assert encoded == [1] and other != first and other == from_scratch
    gathered_again = [list(ms) for ms in last]
    assert cache.digest("step-3", gathered_again) == other and encoded == [1]


def test_an_fp8_file_travels_layer_by_layer_with_few_runs_per_layer():
    """safetensors writes scales (float32) before weights (FP8): each layer's tensors still travel together."""
    from ckpt_core.planning.buckets import delivery_order, layer_of

    names = []
    for kind in ("weight_scale_inv", "weight"):        # the file's order: all scales, then all weights
        for layer in range(3):
            for proj in ("k_proj", "q_proj"):
                names.append(f"model.layers.{layer}.self_attn.{proj}.{kind}")
    names.insert(0, "model.embed_tokens.weight")
    metas, pos = [], 0
    for n in names:                                     # larger than the gaps the planner copies over
        metas.append(meta(n, 8192, offset=pos))
        pos += 8192
    order = [m.name for m in delivery_order(metas)]
    layers = [layer_of(n) for n in order]
    assert layers == [layer for layer in dict.fromkeys(layers) for _ in range(layers.count(layer))], \
        f"a layer's tensors are spread out: {layers}"
    assert order[0] == "model.embed_tokens.weight"
    assert order[1:5] == ["model.layers.0.self_attn.k_proj.weight_scale_inv", "model.layers.0.self_attn.q_proj.weight_scale_inv",
                          "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.weight"]
    (bucket,) = plan_buckets([metas], 1 << 20).buckets
    # the embedding with layer 0's scales, its weights, then a scales run and a weights run per layer
    assert len(bucket.runs()) == 2 * 3


def test_a_single_dtype_file_keeps_its_host_order():
    from ckpt_core.planning.buckets import delivery_order

    names = sorted(f"model.layers.{i}.{p}" for i in range(12) for p in ("a.weight", "b.weight")) + ["lm_head.weight"]
    metas = [meta(n, 256, offset=i * 256) for i, n in enumerate(names)]
    assert [m.name for m in delivery_order(metas)] == names
    (bucket,) = plan_buckets([metas], 1 << 20).buckets
    assert len(bucket.runs()) == 1


def _layout_by_trying_every_slot_count(free, *, mem_fraction, max_slots, max_bucket_bytes, largest_tensor,
                                       largest_owner_total):
    """choose_layout as it was written first: from the most slots down, the first whose share holds
    the largest tensor (the definition the closed form must keep)."""
    from ckpt_core.planning.buckets import MAX_AUTO_BUCKET, MIN_BUCKET, TARGET_BUCKETS_PER_OWNER
    budget = int(max(free, 0) * mem_fraction)
    per_owner = -(-max(largest_owner_total, 1) // TARGET_BUCKETS_PER_OWNER)
    want = min(max(min(per_owner, MAX_AUTO_BUCKET), MIN_BUCKET), max_bucket_bytes,
               align_up(max(largest_owner_total, 1)))
    want = align_up(max(want, largest_tensor))
    for slots in range(max(max_slots, 1), 0, -1):
        size = min(want, budget // slots) // ALIGN * ALIGN
        if size >= max(largest_tensor, 1):
            return size, slots
    return max(min(want, budget) // ALIGN * ALIGN, ALIGN), 1


def test_the_layout_is_the_most_slots_that_hold_the_largest_tensor_found_without_trying_each():
    import random
    rng = random.Random()
    for _ in range(3000):
        kw = dict(mem_fraction=rng.choice([1, 0.9, 0.5, 0.01]), max_slots=rng.choice([0, 1, 2, 4, rng.randrange(64)]),
                  max_bucket_bytes=rng.choice([1024, GiB, rng.randrange(1, 1 << 34)]),
                  largest_tensor=rng.choice([0, 1, ALIGN - 1, ALIGN, ALIGN + 1, rng.randrange(1 << 34)]),
                  largest_owner_total=rng.choice([0, 1, rng.randrange(1 << 40)]))
        free = rng.choice([0, -5, rng.randrange(1 << 20), rng.randrange(1 << 40)])
        assert choose_layout(free, **kw) == _layout_by_trying_every_slot_count(free, **kw), (free, kw)


@pytest.mark.timeout(30)
def test_a_huge_slot_bound_answers_at_once():
    """PS_NUM_SLOTS / --slots of 10**11 looped once per slot count (a hang). As many slots as the
    budget holds of the largest tensor: 0.9 x 16 GiB // 1 MiB of them, 1 MiB each."""
    assert layout(16 * GiB, 4 * GiB, 1 * MiB, slots=10 ** 11) == (1 * MiB, int(16 * GiB * 0.9) // MiB)
