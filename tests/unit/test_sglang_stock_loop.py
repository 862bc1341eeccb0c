"""The stock worker loop as our SGLang loader runs it (ckpt_sglang/_stock_loop.py): while a stage or a
direct load receives, the interpreter's switch interval is lowered (SGLang's scheduler thread spins
beside the receiver), and the previous value comes back after, also when the loop fails."""

from __future__ import annotations

import sys

import pytest
import torch

from ckpt_sglang import _stock_loop
from ckpt_sglang._stock_loop import SWITCH_INTERVAL_S, fast_switching, run_stock_loop


@pytest.fixture
def interval():
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield 0.005
    sys.setswitchinterval(saved)


def test_the_switch_interval_is_lowered_while_receiving_and_restored_after_nested_users(interval):
    with fast_switching():
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        with fast_switching():
            assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S), "an inner user restored it early"
    assert sys.getswitchinterval() == pytest.approx(interval)


def test_the_switch_interval_comes_back_when_the_stock_loop_fails(interval, monkeypatch):
    seen = []

    def failing_loop(ctx, handle, device_id, *, run, post_hook=None):
        seen.append((sys.getswitchinterval(), handle, device_id))
        raise RuntimeError("the parameter server aborted the update")

    monkeypatch.setattr(_stock_loop, "stock_loop", lambda: failing_loop)
    with pytest.raises(RuntimeError, match="aborted"):
        run_stock_loop("ipc://@nobody", torch.device("cpu"), 0, 1.0, run=lambda weights: None)
    assert seen == [(pytest.approx(SWITCH_INTERVAL_S), "ipc://@nobody", 0)]
    assert sys.getswitchinterval() == pytest.approx(interval)


def test_the_stock_loop_collects_only_the_young_generation(monkeypatch):
    """The stock loop's own ``gc.collect()`` calls (full collections) become young-generation ones."""
    import gc
    import types

    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    namespace = {"gc": gc}
    exec("def update_weights_from_ipc(ctx, handle, device_id, *, run, post_hook=None):\n"
         "    gc.collect()\n    return handle", namespace)
    worker = types.ModuleType("checkpoint_engine.worker")
    worker.update_weights_from_ipc = namespace["update_weights_from_ipc"]
    monkeypatch.setitem(sys.modules, "checkpoint_engine", types.ModuleType("checkpoint_engine"))
    monkeypatch.setitem(sys.modules, "checkpoint_engine.worker", worker)
    sys.modules["checkpoint_engine"].worker = worker
    assert _stock_loop.stock_loop()(None, "h", 0, run=None) == "h" and calls == [0]
    worker.update_weights_from_ipc(None, "h", 0, run=None)
    assert calls == [0, 2], "the stock module itself was changed"


def test_the_stage_probe_runs_on_the_cpu_and_records_its_three_cases(tmp_path):
    """benchmarks/sglang_stage_probe.py (no timing asserted: the figures belong to the probe)."""
    import json
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "probe.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "sglang_stage_probe.py"), "--tasks", "10",
                           "--remote-ms", "0.2", "--out", str(out)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(root)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["spinning"], r["tasks"]) for r in rows] == [(False, 10), (True, 10), (True, 10)]
    assert rows[2]["switch_interval_ms"] == pytest.approx(SWITCH_INTERVAL_S * 1e3) and rows[1]["spinner_iterations"] > 0
    assert sys.getswitchinterval() > 0 and "faster beside the spinner" in proc.stdout
