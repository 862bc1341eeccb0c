"""Our loader's ``load`` op (``ckpt_sglang.staging.EngineStaging.load``) on one rank, with the stock
loop and SGLang's model stood in: what it loads, when it post-processes (only outside a weight-update
session: 0.5.23's session end does it there), and that a failure leaves no version live. The whole
chain through SGLang's real app and loader, at TP 1 and 2: tests/integration/test_sglang_staged*.py."""

from __future__ import annotations

import pytest
import torch

from ckpt_sglang import staging
from ckpt_sglang.staging import EngineStaging

KEY = "GPU-test"


class QuantMethod:
    def __init__(self, calls):
        self.calls = calls

    def process_weights_after_loading(self, module):
        self.calls.append(("process", module.name))


class Model(torch.nn.Module):
    """Two quantized linears; records what SGLang's loader and post-processing were asked to do."""

    def __init__(self, fail_at: int = -1):
        super().__init__()
        self.calls: list = []
        self.fail_at = fail_at
        for name in ("a", "b"):
            layer = torch.nn.Linear(2, 2)
            layer.name, layer.quant_method = name, QuantMethod(self.calls)
            setattr(self, name, layer)

    def load_weights(self, weights):
        names = [n for n, _ in weights]
        if len([c for c in self.calls if c[0] == "load"]) == self.fail_at:
            raise RuntimeError("injected load_weights failure")
        self.calls.append(("load", names))

    def post_load_weights(self):
        self.calls.append(("post_load_weights",))


BUCKETS = [[("w1", torch.randn(3, 2))], [("w2", torch.randn(4)), ("w3", torch.randn(2, 2))]]


@pytest.fixture
def loop(monkeypatch):
    """The stock loop stood in: it hands ``run`` each bucket (a failure aborts, as the PS then does)."""
    seen = {}

    def fake_loop(handle, device, device_id, timeout_s, *, run, post_hook=None, side_stream=True,
                  reply_hook_error=False):
        seen.update(handle=handle, side_stream=side_stream, reply_hook_error=reply_hook_error)
        for bucket in BUCKETS:
            run(bucket)
        if post_hook is not None:
            post_hook()

    monkeypatch.setattr(staging, "run_stock_loop", fake_loop)
    monkeypatch.setattr(staging, "_device_of", lambda model: (torch.device("cpu"), KEY, 0))
    return seen


@pytest.mark.parametrize("session", [False, True])
def test_a_load_feeds_each_bucket_to_load_weights_and_post_processes_only_outside_a_session(loop, session):
    engine, model = EngineStaging(), Model()
    out = engine.load(model, {"weights": "v1", "handles": {KEY: "ipc://@h"}, "session": session})
    loads = [c for c in model.calls if c[0] == "load"]
    # the load asks the loop to answer a failing post hook to the PS (its deltas apply there)
    assert loads == [("load", ["w1"]), ("load", ["w2", "w3"])]
    assert loop == {"handle": "ipc://@h", "side_stream": False, "reply_hook_error": True}
    post = [c for c in model.calls if c[0] != "load"]
    assert post == ([] if session else [("process", "a"), ("process", "b"), ("post_load_weights",)])
    assert model.calls[:2] == loads, "post-processing ran before the last bucket"
    assert out["tensors"] == 3 and out["bytes"] == (6 + 4 + 4) * 4 and out["version"] == "v1"
    assert engine.state(model, {})["live"] == "v1" and engine.layout == {"w1": ("float32", (3, 2)),
                                                                         "w2": ("float32", (4,)),
                                                                         "w3": ("float32", (2, 2))}


@pytest.mark.parametrize("fail_at", [0, 1])
def test_a_load_weights_failure_is_the_loads_error_a_possible_mix_and_nothing_is_live(loop, fail_at):
    """At its first call too: SGLang's loader may have written part of that bucket before it raised."""
    engine, model = EngineStaging(), Model(fail_at=fail_at)
    engine.load(Model(), {"weights": "v1", "handles": {KEY: "h"}})
    with pytest.raises(Exception, match="the load of 'v2' failed: RuntimeError: injected load_weights failure; the "
                                        "model may hold a mix of both versions: push a full update$") as info:
        engine.load(model, {"weights": "v2", "handles": {KEY: "h"}})
    assert type(info.value).__name__ == "RemoteWorkerError"
    assert [c[0] for c in model.calls] == ["load"] * fail_at, "post-processing ran after a failed load"
    assert engine.state(model, {})["live"] is None, "a failed load left a version live"


@pytest.mark.parametrize("session", [False, True])
def test_a_load_whose_ps_is_gone_before_any_bucket_says_nothing_was_loaded_and_keeps_the_live_version(
        loop, monkeypatch, session):
    """The stock loop ends before its first bucket (here the PS's handle bound by nobody): no
    ``load_weights`` call, no post-processing, and the version made live before is still reported live."""
    from ckpt_core.errors import TransportError

    engine = EngineStaging()
    engine.load(Model(), {"weights": "v1", "handles": {KEY: "h"}})
    since = engine.state(None, {})["live_since"]

    def gone(handle, device, device_id, timeout_s, *, run, post_hook=None, side_stream=True, reply_hook_error=False):
        raise TransportError("the parameter server's socket ipc://@h is not bound: it gave the update up")

    monkeypatch.setattr(staging, "run_stock_loop", gone)
    model = Model()
    with pytest.raises(Exception, match="^the load of 'v2' failed: TransportError: the parameter server's socket "
                                        "ipc://@h is not bound: it gave the update up; nothing was loaded on any TP "
                                        "rank: the engine still holds version 'v1'$") as info:
        engine.load(model, {"weights": "v2", "handles": {KEY: "h"}, "session": session})
    assert type(info.value).__name__ == "RemoteWorkerError"
    assert model.calls == [], "a load whose PS was gone touched the model"
    state = engine.state(model, {})
    assert (state["live"], state["live_since"]) == ("v1", since), "a load that wrote nothing changed the live version"
    assert "w1" in engine.layout, "a load that wrote nothing changed the layout a stage is checked against"
    fresh = EngineStaging()   # nothing of ours made live yet: it says what it can
    with pytest.raises(Exception, match="nothing was loaded on any TP rank: the engine still holds the weights it "
                                        "held \\(no version of ours was live\\)$"):
        fresh.load(model, {"weights": "v2", "handles": {KEY: "h"}})
    assert fresh.state(model, {})["live"] is None and fresh.state(model, {})["live_since"] is None


def test_a_failure_of_the_post_load_processing_after_the_last_bucket_is_a_possible_mix(loop, monkeypatch):
    engine, model = EngineStaging(), Model()
    engine.load(Model(), {"weights": "v1", "handles": {KEY: "h"}})

    def fails(*a, **k):
        raise RuntimeError("injected post-load failure")

    monkeypatch.setattr(staging, "_post_load", fails)
    with pytest.raises(Exception, match="injected post-load failure; the model may hold a mix of both versions"):
        engine.load(model, {"weights": "v2", "handles": {KEY: "h"}})
    assert engine.state(model, {})["live"] is None


def test_a_load_without_a_handle_for_this_device_or_with_a_stage_in_the_way_changes_nothing(loop):
    from ckpt_core.errors import ConfigError

    engine, model = EngineStaging(), Model()
    with pytest.raises(ConfigError, match="cannot run the load of 'v1': no ZeroMQ handle for the device GPU-test"):
        engine.load(model, {"weights": "v1", "handles": {"GPU-other": "h"}})
    engine.area = staging.SglangStagingArea("s1", torch.device("cpu"), 0)
    with pytest.raises(ConfigError, match="version 's1' is staged \\(commit or drop it first\\)"):
        engine.load(model, {"weights": "v1", "handles": {KEY: "h"}})
    assert model.calls == [] and engine.area is not None and engine.state(model, {})["live"] is None


def _staged(engine: EngineStaging, version: str, buckets, delta: bool = False) -> None:
    area = staging.SglangStagingArea(version, torch.device("cpu"), 0, keep=delta, delta=delta)
    for bucket in buckets:
        area.add(bucket)
    area.layout = {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for b in buckets for n, t in b}
    area.sealed = True
    engine.area = area


def test_a_commit_whose_load_weights_fails_is_a_possible_mix_and_one_refused_before_writing_keeps_the_version(loop):
    """A full commit failing at its first ``load_weights`` may have written part of that bucket; a staged
    delta refused at its first bucket (this worker holds no base) wrote nothing: the version stays live."""
    from ckpt_core.delta.versions import manifest_name

    engine = EngineStaging()
    engine.load(Model(), {"weights": "v1", "handles": {KEY: "h"}})
    _staged(engine, "v2", BUCKETS)
    with pytest.raises(Exception, match="^SGLang's load_weights failed while committing 'v2': RuntimeError: "
                                        "injected load_weights failure; the model may hold a mix of both versions"):
        engine.commit(Model(fail_at=0), {"weights": "v2", "session": True})
    assert engine.state(None, {})["live"] is None
    engine.load(Model(), {"weights": "v1", "handles": {KEY: "h"}})
    since = engine.state(None, {})["live_since"]
    _staged(engine, "v3", [[(manifest_name("v1", "v3", 0, 1), torch.zeros(8, dtype=torch.uint8))]], delta=True)
    model = Model()
    with pytest.raises(Exception, match="^the delta failed while committing 'v3': DeltaBaseError: this worker holds "
                                        "None, not the base 'v1' of the delta of 'v3': nothing was written \\(update "
                                        "it whole\\); nothing was loaded on any TP rank: the engine still holds "
                                        "version 'v1'$"):
        engine.commit(model, {"weights": "v3", "session": True})
    state = engine.state(model, {})
    assert model.calls == [] and (state["live"], state["live_since"]) == ("v1", since)
