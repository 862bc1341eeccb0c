"""Delta updates into SGLang through our loader: SGLang's real app, managers, model code and loaders on CPU.

Chain under test: our PS (stock wire, in this process) <- the stock checkpoint-engine worker loop that
``ckpt_sglang.staging.load``'s ``load`` op runs inside the engine process (SGLang's own
``/update_weights_from_tensor`` -> ``WeightUpdater`` -> our custom loader), which feeds a full update
into SGLang's ``Qwen2ForCausalLM.load_weights`` (recorded, and mapped: ``ckpt_sglang/_delta.py``) and
applies a delta through ``ckpt_core.delta.apply.DeltaReceiver``: scattered into the live tensors that
hold the checkpoint's bytes, or rebuilt and reloaded through SGLang's ``load_weights`` for the modules
it loads into. sglang_support/engine.py says what is stood in on CPU.

The versions are the AdamW chain of ``test_vllm_delta.py`` (``_versions``): A, the bf16 of a random
Qwen2; B one AdamW step on every tensor (lr 1e-5); C one on layer 0's attention only; D one on the
norms and the embedding (lr 1e-2). After each update every parameter and buffer SGLang holds (the
probe loader's digests, ``SglangClient.state_digests``) equals a cold load of that version into a
fresh model, byte for byte. A wrong base, a dropped element (``CKPT_TEST_DELTA_DROP_ONE`` in the
engine) and a corrupted payload are each refused with the model on its base, byte for byte; the
fallback then sends the version whole.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
import torch

from ckpt_core import ParameterServer
from ckpt_core.errors import ConfigError, DeltaBaseError, RemoteWorkerError
from ckpt_sglang import SglangClient
from sglang_support.fixtures import CONFIG, hf_weights, ready_engine, run_launcher
from support.delta_world import corrupt_payload
from support.ports import free_port
from test_vllm_delta import _changed, _versions   # the same AdamW chain as the vLLM delta test

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NAMES = ["A", "B", "C", "D"]
SMALL_BUCKETS = {"PS_MAX_BUCKET_SIZE_GB": str(100_000 / (1 << 30)), "PS_NUM_SLOTS": "2"}
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}


def sglang_module(name: str) -> str:
    """The SGLang module a Hugging Face Qwen2 tensor loads into (q/k/v and gate/up fused)."""
    layer, _, _ = name.rpartition(".")
    head, _, leaf = layer.rpartition(".")
    return f"{head}.{FUSED.get(leaf, leaf)}" if head else FUSED.get(leaf, leaf)


class Rig:
    """The engine process, its client, a PS feeding it, and the versions A..D."""

    def __init__(self, eng, root):
        from safetensors.torch import save_file

        self.eng, self.root = eng, root
        self.client = SglangClient(eng.url, timeout=120)
        src = root / "src.safetensors"
        save_file(hf_weights(7), str(src))
        self.files = dict(zip(NAMES, _versions(src, root)))
        self.dirs = {}
        for name, f in self.files.items():
            d = root / f"version-{name}"
            d.mkdir()
            (d / "config.json").write_text(json.dumps(CONFIG))
            os.link(f, d / "model.safetensors")
            self.dirs[name] = d
        self._cold: dict[str, list] = {}
        self.ps = ParameterServer(rank=0, world_size=1, device="cpu", wire="stock", master_addr="127.0.0.1",
                                  master_port=free_port())

    def register(self, name: str, base: str | None = None) -> None:
        self.ps.register_checkpoint(name, files=[str(self.files[name])], base=base)
        self.ps.gather_metas(name)

    def update(self, name: str, delta=False) -> dict:
        return self.ps.update(name, self.client.req_func(deltas=True, weight_version=name), timeout=120,
                              delta=delta)

    def ensure(self, name: str, base: str | None = None) -> None:
        """Register ``name`` (with ``base``) unless an earlier test did."""
        if name not in self.ps._catalog.checkpoints:
            self.register(name, base)

    def stage(self, name: str, delta=False) -> dict:
        return self.ps.update(name, self.client.req_func(stage=name, deltas=True), timeout=120, delta=delta)

    def worker(self) -> dict:
        return self.client.last_report.workers[0]

    def state(self) -> list[dict]:
        return [w["digests"] for w in self.client.state_digests()]

    def cold(self, name: str) -> list[dict]:
        if name not in self._cold:
            resp = httpx.get(f"{self.eng.url}/ckpt_test/cold_state", params={"model_dir": str(self.dirs[name])},
                             timeout=120)
            resp.raise_for_status()
            self._cold[name] = resp.json()["ranks"]
        return self._cold[name]

    def assert_is(self, name: str, what: str) -> None:
        got, want = self.state(), self.cold(name)
        assert len(got) == len(want)
        for rank, (g, w) in enumerate(zip(got, want)):
            diff = sorted(n for n in set(g) | set(w) if g.get(n) != w.get(n))
            assert not diff, f"{what}: TP rank {rank} differs from a cold load of {name} in {diff[:6]}"

    def setenv(self, **env) -> None:
        httpx.post(f"{self.eng.url}/ckpt_test/env", json=env, timeout=30).raise_for_status()

    def close(self) -> None:
        self.ps.close()
        self.client.close()


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    saved = {k: os.environ.get(k) for k in SMALL_BUCKETS}
    os.environ.update(SMALL_BUCKETS)
    root = tmp_path_factory.mktemp("sglang-delta")
    try:
        with ready_engine(root) as eng:
            r = Rig(eng, root)
            try:
                yield r
            finally:
                r.close()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def test_a_chain_of_deltas_equals_a_cold_load_of_each_version(rig):
    rig.register("A")
    rig.update("A")
    full = rig.worker()
    assert full["path"] == "full" and full["map"]["refuse"] is None, full
    rig.assert_is("A", "after the full update of A")
    print(f"A: map {full['map']}")
    for i, name in enumerate(NAMES[1:], 1):
        prev = NAMES[i - 1]
        rig.register(name, base=prev)
        result = rig.update(name, delta=True)
        fig = rig.worker()
        assert fig["path"] == "delta" and fig["version"] == name, fig
        d = fig["delta"]
        rig.assert_is(name, f"after the delta {prev} -> {name}")
        changed = _changed(rig.files[prev], rig.files[name])
        scattered = set(d["scattered_tensors"])
        assert scattered <= changed, sorted(scattered - changed)
        assert d["scattered"] + d["reloaded"] == len(changed), (d, sorted(changed))
        reloaded = set(d.get("reloaded_modules") or [])
        assert "*" not in reloaded, d
        assert reloaded <= {sglang_module(n) for n in changed}, f"{name}: unchanged modules reloaded: {reloaded}"
        if name == "C":
            assert all(sglang_module(n).startswith("model.layers.0.self_attn.") for n in changed)
        ps = result["delta"]
        print(f"{prev} -> {name}: {ps['changed_tensors']} tensors / {ps['changed_elements']} of {ps['elements']} "
              f"elements changed, payload {ps['payload_bytes']} of {ps['full_bytes']} bytes; worker: "
              f"{d['scattered']} scattered, {d['reloaded']} reloaded ({sorted(reloaded)}), apply {d['apply_s']:.4f} s, "
              f"verify {d['verify_s']:.4f} s, reload {d.get('reload_s', 0.0):.4f} s")


def test_refusals_leave_the_model_on_its_base(rig):
    """Runs after the chain: the engine holds D (A, B, C, D registered)."""
    if "D" not in rig.ps._catalog.checkpoints:   # run alone: build the chain first
        test_a_chain_of_deltas_equals_a_cold_load_of_each_version(rig)
    # a wrong base: the delta of C applies to B, the engine holds D. The PS refuses it first (it made D
    # live); a fresh PS, which does not know what the engine holds, sends it and the worker refuses it.
    with pytest.raises(DeltaBaseError):
        rig.update("C", delta=True)
    rig.assert_is("D", "after the PS refused a delta of another base")
    other = ParameterServer(rank=0, world_size=1, device="cpu", wire="stock", master_addr="127.0.0.1",
                            master_port=free_port())
    try:
        for n, base in (("B", None), ("C", "B")):
            other.register_checkpoint(n, files=[str(rig.files[n])], base=base)
            other.gather_metas(n)
        with pytest.raises(DeltaBaseError, match="this worker holds 'D', not the base 'B'"):
            other.update("C", rig.client.req_func(deltas=True, weight_version="C"), timeout=120, delta=True)
        rig.assert_is("D", "after the worker refused a delta of another base")
        # the fallback sends C whole (and keeps what deltas need): the engine then holds C
        result = other.update("C", rig.client.req_func(deltas=True, weight_version="C"), timeout=120,
                              delta="fallback")
        assert "fallback" in result["delta"], result["delta"]
        rig.assert_is("C", "after the fallback")
    finally:
        other.close()
    # back to D as a delta of C from the PS that last made C live? It made D live: update D whole there
    rig.update("D")
    rig.assert_is("D", "after D whole")
    # E: one more AdamW-like step from D, registered against D
    from safetensors.torch import load_file, save_file
    d = load_file(str(rig.files["D"]))
    gen = torch.Generator().manual_seed(5)
    e = {n: (t.float() + 1e-2 * torch.randn(t.shape, generator=gen)).to(t.dtype) for n, t in d.items()}
    rig.files["E"] = rig.root / "vE.safetensors"
    save_file(e, str(rig.files["E"]))
    rig.register("E", base="D")
    # a dropped element: the post-apply digest fails, every write is undone
    rig.setenv(CKPT_TEST_DELTA_DROP_ONE="1")
    try:
        with pytest.raises(RemoteWorkerError, match="digest"):
            rig.update("E", delta=True)
    finally:
        rig.setenv(CKPT_TEST_DELTA_DROP_ONE=None)
    rig.assert_is("D", "after a delta that lost an element")
    # a corrupted payload: refused by its body check before anything is written
    changed = sorted(_changed(rig.files["D"], rig.files["E"]))
    assert corrupt_payload(rig.ps, 0, "E", changed[0])
    with pytest.raises(RemoteWorkerError, match="CheckpointFormatError"):
        rig.update("E", delta=True)
    rig.assert_is("D", "after a corrupted payload")
    assert rig.client.weight_versions()[0]["live"] == "D"


def test_a_delta_needs_a_req_func_that_takes_it(rig):
    """On the stock wire a delta is refused before anything moves unless the req_func says its engine
    applies deltas: SGLang's own IPC route would skip the payloads' unknown names with a warning."""
    if "B" not in rig.ps._catalog.checkpoints:
        rig.register("A")
        rig.register("B", base="A")
    with pytest.raises(ConfigError, match="accepts_deltas"):
        rig.ps.update("B", rig.client.req_func(weight_version="B"), timeout=60, delta=True)
    with pytest.raises(ConfigError, match="via"):
        rig.client.req_func(deltas=True, weight_version="B", via="ipc")
    with pytest.raises(ConfigError, match="weight_version"):
        rig.client.req_func(deltas=True)



def test_a_staged_delta_is_applied_by_the_commit(rig):
    """stage(..., deltas=True): a full stage's commit keeps what deltas need; a delta's payloads are staged
    while the engine serves (nothing live changes) and the commit applies them; a delta that fails its
    check at the commit is undone, the model on its base."""
    for i, name in enumerate(NAMES):
        rig.ensure(name, NAMES[i - 1] if i else None)
    rig.stage("A")
    rig.client.commit("A")
    full = rig.client.last_report.workers[0]
    assert full["path"] == "full" and full["map"]["refuse"] is None, full
    rig.assert_is("A", "after the staged full update of A")
    for prev, name in (("A", "B"), ("B", "C")):
        rig.stage(name, delta=True)
        rig.assert_is(prev, f"after staging the delta of {name}: nothing live changed")
        assert rig.client.weight_versions()[0]["staged"]["version"] == name
        rig.client.commit(name)
        fig = rig.client.last_report.workers[0]
        assert fig["path"] == "delta" and fig["delta"]["version"] == name, fig
        rig.assert_is(name, f"after committing the staged delta {prev} -> {name}")
    # a staged delta whose post-apply check fails at the commit: undone, the model on C
    rig.stage("D", delta=True)
    rig.setenv(CKPT_TEST_DELTA_DROP_ONE="1")
    try:
        with pytest.raises(RemoteWorkerError, match="digest"):
            rig.client.commit("D")
    finally:
        rig.setenv(CKPT_TEST_DELTA_DROP_ONE=None)
    rig.assert_is("C", "after a staged delta failed at its commit")
    assert rig.client.weight_versions()[0]["live"] == "C"
    # staging a delta of a base the engine does not hold is refused at its first bucket, nothing staged
    other = ParameterServer(rank=0, world_size=1, device="cpu", wire="stock", master_addr="127.0.0.1",
                            master_port=free_port())
    try:
        for n, base in (("A", None), ("B", "A")):
            other.register_checkpoint(n, files=[str(rig.files[n])], base=base)
            other.gather_metas(n)
        with pytest.raises(DeltaBaseError, match="this worker holds 'C', not the base 'A'"):
            other.update("B", rig.client.req_func(stage="B", deltas=True), timeout=120, delta=True)
    finally:
        other.close()
    assert rig.client.weight_versions()[0]["staged"] is None
    rig.assert_is("C", "after a refused stage")


def _launch(rig, name: str, *extra: str):
    proc = run_launcher("--checkpoint-path", str(rig.dirs[name]), "--checkpoint-name", name, "--endpoint",
                        rig.eng.url, "--inference-parallel-size", "1", "--device", "cpu", "--timeout", "120",
                        "--ready-timeout", "60", *extra, env=SMALL_BUCKETS)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    return proc, lines


def test_the_launcher_keeps_deltas_then_sends_only_the_delta(rig):
    """``python -m ckpt_sglang.update --deltas`` (A whole, deltas kept), then ``--base A
    --base-checkpoint-path`` (only the delta of B; the base is registered, not sent), then a base the
    server does not hold: ``--delta-mode strict`` fails with DeltaBaseError, the default falls back."""
    proc, lines = _launch(rig, "A", "--deltas")
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    rig.assert_is("A", "after the launcher's full update with --deltas")
    proc, lines = _launch(rig, "B", "--base", "A", "--base-checkpoint-path", str(rig.dirs["A"]))
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    line = lines[-1]
    assert line["method"] == "delta" and "fallback" not in line["ps"]["delta"], line
    assert line["ps"]["delta"]["payload_bytes"] < line["ps"]["delta"]["full_bytes"] / 4, line["ps"]["delta"]
    assert line["engine"][0]["workers"][0]["path"] == "delta", line["engine"]
    rig.assert_is("B", "after the launcher's delta A -> B")
    proc, lines = _launch(rig, "D", "--base", "C", "--base-checkpoint-path", str(rig.dirs["C"]),
                          "--delta-mode", "strict")
    assert proc.returncode == 1 and "DeltaBaseError" in proc.stderr, proc.stderr[-3000:]
    rig.assert_is("B", "after a strict delta of another base")
    proc, lines = _launch(rig, "D", "--base", "C", "--base-checkpoint-path", str(rig.dirs["C"]))
    assert proc.returncode == 0 and "fallback" in lines[-1]["ps"]["delta"], proc.stderr[-3000:]
    rig.assert_is("D", "after the launcher's fallback")
    proc, _ = _launch(rig, "D", "--deltas", "--via", "ipc")
    assert proc.returncode == 2 and "not with --via ipc" in proc.stderr, proc.stderr[-2000:]


def test_a_load_outside_our_loader_forgets_the_held_version(rig):
    """SGLang's own IPC route loads through the model's ``load_weights`` without our loader: the version
    our loader held is forgotten there, so a delta of it from a PS that did not make the other version
    live is refused by the worker (not applied to other weights), and its fallback sends it whole."""
    for i, name in enumerate(NAMES):
        rig.ensure(name, NAMES[i - 1] if i else None)
    rig.update("C")   # C whole, deltas kept: the worker holds C
    assert rig.client.weight_versions()[0]["live"] == "C"
    rig.ps.update("A", rig.client.req_func(weight_version="A", via="ipc"), timeout=120)   # SGLang's IPC route
    assert rig.client.last_report.path == "ipc"
    rig.assert_is("A", "after SGLang's IPC update of A")
    other = ParameterServer(rank=0, world_size=1, device="cpu", wire="stock", master_addr="127.0.0.1",
                            master_port=free_port())
    try:   # a PS that does not know the engine moved to A: the delta of D applies to C
        for n, base in (("C", None), ("D", "C")):
            other.register_checkpoint(n, files=[str(rig.files[n])], base=base)
            other.gather_metas(n)
        with pytest.raises(DeltaBaseError, match="this worker holds None"):
            other.update("D", rig.client.req_func(deltas=True, weight_version="D"), timeout=120, delta=True)
        rig.assert_is("A", "after a delta refused by a worker that forgot its version")
        result = other.update("D", rig.client.req_func(deltas=True, weight_version="D"), timeout=120,
                              delta="fallback")
        assert "fallback" in result["delta"], result["delta"]
        rig.assert_is("D", "after the fallback")
    finally:
        other.close()
