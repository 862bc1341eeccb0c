"""Our launcher updates SGLang's real Qwen2 model through SGLang's real /update_weights_from_ipc route.

Chain under test: ``python -m ckpt_sglang.update`` (re-executes under torchrun) -> our PS with
the stock wire -> HTTP into SGLang's FastAPI app -> SGLang's weight-update managers -> SGLang's
checkpoint-engine worker extension -> the stock ``checkpoint_engine.worker`` (PyPI 0.4.2) ->
``Qwen2ForCausalLM.load_weights`` (fusing q/k/v and gate/up). See sglang_support/engine.py for
what is stood in on CPU. Every parameter is compared bit for bit with the pushed checkpoint.
"""

from __future__ import annotations

import json
import os

import pytest

from ckpt_core import ParameterServer
from ckpt_sglang import SglangClient
from support.ports import free_port
from sglang_support.fixtures import (SglangEngine, ready_engine, run_launcher, sglang_python, start_launcher,
                                     wait_for, write_checkpoint)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang")
    with ready_engine(root) as eng:
        yield eng, root


# buckets of ~100 KiB: the 0.4 MB model travels in several, through both slots of the ring
SMALL_BUCKETS = {"PS_MAX_BUCKET_SIZE_GB": str(100_000 / (1 << 30)), "PS_NUM_SLOTS": "2"}


def _launch(engine_url: str, ckpt, *extra: str):
    return run_launcher("--checkpoint-path", str(ckpt), "--endpoint", engine_url, "--inference-parallel-size", "1",
                        "--device", "cpu", "--timeout", "120", "--ready-timeout", "60", *extra, env=SMALL_BUCKETS)


def _figures(proc) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, \
        f"launcher failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1])


def test_every_launcher_update_runs_inside_sglangs_weight_update_session(engine):
    """SGLang 0.5.23 opens /begin_weight_update .. /end_weight_update around a load (begin restores
    in-place-packed weights, end post-processes them); its IPC route does not open one itself."""
    eng, root = engine
    ckpt, want = write_checkpoint(root / "session", seed=21)
    seen = len(eng.state()["events"])
    figures = _figures(_launch(eng.url, ckpt, "--weight-version", "in-session"))
    state = eng.state()
    assert state["events"][seen:] == ["begin", "ipc (in session)", "end (in session)"], state["events"][seen:]
    assert not state["session_open"], "the session was closed"
    assert not [n for n in want if state["params"][n] != want[n]] and state["weight_version"] == "in-session"
    assert list(figures["engine"][0]["seconds"])[:3] == ["begin", "update", "end"]


def test_state_digests_read_every_parameter_in_sglangs_process(engine):
    """``ckpt_sglang.probe.load`` (a custom weight loader, called by SGLang's own
    /update_weights_from_tensor inside its session) digests what SGLang's model holds: the same
    bytes the engine reports itself, for every parameter, in both modes; nothing is loaded."""
    eng, _root = engine
    before = eng.state()
    with SglangClient(eng.url, timeout=60) as client:
        digests = client.state_digests()[0]["digests"]
        sums = client.state_digests("sums")[0]["digests"]
    after = eng.state()
    assert after["params"] == before["params"], "reading the digests changed the model"
    assert {n: d.split("|")[0] for n, d in after["params"].items()} == {n: d[2] for n, d in digests.items()
                                                                       if n in after["params"]}
    assert set(digests) == set(sums) >= set(after["params"]) and all(sums[n][:2] == digests[n][:2] for n in sums)
    assert after["events"][len(before["events"]):] == ["begin", "tensor (in session)", "end (in session)"] * 2


def test_launcher_updates_every_sglang_parameter_and_a_second_update_switches(engine):
    eng, root = engine
    before = eng.state()["params"]
    for step, seed in enumerate((1, 2)):
        ckpt, want = write_checkpoint(root / f"step-{seed}", seed=seed)
        figures = _figures(_launch(eng.url, ckpt, "--weight-version", f"v{step}",
                                   "--checkpoint-name", f"step-{seed}"))
        state = eng.state()
        assert state["params"].keys() == want.keys(), "every parameter of the model is covered"
        wrong = [n for n in want if state["params"][n] != want[n]]
        assert not wrong, f"step {seed}: parameters differ from the pushed checkpoint: {wrong}"
        assert state["weight_version"] == f"v{step}"
        assert figures["ps"]["buckets"] >= 4 and figures["ps"]["slots"] == 2, figures["ps"]
        assert figures["engine"][0]["seconds"]["update"] > 0
    assert all(before[n] != want[n] for n in want), "the start weights already equalled the checkpoint"


def test_requests_in_flight_are_paused_flushed_and_continued(engine):
    eng, root = engine
    ckpt, want = write_checkpoint(root / "busy", seed=3)
    eng.set_busy(2)
    try:
        figures = _figures(_launch(eng.url, ckpt, "--busy", "retract"))
    finally:
        eng.set_busy(0)
    state = eng.state()
    assert all(state["params"][n] == want[n] for n in want)
    assert figures["engine"][0]["busy"] is True
    # SGLang 0.5.23 has weight-update sessions: the load runs in one, the cache is flushed after its end
    assert list(figures["engine"][0]["seconds"])[:6] == ["begin", "update", "end", "pause", "flush_cache", "resume"]
    assert state["paused"] is None, "generation was continued"
    assert state["events"][-3:] == ["begin", "ipc (in session)", "end (in session)"] and not state["session_open"]


def test_busy_fail_reports_sglangs_answer(engine):
    eng, root = engine
    ckpt, _ = write_checkpoint(root / "busy-fail", seed=4)
    eng.set_busy(1)
    try:
        proc = _launch(eng.url, ckpt, "--busy", "fail")
    finally:
        eng.set_busy(0)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "RemoteWorkerError" in proc.stderr and "cache was not flushed" in proc.stderr


@pytest.mark.parametrize("method", ["broadcast", "p2p"])
def test_an_error_in_sglangs_loader_reaches_the_ps_as_remote_worker_error(engine, tmp_path, method):
    """A checkpoint whose q_proj has the wrong shape: SGLang's loader raises inside the stock worker,
    whether the bucket came by broadcast or by a P2P read."""
    if method == "p2p":
        pytest.importorskip("mooncake.engine", reason="Mooncake (the p2p extra) is not installed")
    eng, _root = engine
    import torch
    from ckpt_core.checkpoint.safetensors import write_file
    ckpt, _ = write_checkpoint(tmp_path / "bad", seed=5, shards=1)
    bad = {"model.layers.0.self_attn.q_proj.weight": torch.randn(3, 7)}
    (ckpt / "model-00000.safetensors").unlink()
    write_file(ckpt / "model-00000.safetensors", bad)
    before = eng.state()["params"]
    proc = _launch(eng.url, ckpt, "--update-method", method)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "RemoteWorkerError" in proc.stderr and "rank 0" in proc.stderr, proc.stderr[-3000:]
    assert eng.state()["params"] == before, "a failed update changed parameters"
    assert not eng.state()["session_open"], "the failed load's session was closed"


def test_a_model_sglang_cannot_reload_is_refused_on_every_rank_before_anything_is_posted(engine):
    """FP8 per tensor: SGLang's post-processing replaces each weight by its transpose, so no reload
    can equal a cold load. The launcher's first rank reads the served model's config.json; the
    refusal is one ConfigError on both ranks, nothing reaches SGLang, and the next update works."""
    eng, root = engine
    config = root / "model" / "config.json"   # the served model's (the server read it at start)
    saved = config.read_text()
    ckpt, want = write_checkpoint(root / "fp8-refused", seed=22)
    before = eng.state()
    try:
        config.write_text(json.dumps({**json.loads(saved), "quantization_config": {
            "quant_method": "fp8", "activation_scheme": "dynamic"}}))
        proc = run_launcher("--checkpoint-path", str(ckpt), "--endpoint", eng.url, "--inference-parallel-size", "2",
                            "--device", "cpu", "--timeout", "120", "--ready-timeout", "60", env=SMALL_BUCKETS)
    finally:
        config.write_text(saved)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]   # torchrun's code for failed ranks
    refused = [line for line in proc.stderr.splitlines() if "ckpt_sglang.update: ConfigError" in line]
    assert len(refused) == 2 and all("refused on rank(s) [0]" in x and "FP8 per tensor" in x for x in refused), \
        proc.stderr[-3000:]
    after = eng.state()
    assert after["params"] == before["params"] and after["events"] == before["events"], "SGLang was asked to load"
    figures = _figures(_launch(eng.url, ckpt, "--weight-version", "after-refusal"))
    assert figures["engine"][0]["seconds"]["update"] > 0
    assert not [n for n in want if eng.state()["params"][n] != want[n]]


def test_a_launcher_without_checkpoint_or_metas_is_refused_before_starting_ranks():
    proc = run_launcher("--inference-parallel-size", "1", timeout=60)
    assert proc.returncode == 2 and "running: " not in proc.stderr, proc.stderr[-2000:]
    assert "--checkpoint-path (or --load-metas-file, to join) is required" in proc.stderr


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")]


def test_owners_update_all_and_a_joiner_launcher_pulls_into_its_own_server_through_saved_metas(engine, tmp_path):
    """Owners: --update-method all (broadcast, then P2P) --save-metas-file --sleep-time, on one simulated
    host (127.0.0.2); a joiner launcher on another (127.0.0.3) with --load-metas-file only feeds a second
    SGLang server from the owners' host memory (Mooncake TCP), bit-exact."""
    pytest.importorskip("mooncake.engine", reason="Mooncake (the p2p extra) is not installed: scripts/test.sh "
                        "installs mooncake-transfer-engine-non-cuda and libibverbs1")
    eng, root = engine
    ckpt, want = write_checkpoint(root / "p2p", seed=6)
    metas, out = tmp_path / "metas.json", tmp_path / "owners.out"
    p2p_env = dict(SMALL_BUCKETS, NCCL_IB_DISABLE="1")
    joiner = SglangEngine(sglang_python(), root / "model", tmp_path / "joiner-engine.log")
    owners = None
    try:
        owners = start_launcher("--checkpoint-path", str(ckpt), "--endpoint", eng.url, "--inference-parallel-size",
                                "1", "--device", "cpu", "--timeout", "120", "--ready-timeout", "60",
                                "--update-method", "all", "--save-metas-file", str(metas), "--sleep-time", "300",
                                "--checkpoint-name", "p2p", out=out, env=dict(p2p_env, PS_P2P_HOST="127.0.0.2"))
        wait_for(lambda: owners.poll() is not None or len(_lines(out)) == 2,
                 "the owners' broadcast and P2P updates", timeout=240)
        err = tmp_path / "owners.out.err"
        assert owners.poll() is None, f"owners exited ({owners.returncode}): {err.read_text()[-4000:]}"
        assert [x["method"] for x in _lines(out)] == ["broadcast", "p2p"]
        assert all(eng.state()["params"][n] == want[n] for n in want), "the owners' own server"
        assert json.loads(metas.read_text())["format"] == "ckpt-engine/metas"

        with SglangClient(joiner.url) as client:
            client.wait_ready(timeout=240, alive=joiner.alive)
        before = joiner.state()["params"]
        proc = run_launcher("--load-metas-file", str(metas), "--endpoint", joiner.url, "--inference-parallel-size",
                            "1", "--device", "cpu", "--timeout", "120", "--ready-timeout", "60",
                            "--checkpoint-name", "p2p", "--weight-version", "joined",
                            env=dict(p2p_env, PS_P2P_HOST="127.0.0.3"))
        figures = _figures(proc)
        assert figures["method"] == "p2p" and figures["ps"]["buckets"] >= 4, figures
        state = joiner.state()
        wrong = [n for n in want if state["params"][n] != want[n]]
        assert not wrong, f"the joiner's server differs from the owners' checkpoint: {wrong}"
        assert all(before[n] != want[n] for n in want), "the joiner's server already held the checkpoint"
        assert state["weight_version"] == "joined"
        assert owners.poll() is None, "the owners stayed up (--sleep-time) while the joiner read"
    finally:
        if owners is not None and owners.poll() is None:
            owners.terminate()   # it would sleep on; the launcher passes SIGTERM to torchrun, torchrun to its rank
            owners.wait(60)
        joiner.close()
    wait_for(lambda: not _processes_naming(str(metas)), "the owners' torchrun and rank ended with their launcher",
             timeout=60)


def _processes_naming(text: str) -> list[int]:
    """Pids of processes whose command line contains ``text`` (Linux /proc)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def test_a_joiner_with_a_foreign_metas_file_is_a_config_error_and_its_server_keeps_its_weights(engine, tmp_path):
    eng, _root = engine
    metas = tmp_path / "foreign.json"
    metas.write_text('{"format": "other", "version": 1}')
    before = eng.state()["params"]
    proc = run_launcher("--load-metas-file", str(metas), "--endpoint", eng.url, "--inference-parallel-size", "1",
                        "--device", "cpu", "--timeout", "60", "--ready-timeout", "60", timeout=180)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]   # torchrun's code for a failed rank
    assert "ConfigError" in proc.stderr and "foreign.json" in proc.stderr, proc.stderr[-3000:]
    assert eng.state()["params"] == before


def test_a_server_without_sessions_is_updated_as_before(tmp_path_factory):
    """SGLang 0.5.17 has no /begin_weight_update: the launcher's update learns that from the 404 and
    loads without a session, exactly (the engine's route table as 0.5.17's, its managers 0.5.23's)."""
    root = tmp_path_factory.mktemp("sglang-no-sessions")
    with ready_engine(root, extra=("--without-sessions",)) as eng:
        for step, seed in enumerate((31, 32)):
            ckpt, want = write_checkpoint(root / f"step-{seed}", seed=seed)
            figures = _figures(_launch(eng.url, ckpt, "--weight-version", f"plain-{step}"))
            state = eng.state()
            assert not [n for n in want if state["params"][n] != want[n]] and state["weight_version"] == f"plain-{step}"
        assert state["events"] == ["ipc", "ipc"], state["events"]
        assert "end" not in figures["engine"][0]["seconds"], figures["engine"][0]["seconds"]
        # the staged path and the state digests, as the GPU test runs them on 0.5.17: no session either
        ckpt, want = write_checkpoint(root / "staged", seed=33)
        with ParameterServer(rank=0, world_size=1, device="cpu", wire="stock", master_addr="127.0.0.1",
                             master_port=free_port()) as ps, SglangClient(eng.url, timeout=120) as client:
            ps.register_checkpoint("s33", files=sorted(str(p) for p in ckpt.glob("*.safetensors")))
            ps.gather_metas("s33")
            ps.update("s33", client.req_func(stage="staged-33"), timeout=120)
            assert eng.state()["params"] == state["params"], "a stage changed the live model"
            committed = client.commit("staged-33", timeout=120)
            digests = client.state_digests()[0]["digests"]
        state = eng.state()
        assert not [n for n in want if state["params"][n] != want[n]] and state["weight_version"] == "staged-33"
        assert all(digests[n][2] == state["params"][n].split("|")[0] for n in want)
        assert state["events"][2:] == ["tensor"] * 3, state["events"]   # stage, commit, digests
        assert client.server.sessions is False and "begin" not in committed.seconds, committed.seconds
