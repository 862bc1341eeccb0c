"""Delta updates into a tensor-parallel (TP 2) SGLang: each rank's shards are reloaded through SGLang's
loader, its replicated tensors scattered, and the ranks agree.

Chain under test: a PS world of two rank processes (stock wire, CPU IPC buffers), each registering
half of every version, <- the stock worker loop that ``ckpt_sglang.staging.load``'s ``load`` op runs in
each of two SGLang scheduler processes (SGLang's own parallel state, gloo world of 2, its real TP
group and TP shard of ``Qwen2ForCausalLM``; sglang_support/tp.py). A tensor-parallel shard reads
part of its checkpoint tensor, so the map sends it to the reload (each worker keeps the whole
tensor; SGLang's loader shards it again); the norms are replicated and verbatim: scattered.
Versions: the AdamW chain of ``test_vllm_delta.py`` (A, then B on every tensor, C on layer 0's
attention only). After each update every parameter and buffer of each rank equals a cold load of
that version into a fresh shard. A delta whose post-apply check fails on one rank only is undone on
both (the ranks agree over SGLang's TP group), every rank back on its base byte for byte. Twice: with
SGLang's weight-update sessions (0.5.23's routes) and without them (0.5.17's: our loader runs the
reloaded modules' ``process_weights_after_loading`` itself).
"""

from __future__ import annotations

import json
import os

import httpx
import pytest

from ckpt_sglang import SglangClient
from sglang_support.fixtures import CONFIG, hf_weights, ready_engine
from support.world import PsWorld
from test_sglang_delta import sglang_module
from test_vllm_delta import _changed, _versions

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TP = 2
NAMES = ["A", "B", "C"]
SMALL_BUCKETS = {"PS_MAX_BUCKET_SIZE_GB": str(100_000 / (1 << 30)), "PS_NUM_SLOTS": "2"}


def _split(path, root, name: str) -> list[str]:
    """The version's tensors in two files, one per PS rank."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    names = sorted(tensors)
    out = []
    for r in range(TP):
        f = root / f"{name}-{r}.safetensors"
        save_file({n: tensors[n] for n in names[r::TP]}, str(f))
        out.append(str(f))
    return out


class Tp2:
    def __init__(self, eng, root):
        from safetensors.torch import save_file

        self.eng, self.root = eng, root
        src = root / "src.safetensors"
        save_file(hf_weights(11), str(src))
        self.files, self.dirs, self.shares = {}, {}, {}
        for name, f in zip(NAMES, _versions(src, root)):
            self.add(name, f)
        self.world = PsWorld("cpu", TP, init={"wire": "stock"}, env=SMALL_BUCKETS)

    def add(self, name: str, f) -> None:
        """Version ``name`` in file ``f``: a model directory for its cold load, and one share per PS rank."""
        d = self.root / f"version-{name}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(CONFIG))
        os.link(f, d / "model.safetensors")
        self.files[name], self.dirs[name], self.shares[name] = f, d, _split(f, self.root, name)

    def register(self, name: str, base: str | None = None) -> None:
        got = self.world.all("register", per_rank={r: (name, {"files": [self.shares[name][r]], "base": base})
                                                   for r in range(TP)})
        assert all(o.ok for o in got.values()), got
        got = self.world.all("gather", name)
        assert all(o.ok for o in got.values()), got

    def update(self, name: str, delta=False) -> dict:
        return self.world.all("call", ("sglang_support.ps_calls", "delta_update",
                                       (name, self.eng.url, 60, delta)), timeout=180)

    def state(self) -> list[dict]:
        """Every rank's parameters and buffers, read by the probe loader."""
        with SglangClient(self.eng.url, timeout=60) as client:
            return [w["digests"] for w in client.state_digests()]

    def assert_is(self, name: str, what: str) -> None:
        resp = httpx.get(f"{self.eng.url}/ckpt_test/cold_state", params={"model_dir": str(self.dirs[name])},
                         timeout=120)
        resp.raise_for_status()
        want, got = resp.json()["ranks"], self.state()
        assert len(got) == len(want) == TP
        for rank, (g, w) in enumerate(zip(got, want)):
            diff = sorted(n for n in set(g) | set(w) if g.get(n) != w.get(n))
            assert not diff, f"{what}: TP rank {rank} differs from a cold load of {name} in {diff[:6]}"

    def close(self) -> None:
        self.world.close()


@pytest.fixture(scope="module", params=[(), ("--without-sessions",)], ids=["sessions", "0.5.17-routes"])
def tp2(tmp_path_factory, request):
    """With SGLang's weight-update sessions (0.5.23: the session's end post-processes), and without them
    (0.5.17's routes: our loader runs the changed modules' post-processing itself)."""
    root = tmp_path_factory.mktemp("sglang-delta-tp2")
    with ready_engine(root, tp_size=TP, extra=request.param) as eng:
        t = Tp2(eng, root)
        try:
            yield t
        finally:
            t.close()


def _ok(outcomes) -> dict:
    assert all(o.ok for o in outcomes.values()), outcomes
    return outcomes


def test_deltas_at_tp2_reload_the_shards_and_equal_a_cold_load(tp2):
    tp2.register("A")
    full = _ok(tp2.update("A"))[0].value["workers"]
    assert all(w["path"] == "full" and w["map"]["refuse"] is None for w in full), full
    assert all(w["map"]["groups"] > 0 and w["map"]["kept_bytes"] > 0 for w in full), full
    tp2.assert_is("A", "after the full update of A")
    print(f"A at TP 2: maps {[w['map'] for w in full]}")
    for prev, name in (("A", "B"), ("B", "C")):
        tp2.register(name, base=prev)
        out = _ok(tp2.update(name, delta=True))
        tp2.assert_is(name, f"after the delta {prev} -> {name}")
        changed = _changed(tp2.files[prev], tp2.files[name])
        for rank, w in enumerate(out[0].value["workers"]):
            d = w["delta"]
            assert w["path"] == "delta" and d["scattered"] + d["reloaded"] == len(changed), d
            reloaded = set(d.get("reloaded_modules") or [])
            assert d["reloaded"] and "*" not in reloaded, d
            assert reloaded <= {sglang_module(n) for n in changed}, f"{name}: unchanged modules reloaded: {reloaded}"
            assert all(n.endswith("norm.weight") for n in d["scattered_tensors"]), d["scattered_tensors"]
            print(f"{prev} -> {name}, TP rank {rank}: {d['scattered']} scattered, {d['reloaded']} "
                  f"rebuilt, {d['reload_tensors']} tensors reloaded into {sorted(reloaded)} in {d['reload_s']:.4f} s")
        if name == "C":
            assert all(m.startswith("model.layers.0.self_attn.") for w in out[0].value["workers"]
                       for m in w["delta"]["reloaded_modules"])


def test_a_delta_failing_on_one_tp_rank_is_undone_on_both(tp2):
    if not _registered(tp2, "C"):   # run alone: the chain first
        test_deltas_at_tp2_reload_the_shards_and_equal_a_cold_load(tp2)
    import torch
    from safetensors.torch import load_file, save_file

    c = load_file(str(tp2.files["C"]))
    gen = torch.Generator().manual_seed(3)
    d = {n: (t.float() + 1e-2 * torch.randn(t.shape, generator=gen)).to(t.dtype) for n, t in c.items()}
    save_file(d, str(tp2.root / "vD.safetensors"))
    tp2.add("D", tp2.root / "vD.safetensors")
    tp2.register("D", base="C")
    # rank 1 only drops an element: its post-apply check fails; rank 0 applied (scattered and reloaded)
    # and undoes it once the ranks' agreement says rank 1 failed
    _set_env_on_rank(tp2, 1, "1")
    try:
        out = tp2.update("D", delta=True)
    finally:
        _set_env_on_rank(tp2, 1, None)
    assert not any(o.ok for o in out.values()), out
    assert all("digest" in o.message for o in out.values()), out
    tp2.assert_is("C", "after a delta that failed on TP rank 1")
    _ok(tp2.update("D", delta=True))
    tp2.assert_is("D", "after the same delta without the fault")


def _registered(tp2, name: str) -> bool:
    got = tp2.world.all("call", ("sglang_support.ps_calls", "registered", (name,)))
    return all(o.ok and o.value for o in got.values())


def _set_env_on_rank(tp2, rank: int, value) -> None:
    httpx.post(f"{tp2.eng.url}/ckpt_test/env", json={"CKPT_TEST_DELTA_DROP_ONE": value, "_rank": rank},
               timeout=30).raise_for_status()
