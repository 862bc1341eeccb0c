"""The SGLang delta map's decisions (``ckpt_sglang/_delta.py``) on small torch models whose loaders do
what SGLang's do: a copy into a parameter, a fused parameter's shard regions, a tensor-parallel read of
part of a tensor, a tied copy, a layer deriving a tensor, a quantized post-processing that replaces its
parameter, a model-wide ``post_load_weights``. The map is decided from the recorded load, the live
parameters and their bytes; the names here mean nothing to it (renamed, they decide the same).
The real SGLang model code is exercised in tests/integration/test_sglang_delta*.py."""

from __future__ import annotations

import time

import pytest
import torch

from ckpt_sglang._delta import DeltaLoad, SglangDeltas

H = 8


class Layer(torch.nn.Module):
    def __init__(self, rows: int, cols: int = H):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(rows, cols), requires_grad=False)


class Replacing:
    """A quantized method whose post-processing swaps in a new, transposed parameter."""

    def process_weights_after_loading(self, layer) -> None:
        layer.weight = torch.nn.Parameter(layer.weight.data.t().contiguous(), requires_grad=False)


class Model(torch.nn.Module):
    def __init__(self, *, shard: bool = False, tie: bool = False, derive: bool = False, replace: bool = False):
        super().__init__()
        self.shard, self.tie = shard, tie
        self.a = Layer(H)            # copied whole
        self.fused = Layer(2 * H)    # q and k, each into half
        self.sharded = Layer(H // 2 if shard else H)  # a TP shard reads half of its tensor
        self.emb = Layer(H)
        self.head = Layer(H)         # also gets emb's tensor when tie
        if derive:
            self.a.cache = self.a.weight.data * 2   # a tensor derived beside its parameter
        if replace:
            self.fused.quant_method = Replacing()

    def load_weights(self, weights):
        for name, w in weights:
            if name == "x.a":
                self.a.weight.data.copy_(w)
            elif name in ("x.q", "x.k"):
                self.fused.weight.data.narrow(0, 0 if name == "x.q" else H, H).copy_(w)
            elif name == "x.s":
                self.sharded.weight.data.copy_(w.narrow(0, 0, H // 2) if self.shard else w)
            elif name == "x.e":
                self.emb.weight.data.copy_(w)
                if self.tie:
                    self.head.weight.data.copy_(w)
            elif name == "x.h" and not self.tie:
                self.head.weight.data.copy_(w)


def _weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"x.a": (H, H), "x.q": (H, H), "x.k": (H, H), "x.s": (H, H), "x.e": (H, H), "x.h": (H, H)}
    return [(n, torch.randn(s, generator=g).to(torch.bfloat16)) for n, s in shapes.items()]


def _map(model: Model, post=None):
    state = SglangDeltas()
    load = state.load(model, torch.device("cpu"), "A", keep=True, session=False, timeout=60)
    with load.transaction():
        weights = _weights()
        load.run(weights[:3])   # two buckets
        load.run(weights[3:])
        if post is not None:
            post(model)
        load.finish_full()
    return state


def test_verbatim_copies_and_fused_regions_are_scattered_in_a_float32_model():
    state = _map(Model())
    m = state.map
    assert m.refuse is None and not m.groups, m.why
    assert sorted(m.scatter) == ["x.a", "x.e", "x.h", "x.k", "x.q", "x.s"]
    assert state.held == "A" and not state.rx.kept   # nothing to keep: every tensor is scattered
    q = m.scatter["x.q"]
    assert q.dtype == torch.float32 and q.data_ptr() == state.model.fused.weight.data_ptr()


def test_a_part_read_a_tied_copy_and_a_derived_tensor_go_to_the_reload_with_their_modules():
    state = _map(Model(shard=True, tie=True, derive=True))
    m = state.map
    assert m.refuse is None
    assert "x.s" not in m.scatter and "read in part" in m.why["x.s"]
    assert "x.e" not in m.scatter and "written 2 times" in m.why["x.e"]
    assert set(m.modules(["x.e"])) == {"emb", "head"}
    assert "x.a" not in m.scatter and "beside its parameters" in m.why["x.a"]
    assert {"x.q", "x.k"} <= set(m.scatter)
    # the tied model's loader skips x.h: no write seen, so it reloads with every module's post-processing
    assert "no write" in m.why["x.h"] and m.modules(["x.h"]) is None
    assert set(state.rx.kept) == {n for g in m.groups for n in g} == {"x.s", "x.e", "x.a", "x.h"}


def test_a_post_processing_that_replaces_the_loaded_parameter_refuses_deltas():
    from ckpt_sglang._delta import post_process

    state = _map(Model(replace=True), post=lambda model: post_process(model, None, None))
    assert state.map.refuse and "replaced the parameter fused.weight" in state.map.refuse
    assert not state.rx.kept


def test_a_model_wide_post_load_weights_refuses_deltas():
    model = Model()
    model.post_load_weights = lambda: None
    state = _map(model)
    assert state.map.refuse and "post_load_weights" in state.map.refuse


def test_a_full_load_without_deltas_forgets_the_held_version():
    state = _map(Model())
    load = state.load(state.model, torch.device("cpu"), "B", keep=False, session=False, timeout=60)
    assert isinstance(load, DeltaLoad)
    with load.transaction():
        load.run(_weights(1))
    assert state.held is None and state.map is None


def test_a_full_loads_host_copies_wait_no_longer_than_the_loads_own_timeout(monkeypatch):
    """The host copies of a full update with deltas are bounded by the load op's timeout (its
    receive_timeout), not by a fixed one: a copy that does not finish in it raises, naming it."""
    from ckpt_core.delta.host_copy import HostCopier, HostMover
    from ckpt_core.errors import UpdateTimeoutError

    seen = []

    class Never(HostMover):   # a device copy that never reports done
        def record(self):
            class Done:
                def query(self):
                    return False
            return Done()

    class Recording(HostCopier):
        def copy(self, named, *, timeout):
            seen.append(timeout)
            return super().copy(named, timeout=timeout)

    state = SglangDeltas()
    state.copier = Recording(chunk_bytes=4096, chunks=2, threads=1, stage_devices=("cpu",), mover=lambda d: Never(),
                             alloc=lambda n: (torch.empty(n, dtype=torch.uint8), lambda: None))
    load = state.load(Model(), torch.device("cpu"), "A", keep=True, session=False, timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(UpdateTimeoutError, match="host copy"):
        with load.transaction():
            load.run(_weights()[:3])
    assert seen == [0.3] and time.monotonic() - t0 < 10
