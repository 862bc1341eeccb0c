"""Where a delta of each tensor goes (``ckpt_vllm._delta_map``), decided from a recorded loading and
the live layers of a small module tree (no vLLM): verbatim layers scattered, derived ones grouped
with every tensor they load (fused and tied ones too), a mismatch of bytes or dtype sent to the
reload, and a tensor the recording cannot place making the whole map fall back."""

import torch

from ckpt_core.delta.lin64 import lin64
from ckpt_vllm._delta_map import Digested, _decide, verbatim_layer
from ckpt_vllm._slices import record_loading

H = 8


class Leaf(torch.nn.Module):
    def __init__(self, *shape, dtype=torch.float32):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device="meta"), requires_grad=False)


class Tree(torch.nn.Module):
    """norm (verbatim), qkv fused from q and k (prepacked: derived), emb with a tied head."""

    def __init__(self):
        super().__init__()
        self.norm, self.qkv, self.emb, self.head = Leaf(H), Leaf(2 * H, H), Leaf(5, H), Leaf(5, H)

    def load_weights(self, weights):
        for name, w in weights:
            if name == "norm":
                self.norm.weight.data.copy_(w)
            elif name in ("q", "k"):
                self.qkv.weight.data.narrow(0, 0 if name == "q" else H, H).copy_(w)
            elif name == "emb":
                self.emb.weight.data.copy_(w)


def _decided(kept, *, live_dtype=torch.float32, odd_norm=None):
    model = Tree()
    meta = {q: dict(m._parameters) for q, m in model.named_modules() if m._parameters}
    specs = {n: ("BF16" if t.dtype == torch.bfloat16 else "F32", tuple(t.shape)) for n, t in kept.items()}
    rec, _ = record_loading(model, specs, torch.device("cpu"))
    # the live model after the load: real tensors; qkv prepacked (a closure over a copy), head tied
    live = Tree()
    live.norm.weight = torch.nn.Parameter(kept["norm"].to(live_dtype) if odd_norm is None else odd_norm,
                                          requires_grad=False)
    packed = torch.cat([kept["q"], kept["k"]]).float().t().contiguous()
    live.qkv.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    live.qkv.cpu_linear = lambda x, w, b: x @ packed
    live.emb.weight = torch.nn.Parameter(kept["emb"].float(), requires_grad=False)
    live.head.weight = live.emb.weight
    live.head.cpu_linear = lambda x, w, b: x @ packed
    modules = dict(live.named_modules(remove_duplicate=False))
    owners = {q: {n: p for n, p in m._parameters.items() if p is not None} for q, m in modules.items() if m._parameters}
    by_id: dict = {}
    for q, params in owners.items():
        for p in params.values():
            by_id.setdefault(id(p), set()).add(q)
    # as a worker passes them: each received tensor by its digest (ckpt_vllm._delta.receive_with_deltas)
    digested = {n: Digested(t.dtype, tuple(t.shape), lin64(t)) for n, t in kept.items()}
    return _decide(modules, owners, by_id, meta, rec, digested)


def _kept(dtype=torch.float32):
    gen = torch.Generator().manual_seed(5)
    return {n: torch.randn(*s, generator=gen).to(dtype) for n, s in
            (("norm", (H,)), ("q", (H, H)), ("k", (H, H)), ("emb", (5, H)))}


def test_verbatim_layers_are_scattered_and_derived_ones_reloaded_with_all_they_load():
    kept = _kept()
    m = _decided(kept)
    assert m.whole is None and sorted(m.scatter) == ["norm"]
    assert m.scatter["norm"].data_ptr() != 0 and m.live("q") is None
    assert sorted(m.companions(["q"])) == ["k", "q"] and m.layers(["q"]) == ["qkv"]
    assert sorted(m.layers(["emb"])) == ["emb", "head"]            # the tied head reloads with its embedding
    assert "processing changed weight" in m.why["q"] and "cpu_linear" in m.why["emb"]
    assert sorted(m.readable) == ["emb"]                           # kept beside its prepack: read back, not copied
    assert [n for n in kept if m.keeps(n)] == ["q", "k"]


def test_a_bf16_checkpoint_widened_to_float32_is_scattered_and_a_changed_byte_is_not():
    kept = _kept(torch.bfloat16)
    assert sorted(_decided(kept).scatter) == ["norm"]
    odd = kept["norm"].float().clone()
    odd[3] += 1
    m = _decided(kept, odd_norm=odd)
    assert "norm" not in m.scatter and m.layers(["norm"]) == ["norm"] and "byte for byte" in m.why["norm"]


def test_a_live_tensor_narrower_than_the_checkpoint_is_not_scattered():
    m = _decided(_kept(), live_dtype=torch.bfloat16)
    assert "norm" not in m.scatter and m.keeps("norm")


def test_a_tensor_the_recording_cannot_place_makes_every_delta_reload_the_whole_model():
    kept = dict(_kept(), extra=torch.ones(3))
    m = _decided(kept)
    assert m.whole and "extra" in m.whole and m.live("norm") is None and all(m.keeps(n) for n in kept)


def test_verbatim_layer_names_what_a_layer_derives():
    layer = Leaf(H)
    layer.weight = torch.nn.Parameter(torch.ones(H), requires_grad=False)
    meta = {"weight": torch.empty(H, device="meta")}
    assert verbatim_layer(layer, meta, dict(layer._parameters)) is None
    layer.packed = torch.ones(H)
    assert "derives" in verbatim_layer(layer, meta, dict(layer._parameters))
