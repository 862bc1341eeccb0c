"""The update benchmark runs end to end on the CPU (2 ranks under torch.distributed.run, tiny scale).

No timing is asserted here: this checks that the benchmark works, verifies every update
bit-exact (it raises on a checksum mismatch) and records what its report relies on.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_cpu_benchmark_runs_and_records_every_section(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "benchmarks", "update_bench.py"), "--device", "cpu", "--scale", "0.002",
           "--cases", "tiny,moe8", "--repeats", "1", "--host-touch-gib", "0.05", "--tp", "2", "--out", str(out),
           "--profile", str(tmp_path / "prof")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "every update was verified bit-exact" in proc.stdout
    result = json.loads(out.read_text())
    ceil = result["ceilings"]
    assert len(ceil["h2d_gbps"]) == 2 and ceil["broadcast_gbps"] > 0
    assert all(x > 0 for x in ceil["host_fault_in_first_gbps"] + ceil["host_fault_in_recycled_gbps"])
    assert [c["case"] for c in result["cases"]] == ["tiny", "moe8"]
    for c in result["cases"]:
        assert c["update"]["best_s"] > 0 and len(c["updates"]) == 2          # warm-up + 1 timed
        assert c["pool"]["reregister_s"] > 0 and c["shm"]["register_s"] > 0
        assert len(c["device_buffer_bytes_per_rank"]) == 2 and min(c["device_buffer_bytes_per_rank"]) > 0
        assert c["register_phases_rank0"]["total"] > 0
    assert result["cases"][1]["tensors"] > 5000                                # the MoE case keeps its count
    for c in result["cases"]:   # --tp 2 on 2 ranks: both engine ranks at once, each about half of the bytes
        tp = c["tp"]
        assert tp["mode"] == "parallel" and tp["sliced_s"] > 0 and len(tp["received_bytes_per_rank"]) == 2
        assert 0.5 <= tp["received_fraction"] < 0.6 and sum(tp["received_bytes_per_rank"]) < 1.2 * c["bytes"]
    assert "slices (--tp)" in proc.stdout
    for c in result["cases"]:   # per-tensor costs (issue 38): whole and sliced, ours and the engine's
        for pt in (c["per_tensor"], c["tp"]["per_tensor"]):
            assert pt["tensors"] == c["tensors"] and pt["ps_us"] > 0 and pt["worker_us"] > 0 and pt["engine_us"] > 0
    assert "per-tensor cost, us per tensor" in proc.stdout
    profiles = {p.name for p in (tmp_path / "prof").iterdir()}   # one more, untimed update profiled per case
    for stem in ("moe8-whole-ps-r0", "moe8-whole-ps-r1", "moe8-whole-w0", "moe8-whole-w1", "moe8-tp2-ps-r0", "moe8-tp2-w1"):
        assert {stem + ".prof", stem + ".txt"} <= profiles, (stem, sorted(profiles))
    assert result["targets"] == []                                             # a cpu run claims no GPU target


def test_the_simulated_tp_mode_serves_each_engine_rank_its_slices_from_one_rank(tmp_path):
    """One PS rank (one device) and ``--tp 4``: the four engine ranks in turn, each receiving only
    its slices (about a quarter of the bytes plus the replicated norms), verified bit-exact."""
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           os.path.join(ROOT, "benchmarks", "update_bench.py"), "--device", "cpu", "--scale", "0.002",
           "--cases", "tiny", "--repeats", "1", "--host-touch-gib", "0.01", "--skip-pool", "--skip-shm",
           "--tp", "4", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "every update was verified bit-exact" in proc.stdout
    (case,) = json.loads(out.read_text())["cases"]
    tp = case["tp"]
    assert tp["tp"] == 4 and tp["mode"] == "serial" and len(tp["per_rank_best_s"]) == 4
    assert tp["whole_bytes"] == case["bytes"]
    assert 0.25 <= tp["received_fraction"] < 0.3, tp
    assert max(tp["received_bytes_per_rank"]) - min(tp["received_bytes_per_rank"]) == 0


def test_the_delta_rounds_report_full_and_delta_side_by_side_and_end_bit_exact(tmp_path):
    """``--delta-density 0.02`` on 2 ranks (a staged update in between, so the engine is made to hold
    the case again): two delta versions, each registered whole and with its base, updated as deltas
    through the engine workers' DeltaReceiver, the engine equal to the last one bit for bit."""
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "benchmarks", "update_bench.py"), "--device", "cpu", "--scale", "0.01",
           "--cases", "tiny", "--repeats", "2", "--host-touch-gib", "0.01", "--skip-pool", "--skip-shm",
           "--stage", "--delta-density", "0.02", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "delta host memory needed" in proc.stdout.replace(":", "") and "delta updates (best round" in proc.stdout
    (case,) = json.loads(out.read_text())["cases"]
    d = case["delta"]
    assert d["bit_exact"] is True and d["tensors"] == case["tensors"]
    assert [r["version"] for r in d["rounds"]] == ["tiny-d1", "tiny-d2"]
    assert abs(d["changed_fraction"] - 0.02) < 0.001
    assert d["full"]["bytes"] == case["bytes"] and 0 < d["delta"]["payload_bytes"] < 0.1 * case["bytes"]
    for side in ("full", "delta"):
        assert d[side]["register_s"] > 0 and d[side]["update_s"] > 0
    assert d["delta"]["apply_s"] > 0 and d["delta"]["check_s"] > 0
    for r in d["rounds"]:   # each worker scattered every changed tensor into its live parameters
        assert r["changed_elements"] > 0 and len(r["ps"]) == 2
