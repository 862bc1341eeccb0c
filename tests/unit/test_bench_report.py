"""The benchmark's checks of issue 5's targets, on recorded-shape results (no run needed)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
from _bench_report import check_targets, memory_check  # noqa: E402

MiB = 1 << 20


def _result(peaks, budgets, *, device="cuda", free_mem_gib=None):
    case = {"case": "dense16", "bytes": 16 << 30, "share_bytes": [8 << 30, 8 << 30], "register_s": 2.0,
            "gather_metas_s": 0.01, "update": {"best_s": 0.2}, "pool": {"reregister_s": 0.4},
            "shm": {"register_s": 0.8}, "peak_extra_device_bytes_per_rank": peaks,
            "device_buffer_bytes_per_rank": budgets}
    meta = {"device": device, "scale": 1.0, "world_size": 2, "free_mem_gib": free_mem_gib}
    return {"meta": meta, "cases": [case]}


def test_peak_within_the_ps_buffer_is_met_and_over_it_is_not():
    assert memory_check(_result([4158 * MiB, 4158 * MiB], [4158 * MiB, 4158 * MiB]))["met"]
    over = memory_check(_result([4158 * MiB, 5000 * MiB], [4158 * MiB, 4158 * MiB]))
    assert not over["met"] and over["measured"] == pytest.approx(5000 / 4158)


def test_the_budget_is_counted_in_torchs_2_MiB_blocks():
    # 1 slot of 1039.5 MiB: torch allocates (and max_memory_allocated counts) 1040 MiB
    assert memory_check(_result([1040 * MiB] * 2, [int(1039.5 * MiB)] * 2))["met"]
    assert not memory_check(_result([1042 * MiB] * 2, [int(1039.5 * MiB)] * 2))["met"]


def test_the_memory_check_applies_to_low_memory_runs_but_speed_targets_do_not():
    got = check_targets(_result([1040 * MiB] * 2, [1040 * MiB] * 2, free_mem_gib=2))
    assert [t["target"] for t in got] == ["peak extra device memory / PS's IPC buffer"]


def test_a_full_run_checks_every_target_it_can_speak_to():
    got = {t["target"]: t for t in check_targets(_result([10] * 2, [10] * 2))}
    assert got["update, dense 16 GiB"]["met"] and got["register 16 GiB of named tensors"]["met"]
    assert got["register /dev/shm safetensors in place, GB/s"]["measured"] == pytest.approx((16 << 30) / 0.8 / 1e9)
    assert memory_check(_result([10] * 2, [10] * 2, device="cpu")) is None
