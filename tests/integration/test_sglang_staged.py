"""Stage while SGLang generates, commit in a short pause: SGLang's real app, managers and loader on CPU.

Chain under test: our PS (stock wire, in this process) <- the stock checkpoint-engine worker loop
in a receiver thread that ``ckpt_sglang.staging.load`` starts inside the engine process, called by
SGLang's own ``/update_weights_from_tensor`` -> ``SchedulerWeightUpdaterManager`` ->
``WeightUpdater`` (custom weight loader, ``--custom-weight-loader ckpt_sglang.staging.load``),
inside SGLang's ``/begin_weight_update`` .. ``/end_weight_update`` session, between
``/pause_generation`` and ``/continue_generation``. The commit feeds the staged buckets to SGLang's
``Qwen2ForCausalLM.load_weights``. sglang_support/engine.py says what is stood in on CPU (the
scheduler's decode loop among it: greedy steps of Hugging Face's Qwen2 on SGLang's live
parameters, under the lock weight calls take). References: transformers' Qwen2 loaded from the
checkpoint files, in the SGLang venv (sglang_support/hf_reference.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import httpx
import pytest
import torch

from ckpt_core import ParameterServer
from ckpt_core.engines.base import mixed_weight_version
from ckpt_core.errors import ConfigError, RemoteWorkerError
from ckpt_sglang import SglangClient
from support.ports import free_port
from support.traffic import Traffic
from sglang_support.fixtures import REPO, ready_engine, run_launcher, sglang_python, write_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [[5, 17, 42, 99], [200, 3, 3, 81, 7, 150]]
MAX_NEW = 6
# buckets of ~100 KiB: the 0.4 MB model travels in several, through both slots of the ring
SMALL_BUCKETS = {"PS_MAX_BUCKET_SIZE_GB": str(100_000 / (1 << 30)), "PS_NUM_SLOTS": "2"}


def hf_reference(ckpts, prompts=PROMPTS, max_new=MAX_NEW) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in (REPO / "tests" / "integration",)))
    out = subprocess.run([sglang_python(), "-m", "sglang_support.hf_reference", *sum((["--ckpt", str(c)] for c in ckpts), []),
                          "--prompts", json.dumps(prompts), "--max-new", str(max_new)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


class Engine:
    """The engine process, its client, a PS feeding it, and the checkpoints of this module."""

    def __init__(self, eng, root):
        self.eng, self.root = eng, root
        self.client = SglangClient(eng.url, timeout=120)
        self.ckpts = {seed: write_checkpoint(root / f"step-{seed}", seed=seed) for seed in (1, 2, 3)}
        self.refs = {seed: v for seed, v in zip(self.ckpts, hf_reference([c for c, _ in self.ckpts.values()]).values())}
        self.ps = ParameterServer(rank=0, world_size=1, device="cpu", wire="stock", master_addr="127.0.0.1",
                                  master_port=free_port())
        for seed, (ckpt, _) in self.ckpts.items():
            self.ps.register_checkpoint(f"s{seed}", files=sorted(str(p) for p in ckpt.glob("*.safetensors")))
            self.ps.gather_metas(f"s{seed}")

    def generate(self, prompts=PROMPTS, max_new=MAX_NEW) -> list[list[int]]:
        return [self.request(p, max_new)["tokens"] for p in prompts]

    def request(self, prompt, max_new) -> dict:
        resp = httpx.post(f"{self.eng.url}/ckpt_test/generate", json={"prompt": prompt, "max_new_tokens": max_new},
                          timeout=180)
        resp.raise_for_status()
        return resp.json()

    def params(self) -> dict:
        return self.eng.state()["params"]

    def stage(self, seed: int, version: str) -> dict:
        return self.ps.update(f"s{seed}", self.client.req_func(stage=version), timeout=120)

    def close(self) -> None:
        self.ps.close()
        self.client.close()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    saved = {k: os.environ.get(k) for k in SMALL_BUCKETS}
    os.environ.update(SMALL_BUCKETS)
    root = tmp_path_factory.mktemp("sglang-staged")
    try:
        with ready_engine(root) as eng:
            e = Engine(eng, root)
            try:   # a plain update first: the server serves step 1 as "w1"
                e.ps.update("s1", e.client.req_func(weight_version="w1"), timeout=120)
                yield e
            finally:
                e.close()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def test_a_stage_under_traffic_changes_nothing_live_then_commit_switches_in_a_short_pause(engine):
    e = engine
    assert e.generate() == e.refs[1]
    live = e.params()
    httpx.post(f"{e.eng.url}/ckpt_test/next_stage", params={"slow_s": 0.1}, timeout=30).raise_for_status()
    # long requests back to back through the engine's decode loop; each token's time is the engine's
    # (a request spans the stage: its tokens do not depend on this process, where the PS runs)
    with Traffic(lambda on_token: [on_token(t) for t in e.request(PROMPTS[0], 64)["times"]],
                 first_token_s=60, join_s=120) as traffic:
        t0 = time.time()
        result = e.stage(2, "w2")
        t1 = time.time()
        opened = e.client.last_report.seconds["paused"]
        time.sleep(0.5)
        assert e.params() == live, "a stage changed a live parameter"
        assert e.generate() == e.refs[1], "a stage changed what the engine serves"
        staged = e.client.weight_versions()[0]
        assert staged["staged"]["version"] == "w2" and staged["staged"]["sealed"] and staged["receiving"] is None
        assert staged["staged"]["tensors"] == 27 and staged["sglang_weight_version"] == "w1"
        commit = e.client.commit("w2")
        assert not traffic.failures, traffic.failures
    during, idle = traffic.tokens_between(t0 + opened, t1), traffic.tokens_between(t1, t1 + 0.5)
    want = e.ckpts[2][1]
    assert {n: e.params()[n] for n in want} == want, "after the commit SGLang's parameters equal step 2"
    assert e.generate() == e.refs[2], "greedy output after the commit equals transformers on step 2"
    after = e.client.weight_versions()[0]
    assert after["live"] == "w2" and after["staged"] is None and after["sglang_weight_version"] == "w2"
    assert e.client.model_info()["weight_version"] == "w2"
    assert e.eng.state()["paused"] is None, "generation was continued"
    # the bucket copies alone take 0.5 s (5 x 0.1 s): a decode step is a few ms
    assert during >= 5, f"{during} tokens while the stage ran: it blocked generation"
    t2 = time.perf_counter()
    e.ps.update("s1", e.client.req_func(weight_version="w1", pause="retract"), timeout=120)
    plain = time.perf_counter() - t2
    assert e.generate() == e.refs[1]
    print(f"stage of {result['bytes']} bytes in {result['buckets']} buckets (0.1 s added per bucket): {t1 - t0:.3f} s, "
          f"of which {opened * 1e3:.1f} ms paused to open it; {during} tokens during the rest "
          f"({during / max(t1 - t0 - opened, 1e-9):.0f}/s; {idle / 0.5:.0f}/s right after); commit paused "
          f"generation {commit.seconds['paused'] * 1e3:.1f} ms "
          f"({ {k: round(v * 1e3, 1) for k, v in commit.seconds.items()} } ms); a plain update paused (retract) "
          f"around the whole transfer: {plain * 1e3:.1f} ms")


def test_a_request_streaming_across_the_commit_gets_old_then_new_weight_tokens(engine):
    e = engine
    e.stage(3, "w3")
    out, max_new = {}, 120
    steps = httpx.get(f"{e.eng.url}/ckpt_test/traffic", timeout=30).json()["steps"]
    req = threading.Thread(target=lambda: out.update(e.request(PROMPTS[1], max_new)), daemon=True)
    req.start()
    deadline = time.time() + 60
    while httpx.get(f"{e.eng.url}/ckpt_test/traffic", timeout=30).json()["steps"] < steps + 5:
        assert time.time() < deadline and not out, "the request did not get its first tokens while running"
        time.sleep(0.01)
    assert not out, "the request ended before the commit"
    e.client.commit("w3")
    req.join(120)
    tokens, versions = out["tokens"], out["versions"]
    cut = versions.index("w3")
    assert 0 < cut < max_new and set(versions[:cut]) == {"w1"} and set(versions[cut:]) == {"w3"}, versions
    old, new = hf_reference([e.ckpts[1][0]], [PROMPTS[1]], cut), hf_reference(
        [e.ckpts[3][0]], [PROMPTS[1] + tokens[:cut]], max_new - cut)
    assert tokens[:cut] == list(old.values())[0][0], "tokens before the commit come from the old weights"
    assert tokens[cut:] == list(new.values())[0][0], "tokens after the commit come from the new weights"
    e.ps.update("s1", e.client.req_func(weight_version="w1", pause="retract"), timeout=120)


def test_commit_of_nothing_or_of_another_version_is_refused_and_changes_nothing(engine):
    e = engine
    e.client.drop_staged()   # nothing staged, whatever an earlier test left
    live = e.params()
    with pytest.raises(RemoteWorkerError, match="cannot commit version 'x1': nothing is staged"):
        e.client.commit("x1")
    e.stage(2, "x2")
    with pytest.raises(RemoteWorkerError, match="cannot commit version 'x3': version 'x2' is staged"):
        e.client.commit("x3")
    e.ps.update("s3", e.client.req_func(stage="x3", stage_pause=None), timeout=120)   # replaces x2; no pause
    assert e.client.last_report.seconds.keys().isdisjoint({"pause", "resume"})
    with pytest.raises(RemoteWorkerError, match="version 'x3' is staged"):
        e.client.commit("x2")
    assert e.params() == live and e.generate() == e.refs[1]
    assert e.client.model_info()["weight_version"] == "w1", "a refused commit set a weight version"
    assert e.eng.state()["paused"] is None, "a refused commit left generation paused"
    dropped = e.client.drop_staged()
    assert dropped[0]["version"] == "x3" and e.client.weight_versions()[0]["staged"] is None
    with pytest.raises(ConfigError, match="commit pauses with one of"):
        e.client.commit("x3", pause="abort")


def test_a_stage_failing_mid_way_leaves_the_old_weights_serving_exactly(engine):
    e = engine
    live = e.params()
    httpx.post(f"{e.eng.url}/ckpt_test/next_stage", params={"fail_after": 2}, timeout=30).raise_for_status()
    with pytest.raises(RemoteWorkerError, match="injected failure after 2 staged bucket"):
        e.stage(2, "bad")
    state = e.client.weight_versions()[0]
    assert state["staged"] is None and state["receiving"] is None, "a failed stage left a staging area"
    assert "injected failure" in state["last_stage_error"]
    assert e.params() == live and e.generate() == e.refs[1], "a failed stage changed what the engine serves"
    with pytest.raises(RemoteWorkerError, match="nothing is staged"):
        e.client.commit("bad")
    e.stage(2, "good")   # the next stage and commit work
    e.client.commit("good")
    assert e.generate() == e.refs[2]
    e.ps.update("s1", e.client.req_func(weight_version="w1"), timeout=120)


def _silent_ps():
    """A PS rank's stock-wire socket that is bound and never sends (a REQ, as ``StockLink`` binds it)."""
    import uuid

    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    address = f"ipc://@checkpoint-engine-test-silent-{uuid.uuid4().hex}.sock"
    sock.bind(address)
    return ctx, sock, address


def test_a_stage_waiting_on_a_silent_ps_is_dropped_at_once_and_the_next_updates_run(engine):
    """A stage whose PS is bound but never sends (it waits on another PS rank that refused the update,
    say; the receive timeout 120 s) waits for a first message that never comes. A direct load meanwhile
    is refused (drop it first); ``drop_staged`` ends the wait within a poll and answers at once, nothing
    staged or receiving; a new stage replaces one still waiting the same way; the next stage, commit and
    update run and serve what they should. Before, every stage, load and drop was refused as "still being
    staged" until the receive timeout."""
    from ckpt_core import local_device_key

    e = engine
    ctx, sock, address = _silent_ps()
    try:
        silent = {local_device_key("cpu", 0): address}
        e.client.stage(silent, "given-up", timeout=120)
        time.sleep(1.5)   # past the receiver's first looks at the handle: bound, so it waits on
        assert e.client.weight_versions()[0]["receiving"] == "given-up"
        with pytest.raises(RemoteWorkerError, match="version 'given-up' is still being staged \\(drop it first\\)"):
            e.client.update(silent, weight_version="n1", via="loader", timeout=20)
        t0 = time.monotonic()
        dropped = e.client.drop_staged()
        took = time.monotonic() - t0
        assert dropped == [None], dropped   # nothing had been staged
        assert took < 10, f"dropping a stage that waited for its PS took {took:.1f} s"   # generous: a poll is 0.2 s
        state = e.client.weight_versions()[0]
        assert state["receiving"] is None and state["staged"] is None, state
        assert "the stage of 'given-up' was dropped" in state["last_stage_error"], state
        e.client.stage(silent, "given-up-2", timeout=120)
        t1 = time.monotonic()
        e.stage(2, "after-drop")   # replaces the waiting stage, then receives from a PS that sends
        replaced = time.monotonic() - t1
    finally:
        sock.close(0)
        ctx.term()
    state = e.client.weight_versions()[0]
    assert state["staged"]["version"] == "after-drop" and state["receiving"] is None, state
    e.client.commit("after-drop")
    assert e.generate() == e.refs[2] and e.client.model_info()["weight_version"] == "after-drop"
    e.ps.update("s1", e.client.req_func(weight_version="w1"), timeout=120)   # the next direct update runs
    assert e.generate() == e.refs[1] and e.client.weight_versions()[0]["live"] == "w1"
    print(f"a stage waiting for a silent PS: dropped in {took:.2f} s; a stage replacing one took {replaced:.2f} s")


def test_a_load_or_stage_whose_ps_gave_up_before_it_connected_ends_at_once_and_the_next_update_runs(engine):
    """A direct load through our loader runs in the scheduler's own call: nobody can stop it. One whose
    PS gave the update up before the scheduler ran it (its deadline, a stop, its death: here a handle
    bound by nobody; the receive timeout 120 s) fails within seconds with the TransportError saying so,
    the engine untouched (every parameter, what it serves, SGLang's weight_version); the error says that
    nothing was loaded and which version the engine still holds, and ``weight_versions()`` still reports
    that version live (since the same time): no full update is needed. A stage of such a PS ends by
    itself the same way, nothing staged or receiving, and needs no drop; the next update runs. Before,
    the load held the scheduler for the whole receive timeout, and then reported a possible mix."""
    import uuid

    from ckpt_core import local_device_key

    e = engine
    e.ps.update("s1", e.client.req_func(weight_version="w1", via="loader"), timeout=120)
    live, served, before = e.params(), e.generate(), e.client.weight_versions()[0]
    gone = {local_device_key("cpu", 0): f"ipc://@checkpoint-engine-test-gone-{uuid.uuid4().hex}.sock"}
    t0 = time.monotonic()
    with pytest.raises(RemoteWorkerError, match="is not bound: it gave the update up \\(deadline, stop or death\\) "
                                                "before this receiver connected; nothing was loaded; nothing was "
                                                "loaded on any TP rank: the engine still holds version 'w1'$") as info:
        e.client.update(gone, weight_version="n1", via="loader", timeout=120)
    took = time.monotonic() - t0
    assert "mix" not in str(info.value), info.value
    assert took < 30, f"the load waited {took:.1f} s for a PS that was gone"   # a never-bound handle: the 10 s grace
    assert e.params() == live and e.generate() == served == e.refs[1]
    assert e.client.model_info()["weight_version"] == "w1", "a load that loaded nothing set a weight version"
    after = e.client.weight_versions()[0]
    assert (after["live"], after["live_since"]) == ("w1", before["live_since"]), \
        f"a load that wrote nothing changed the live version: {before} -> {after}"
    e.client.stage(gone, "gone-stage", timeout=120)
    deadline = time.monotonic() + 30
    while (state := e.client.weight_versions()[0])["receiving"] is not None:
        assert time.monotonic() < deadline, f"the stage still waits for a PS that was gone: {state}"
        time.sleep(0.2)
    assert state["staged"] is None and "is not bound" in (state["last_stage_error"] or ""), state
    assert e.params() == live
    e.ps.update("s2", e.client.req_func(weight_version="w2", via="loader"), timeout=120)   # the next update runs
    assert e.generate() == e.refs[2] and e.client.weight_versions()[0]["live"] == "w2"
    e.ps.update("s1", e.client.req_func(weight_version="w1"), timeout=120)
    assert e.generate() == e.refs[1]
    print(f"a direct load whose PS was gone failed in {took:.2f} s")


def test_a_slice_plan_on_the_stock_wire_is_refused_before_anything_moves(engine):
    """SGLang's own loader receives whole tensors through the stock wire, which has no slices: an
    update with a slice plan is a ConfigError before the engine is asked; the next update works."""
    from ckpt_core.checkpoint.safetensors import WIRE_DTYPES
    from ckpt_core.planning.slices import SliceKey, split_plan

    e = engine
    live = e.params()
    specs = e.ps.tensor_specs("s2")
    plan = split_plan(SliceKey("sglang-tiny", "tp=1", "test"),
                      {n: (d, s, WIRE_DTYPES[d].itemsize) for n, (d, s) in specs.items()}, 1, {})
    asked = []
    with pytest.raises(ConfigError, match="slices are supported with the native wire only"):
        e.ps.update("s2", asked.append, slices=plan, timeout=60)
    assert not asked and e.params() == live and e.generate() == e.refs[1]
    e.ps.update("s1", e.client.req_func(weight_version="w1"), timeout=120)


def _lines(proc) -> list[dict]:
    assert proc.returncode == 0, f"launcher failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]


def test_the_launcher_stages_then_commits_and_a_commit_alone_of_nothing_fails(engine):
    e = engine
    ckpt, want = e.ckpts[3]
    common = ("--endpoint", e.eng.url, "--inference-parallel-size", "1", "--device", "cpu", "--timeout", "120",
              "--ready-timeout", "60")
    lines = _lines(run_launcher("--checkpoint-path", str(ckpt), *common, "--stage", "--version", "L3", "--commit",
                                env=SMALL_BUCKETS))
    assert [x["method"] for x in lines] == ["broadcast", "commit"], lines
    assert lines[1]["version"] == "L3" and lines[1]["paused_ms"] > 0 and lines[0]["ps"]["buckets"] >= 4
    assert {n: e.params()[n] for n in want} == want and e.client.model_info()["weight_version"] == "L3"
    assert e.generate() == e.refs[3]
    proc = run_launcher(*common, "--commit", "--weight-version", "L4")
    assert proc.returncode == 1 and "RemoteWorkerError" in proc.stderr and "nothing is staged" in proc.stderr, \
        proc.stderr[-3000:]
    proc = run_launcher("--checkpoint-path", str(ckpt), *common, "--stage")
    assert proc.returncode == 2 and "--stage and --commit need --weight-version" in proc.stderr
    e.ps.update("s1", e.client.req_func(weight_version="w1"), timeout=120)
    assert e.generate() == e.refs[1]


def test_the_service_stages_and_commits_into_sglang(engine, tmp_path):
    """A controller over HTTP only: ``update`` with ``stage`` on a ``--wire stock`` service, then
    ``POST /v1/commit`` with ``engine: "sglang"``; a commit of another version is a 502 that changes nothing."""
    pytest.importorskip("fastapi")
    from support.service_world import ServiceWorld

    e = engine
    ckpt, want = e.ckpts[2]
    svc = ServiceWorld(1, str(tmp_path), extra=["--wire", "stock", "--max-bucket-gb", SMALL_BUCKETS["PS_MAX_BUCKET_SIZE_GB"]],
                       env={"PS_NUM_SLOTS": "2"}, allow_dirs=(str(ckpt),))
    try:
        c = svc.clients[0]
        files = sorted(str(p) for p in ckpt.glob("*.safetensors"))
        assert c.post("/v1/checkpoints/s2/files", json={"files": files}).status_code == 200
        assert c.post("/v1/checkpoints/s2/gather-metas").status_code == 200
        resp = c.post("/v1/checkpoints/s2/update", json={"engine": "sglang", "update_url": e.eng.url, "stage": "svc2",
                                                          "timeout": 120})
        assert resp.status_code == 200, resp.text
        assert e.generate() == e.refs[1], "a staged update changed what SGLang serves"
        resp = c.post("/v1/commit", json={"engine": "sglang", "update_url": e.eng.url, "version": "other"})
        assert resp.status_code == 502 and "version 'svc2' is staged" in resp.text, resp.text
        assert e.generate() == e.refs[1]
        resp = c.post("/v1/commit", json={"engine": "sglang", "update_url": e.eng.url, "version": "svc2"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["result"]["seconds"]["paused"] > 0
        assert {n: e.params()[n] for n in want} == want and e.client.model_info()["weight_version"] == "svc2"
        resp = c.post("/v1/commit", json={"engine": "sglang", "update_url": e.eng.url, "version": "x", "pause": "keep"})
        assert resp.status_code == 422 and "a sglang commit pauses with one of" in resp.text, resp.text
    finally:
        assert svc.close() == [0]
    e.ps.update("s1", e.client.req_func(weight_version="w1"), timeout=120)


def _doc_block(title: str) -> str:
    """The first python block after the paragraph starting with ``title`` in docs/sglang.md."""
    text = (REPO / "docs" / "sglang.md").read_text()
    start = text.index(title)
    block = text.index("```python\n", start) + len("```python\n")
    return text[block:text.index("```", block)]


def test_the_async_rl_controller_loop_of_the_docs_runs_as_written(engine, monkeypatch):
    e = engine
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    seen = []

    def rollout(client):
        seen.append(e.generate())

    checkpoints = [(f"loop-{seed}", sorted(str(p) for p in e.ckpts[seed][0].glob("*.safetensors"))) for seed in (2, 3)]
    exec(_doc_block("The asynchronous-RL controller loop"),
         {"URL": e.eng.url, "checkpoints": checkpoints, "rollout": rollout})
    assert seen == [e.refs[1], e.refs[2]], "each batch ran on the weights live before its step's commit"
    assert e.generate() == e.refs[3] and e.client.model_info()["weight_version"] == "loop-3"
    e.ps.update("s1", e.client.req_func(weight_version="w1"), timeout=120)


def _altered(src, dst, *, drop=None, reshape=None):
    """A copy of checkpoint directory ``src`` with one tensor dropped or given another shape."""
    from ckpt_core.checkpoint.safetensors import read_tensors, write_file

    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    for f in sorted(src.glob("*.safetensors")):
        tensors = {n: t for n, t in read_tensors(f).items() if n != drop}
        if reshape in tensors:
            tensors[reshape] = torch.randn(3, 7)
        write_file(dst / f.name, tensors)
    return dst


def test_a_stage_that_does_not_match_the_last_commit_is_refused_and_changes_nothing(engine, tmp_path):
    e = engine
    e.stage(1, "base")
    e.client.commit("base")   # the layout later stages are checked against
    live = e.params()
    name = "model.layers.0.self_attn.k_proj.weight"
    bad = _altered(e.ckpts[2][0], tmp_path / "reshaped", reshape=name)
    e.ps.register_checkpoint("reshaped", files=sorted(str(p) for p in bad.glob("*.safetensors")))
    e.ps.gather_metas("reshaped")
    with pytest.raises(RemoteWorkerError, match=f"the staged update's {name} is float32 \\[3, 7\\]"):
        e.ps.update("reshaped", e.client.req_func(stage="reshaped"), timeout=120)
    assert e.client.weight_versions()[0]["staged"] is None
    short = _altered(e.ckpts[2][0], tmp_path / "short", drop="model.layers.1.mlp.down_proj.weight")
    e.ps.register_checkpoint("short", files=sorted(str(p) for p in short.glob("*.safetensors")))
    e.ps.gather_metas("short")
    e.ps.update("short", e.client.req_func(stage="short"), timeout=120)
    with pytest.raises(RemoteWorkerError, match="cannot commit version 'short': it lacks model.layers.1.mlp.down_proj"):
        e.client.commit("short")
    assert e.client.weight_versions()[0]["staged"] is None, "the incomplete stage was dropped"
    assert e.params() == live and e.generate() == e.refs[1] and e.client.model_info()["weight_version"] == "base"
    for n in ("reshaped", "short"):
        e.ps.unregister_checkpoint(n)


def test_an_in_place_commit_switches_without_a_flush(engine):
    e = engine
    e.stage(2, "ip2")
    flushes = e.eng.state()["flushes"]
    report = e.client.commit("ip2", pause="in_place")
    assert "flush_cache" not in report.seconds and e.eng.state()["flushes"] == flushes
    assert e.generate() == e.refs[2] and e.client.model_info()["weight_version"] == "ip2"
    e.ps.update("s1", e.client.req_func(weight_version="w1"), timeout=120)


def test_a_direct_load_a_b_a_through_our_loader_equals_a_cold_load(engine):
    """``via="loader"``: the stock loop in our loader's ``load`` op feeds SGLang's ``load_weights``
    inside SGLang's session (its end post-processes), no staging area; A, B, A each equal a cold
    load of that checkpoint, and greedy output equals transformers on it. A client that has seen
    the server's first weights picks the loader by itself; a fresh one, facing a server started with
    ``--checkpoint-engine-wait-weights-before-ready`` whose ``/health`` is not 200, keeps the IPC route."""
    e = engine
    assert e.client.route() == "loader", "the first weights went in: auto picks our loader"
    with SglangClient(e.eng.url, timeout=30) as fresh:
        assert fresh.route() == "ipc" and fresh.route("loader") == "loader"
        with pytest.raises(ConfigError, match="via must be one of"):
            fresh.route("tensor")
    for seed, version in ((2, "d2"), (3, "d3"), (2, "d2b")):
        ckpt, want = e.ckpts[seed]
        seen = len(e.eng.state()["events"])
        e.ps.update(f"s{seed}", e.client.req_func(weight_version=version), timeout=120)
        report = e.client.last_report
        assert report.path == "loader" and list(report.seconds)[:4] == ["begin", "update", "update_replies", "end"]
        assert report.workers[0]["version"] == version and report.workers[0]["tensors"] == 27
        state = e.eng.state()
        assert state["events"][seen:] == ["begin", "tensor (in session)", "end (in session)"], state["events"][seen:]
        assert e.eng.rank_params() == e.eng.cold_params(ckpt), f"{version} differs from a cold load"
        assert {n: e.params()[n] for n in want} == want
        assert e.generate() == e.refs[seed] and e.client.model_info()["weight_version"] == version
        assert e.client.weight_versions()[0]["live"] == version
    e.ps.update("s1", e.client.req_func(weight_version="w1", via="ipc"), timeout=120)
    assert e.client.last_report.path == "ipc" and e.generate() == e.refs[1]


def test_a_direct_load_that_fails_is_reported_and_the_next_one_repairs_it(engine):
    """No handle for the device, a stage in the way, or SGLang's load_weights raising mid-way: each is
    an error naming its cause; nothing half-applied is reported live; the next load works."""
    e = engine
    live = e.params()
    with pytest.raises(RemoteWorkerError, match="cannot run the load of 'n1': no ZeroMQ handle for the device"):
        e.client.update({"GPU-nobody": "ipc://@ckpt-test-nobody-serves-this"}, weight_version="n1", via="loader",
                        timeout=20)
    e.stage(2, "in-the-way")
    with pytest.raises(RemoteWorkerError, match="version 'in-the-way' is staged \\(commit or drop it first\\)"):
        e.client.update({"GPU-nobody": "ipc://@ckpt-test-nobody-serves-this"}, weight_version="n2", via="loader",
                        timeout=20)
    assert e.client.weight_versions()[0]["staged"]["version"] == "in-the-way", "a refused load dropped the stage"
    e.client.drop_staged()
    assert e.params() == live and e.client.model_info()["weight_version"] == "w1"
    httpx.post(f"{e.eng.url}/ckpt_test/next_commit", params={"fail_rank": 0}, timeout=30).raise_for_status()
    loads, said = e.client.req_func(weight_version="n3", via="loader"), []

    def req_func(handles):   # what the client reads from the loader (the PS's own error names the worker's cause)
        try:
            return loads(handles)
        except RemoteWorkerError as exc:
            said.append(str(exc))
            raise

    with pytest.raises(Exception, match="injected load_weights failure on TP rank 0") as failed:
        e.ps.update("s2", req_func, timeout=60)
    assert e.params() != live, "the failure came mid-way: a bucket was loaded"
    deadline = time.monotonic() + 30
    while not said and time.monotonic() < deadline:   # the PS waits for its req_func briefly only
        time.sleep(0.1)
    assert said and said[0].endswith("injected load_weights failure on TP rank 0; the model may hold a mix of both "
                                     "versions: push a full update"), said
    # SGLang's own weight version (on its responses) no longer names 'w1': the weights may be a mix
    assert e.client.model_info()["weight_version"] == mixed_weight_version("n3"), failed.value
    assert [(w["live"], w["mixed"]) for w in e.client.weight_versions()] == [(None, True)], "a failed load is live"
    with pytest.raises(ConfigError, match="via must be one of"):
        e.client.update({}, via="disk")
    e.ps.update("s1", e.client.req_func(weight_version="w1", via="loader"), timeout=120)
    assert e.params() == live and e.generate() == e.refs[1] and e.client.weight_versions()[0]["live"] == "w1"
    assert e.client.model_info()["weight_version"] == "w1" and e.client.weight_versions()[0]["mixed"] is False
