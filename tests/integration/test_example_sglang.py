"""examples/sglang_update.py, run as written, against SGLang 0.5.23's real FastAPI app, weight-update
managers and Qwen2 ``load_weights`` (the CPU engine of sglang_support): one checkpoint per step,
every parameter bit-exact after each, SGLang's weight_version the step's name."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from support.ports import run_with_master_port
from sglang_support.fixtures import ready_engine, write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sglang_update.py"


@pytest.mark.slow
def test_each_step_lands_bit_exact_and_is_sglangs_weight_version(tmp_path):
    with ready_engine(tmp_path) as eng:
        steps = [write_checkpoint(tmp_path / f"step-{s}", seed=s) for s in (11, 12)]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1", PS_MAX_BUCKET_SIZE_GB=str(100_000 / (1 << 30)))
        p = run_with_master_port([sys.executable, EXAMPLE, "--endpoint", eng.url, "--device", "cpu", "--timeout", "120",
                                  *(d for d, _ in steps)], env=env, timeout=300, cwd=str(ROOT))
        assert p.returncode == 0, f"{p.stdout[-2000:]}\n{p.stderr[-5000:]}"
        lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
        assert [x["step"] for x in lines] == ["step-11", "step-12"], p.stdout
        assert all(x["bytes"] > 0 and "update" in x["engine_s"] for x in lines), lines
        state = eng.state()
        want = steps[-1][1]
        assert state["params"].keys() == want.keys()
        wrong = [n for n in want if state["params"][n] != want[n]]
        assert not wrong, f"parameters differ from the last step's checkpoint: {wrong}"
        assert state["weight_version"] == "step-12"
