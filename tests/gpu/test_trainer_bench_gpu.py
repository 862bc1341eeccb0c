"""benchmarks/trainer_bench.py --tiny on a GPU with a real vLLM: the trainer's syncs through our
``ckpt`` trainer path (host pool, and ``ckpt-device``: the trainer's GPU tensors read in place) and
vLLM's own ``ipc`` backend (per tensor and packed) each leave the engine
equal to a cold load (device checksums of every parameter and buffer, greedy tokens).

    PYTHONPATH=/tmp/vsite:$PWD NCCL_NVLS_ENABLE=0 python -m pytest -q tests/gpu/test_trainer_bench_gpu.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200)]
REPO = Path(__file__).resolve().parents[2]


def test_each_backend_of_the_tiny_benchmark_equals_a_cold_load(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs a GPU build of vLLM importable (PYTHONPATH=<folder with vLLM>:<repo>)")
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "trainer_bench.py"), "--tiny", "--out",
                          str(tmp_path), "--dir", str(tmp_path / "cold"), "--timeout", "300"],
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
                         capture_output=True, text=True, timeout=1100)
    report = json.loads((tmp_path / "results.json").read_text())
    assert [r["backend"] for r in report["runs"]] == ["ckpt", "ckpt-device", "ipc", "ipc-packed"]
    for r in report["runs"]:
        assert "error" not in r, (r, run.stdout[-4000:])
        assert r["vs_cold_load"]["equal"] and r["vs_cold_load"]["tokens_equal"], r["vs_cold_load"]
        assert len(r["rounds"]) == 3 and all(x["blocked_s"] > 0 for x in r["rounds"])
        if r["backend"].startswith("ckpt"):   # ckpt copies to host; ckpt-device reads the trainer's GPU tensors
            assert all(x["on_device"] is (r["backend"] == "ckpt-device") for x in r["rounds"]), r["rounds"]
    assert run.returncode == 0, run.stdout[-4000:]
