"""Recording and replaying slices with loaders that do what vLLM's do (no vLLM needed).

The loaders here narrow like ``QKVParallelLinear`` (fused q/k/v with a replicated KV head),
``RowParallelLinear`` (columns), ``VocabParallelEmbedding`` (padded rows filled with zeros by the
loader) and ``default_weight_loader`` (whole); others take a path the recording cannot describe.
Every recorded plan is checked (``check_plan``), and replaying it from packed slices gives, bit for
bit, what loading the whole tensors gives.
"""

import pytest
import torch

from ckpt_core.errors import CheckpointFormatError, ConfigError
from ckpt_core.planning.slices import SliceKey, box_extent, check_plan, merge_ranks
from ckpt_vllm._slices import SliceTensor, record

T, H, HD, NH, NKV, VOCAB, PAD = 2, 8, 4, 4, 1, 37, 16


def shapes():
    return {"q": ("F32", (NH * HD, H)), "k": ("F32", (NKV * HD, H)), "v": ("F32", (NKV * HD, H)),
            "o": ("F32", (H, NH * HD)), "emb": ("F32", (VOCAB, H)), "norm": ("F32", (H,))}


class TinyTP(torch.nn.Module):
    """One rank's checkpoint-format parameters and loaders of a TP layer set."""

    def __init__(self, rank, device="meta", fill=None):
        super().__init__()
        self.rank = rank
        q, kv = NH * HD // T, HD   # one KV head, replicated on both ranks
        padded = -(-VOCAB // PAD) * PAD
        self.per = padded // T
        make = (lambda *s: torch.empty(*s, device="meta")) if fill is None else (lambda *s: torch.full(s, fill))
        self.qkv = torch.nn.Parameter(make(q + 2 * kv, H), requires_grad=False)
        self.o = torch.nn.Parameter(make(H, NH * HD // T), requires_grad=False)
        self.emb = torch.nn.Parameter(make(self.per, H), requires_grad=False)
        self.norm = torch.nn.Parameter(make(H), requires_grad=False)
        self.odd = None   # what a test makes a loader do instead

    def load_weights(self, weights):
        q, kv = NH * HD // T, HD
        for name, w in weights:
            if name in ("q", "k", "v"):
                start = self.rank * q if name == "q" else 0
                n = q if name == "q" else kv
                at = {"q": 0, "k": q, "v": q + kv}[name]
                if self.odd == name:
                    w = w * 1.0
                self.qkv.data.narrow(0, at, n).copy_(w.narrow(0, start, n))
            elif name == "o":
                self.o.data.copy_(w.narrow(1, self.rank * (NH * HD // T), NH * HD // T))
            elif name == "emb":
                lo = self.rank * self.per
                n = max(0, min(VOCAB, lo + self.per) - lo)
                w = w.narrow(0, lo, n)
                self.emb[:n].data.copy_(w)
                self.emb[n:].data.fill_(0)
            elif name == "norm" and self.odd != "norm":
                self.norm.data.copy_(w)


def recorded_plan(odd=None):
    ranks, whole = [], []
    for r in range(T):
        model = TinyTP(r)
        model.odd = odd
        rs, why = record(model, shapes(), torch.device("cpu"), rank=r)
        ranks.append(rs)
        whole.append(why)
    tensors = {n: (d, s, 4) for n, (d, s) in shapes().items()}
    return merge_ranks(SliceKey("m", "tp=2", "test"), tensors, ranks), whole


def test_the_recording_reads_what_each_rank_loads_and_the_plan_tiles():
    plan, whole = recorded_plan()
    assert whole == [{}, {}]
    r0, r1 = plan.ranks
    assert r0.needs["q"] == ((0, 0, 8),) and r1.needs["q"] == ((0, 8, 8),)
    assert r0.needs["k"] is None and r1.needs["k"] is None        # the one KV head: whole on both ranks
    assert r1.needs["o"] == ((1, 8, 8),)                           # row parallel: columns
    assert r0.needs["emb"] == ((0, 0, 24),) and r1.needs["emb"] == ((0, 24, 13),)   # padded vocab
    assert r0.needs["norm"] is None
    fills = [w for w in r1.writes if w.source is None]
    assert [(w.param, w.region) for w in fills] == [("emb", ((0, 13, 11),))]
    check_plan(plan)
    assert plan.rank_bytes(1) < plan.whole_bytes()


def load_sliced(plan, r, tensors, late: str | None = None):
    """Rank r's model loaded from packed slices (``late``: that tensor's bytes taken one row late)."""
    model = TinyTP(r, fill=7.0)
    items = []
    for name, box in plan.ranks[r].needs.items():
        t = tensors[name]
        if box:
            for d, s, n in box:
                t = t.narrow(d, s + (name == late), n)
            bucket = torch.cat([torch.zeros(5), t.flatten()])   # a slice is a view of its bucket
            items.append((name, SliceTensor(bucket[5:].view(box_extent(tensors[name].shape, box)),
                                            tuple(tensors[name].shape), box, name)))
        else:
            items.append((name, t))
    model.load_weights(items)
    return model


def test_replaying_packed_slices_equals_loading_whole_tensors_bit_for_bit():
    plan, _ = recorded_plan()
    tensors = {n: torch.randn(s) for n, (_, s) in shapes().items()}
    for r in range(T):
        want = TinyTP(r, fill=7.0)
        want.load_weights(tensors.items())
        got = load_sliced(plan, r, tensors)
        for name, p in want.named_parameters():
            assert torch.equal(p, dict(got.named_parameters())[name]), f"rank {r}: {name}"


def test_a_slice_that_starts_one_row_late_gives_other_bytes():
    plan, _ = recorded_plan()
    tensors = {n: torch.randn(s) for n, (_, s) in shapes().items()}
    good = load_sliced(plan, 0, tensors)
    rs = plan.ranks[0]
    (d, s, n), = rs.needs["q"]
    late = dict(rs.needs, q=((d, s + 1, n),))
    from ckpt_core.planning.slices import RankSlices, SlicePlan

    moved = SlicePlan(plan.key, plan.tensors, (RankSlices(0, late, rs.params, rs.writes), plan.ranks[1]))
    with pytest.raises(CheckpointFormatError, match="'q'"):
        check_plan(moved)   # a plan like that is refused before anything moves
    with pytest.raises(ConfigError, match="outside its recorded box"):
        load_sliced(moved, 0, tensors)   # and a worker holding it refuses what its loader then reads
    bad = load_sliced(plan, 0, tensors, late="q")   # bytes sent one row late under the right plan
    assert not torch.equal(good.qkv, bad.qkv)


def test_what_the_recording_cannot_describe_is_needed_whole():
    plan, whole = recorded_plan(odd="k")   # k goes through arithmetic: a copy, not a view
    assert all("not a pure view" in w["k"] for w in whole)
    assert all(rs.needs["k"] is None for rs in plan.ranks)
    check_plan(plan)
    # norm reaches no op at all (a loader keeps or skips it): sent whole, and the parameter nothing
    # wrote is a hole, so the plan is refused, naming it
    with pytest.raises(CheckpointFormatError, match="parameter norm with a hole"):
        recorded_plan(odd="norm")


def test_a_loader_op_the_recording_did_not_show_fails_the_replay():
    sliced = SliceTensor(torch.randn(2, 3), (4, 3), ((0, 0, 2),), "w")
    with pytest.raises(CheckpointFormatError, match="did not show"):
        sliced * 2.0
    with pytest.raises(ConfigError, match="outside its recorded box"):
        torch.empty(2, 3).copy_(sliced.narrow(0, 1, 2))


# --- experts, as FusedMoE loads them -------------------------------------------------------------
E, I = 4, 8   # experts, intermediate size per expert (checkpoint)


def expert_shapes():
    out = {}
    for e in range(E):
        out[f"e{e}.gate"] = ("F32", (I, H))
        out[f"e{e}.up"] = ("F32", (I, H))
        out[f"e{e}.down"] = ("F32", (H, I))
    return out


class TinyExperts(torch.nn.Module):
    """w13 [experts, 2 * I / tp, H] and w2 [experts, H, I / tp], loaded per expert id like FusedMoE's
    ``_load_w13`` / ``_load_w2``: the checkpoint tensor narrowed on the intermediate dimension by the
    TP rank, written into ``param.data[local expert]``. Under expert parallelism (``ep``) each rank
    holds E / ep experts whole and declines the others (the loader returns without a copy)."""

    def __init__(self, rank, *, ep=False, fill=None):
        super().__init__()
        self.rank, self.ep = rank, ep
        self.tp = 1 if ep else T
        local = E // T if ep else E
        make = (lambda *s: torch.empty(*s, device="meta")) if fill is None else (lambda *s: torch.full(s, fill))
        self.w13 = torch.nn.Parameter(make(local, 2 * I // self.tp, H), requires_grad=False)
        self.w2 = torch.nn.Parameter(make(local, H, I // self.tp), requires_grad=False)

    def load_weights(self, weights):
        for name, w in weights:
            e, part = name[1:].split(".")
            expert = int(e) - self.rank * (E // T) if self.ep else int(e)
            w = w.unsqueeze(0).unbind()[0]   # what MoERunner.load_weights does before the loader
            if not 0 <= expert < self.w13.shape[0]:
                continue                     # not local to this rank: declined, nothing read
            n = I // self.tp
            if part == "down":
                self.w2.data[expert].copy_(w.narrow(1, (0 if self.ep else self.rank) * n, n))
            else:
                dest = self.w13.data[expert].narrow(0, 0 if part == "gate" else n, n)
                dest.copy_(w.narrow(0, (0 if self.ep else self.rank) * n, n))


def recorded_experts(ep):
    ranks = [record(TinyExperts(r, ep=ep), expert_shapes(), torch.device("cpu"), rank=r)[0] for r in range(T)]
    tensors = {n: (d, s, 4) for n, (d, s) in expert_shapes().items()}
    return merge_ranks(SliceKey("m", f"tp=2,ep={ep}", "test"), tensors, ranks)


@pytest.mark.parametrize("ep", [False, True])
def test_expert_loaders_record_per_expert_slices_and_replay_bit_for_bit(ep):
    plan = recorded_experts(ep)
    r0, r1 = plan.ranks
    if ep:   # each rank reads its own experts whole, and nothing of the others'
        assert set(r0.needs) == {f"e{e}.{p}" for e in (0, 1) for p in ("gate", "up", "down")}
        assert set(r1.needs) == {f"e{e}.{p}" for e in (2, 3) for p in ("gate", "up", "down")}
        assert all(b is None for rs in plan.ranks for b in rs.needs.values())
    else:    # each rank reads half of every expert: gate/up rows, down columns
        assert r1.needs["e3.gate"] == ((0, 4, 4),) and r1.needs["e3.down"] == ((1, 4, 4),)
        assert r0.needs["e0.up"] == ((0, 0, 4),)
    assert plan.rank_bytes(0) == plan.rank_bytes(1) == plan.whole_bytes() // 2
    tensors = {n: torch.randn(s) for n, (_, s) in expert_shapes().items()}
    for r in range(T):
        want = TinyExperts(r, ep=ep, fill=7.0)
        want.load_weights(tensors.items())
        got = TinyExperts(r, ep=ep, fill=7.0)
        items = []
        for name, box in plan.ranks[r].needs.items():
            t = tensors[name]
            for d, s, n in box or ():
                t = t.narrow(d, s, n)
            items.append((name, t.contiguous() if box is None else
                          SliceTensor(t.contiguous(), tuple(tensors[name].shape), box, name)))
        got.load_weights(items)
        assert torch.equal(want.w13, got.w13) and torch.equal(want.w2, got.w2)


def test_an_expert_read_by_no_rank_leaves_a_hole_and_the_plan_is_refused():
    ranks = []
    for r in range(T):
        model = TinyExperts(r, ep=True)
        shapes_ = {n: s for n, s in expert_shapes().items() if not n.startswith("e1.")}   # expert 1 missing
        ranks.append(record(model, shapes_, torch.device("cpu"), rank=r)[0])
    tensors = {n: (d, s, 4) for n, (d, s) in expert_shapes().items()}
    with pytest.raises(CheckpointFormatError, match="w13 with a hole"):
        merge_ranks(SliceKey("m", "tp=2,ep=True", "test"), tensors, ranks)
