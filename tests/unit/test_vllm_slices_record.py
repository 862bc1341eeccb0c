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
