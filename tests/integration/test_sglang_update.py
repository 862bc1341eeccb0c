"""Our launcher updates SGLang's real Qwen2 model through SGLang's real /update_weights_from_ipc route.

Chain under test: ``python -m ckpt_sglang.update`` (re-executes under torchrun) -> our PS with
the stock wire -> HTTP into SGLang's FastAPI app -> SGLang's weight-update managers -> SGLang's
checkpoint-engine worker extension -> the stock ``checkpoint_engine.worker`` (PyPI 0.4.2) ->
``Qwen2ForCausalLM.load_weights`` (fusing q/k/v and gate/up). See sglang_support/engine.py for
what is stood in on CPU. Every parameter is compared bit for bit with the pushed checkpoint.
"""

from __future__ import annotations

import json

import pytest

from ckpt_sglang import SglangClient
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
    assert list(figures["engine"][0]["seconds"])[:4] == ["update", "pause", "flush_cache", "resume"]
    assert state["paused"] is None, "generation was continued"


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
            owners.terminate()   # it would sleep on; torchrun passes SIGTERM on to its rank
            owners.wait(60)
        joiner.close()


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
