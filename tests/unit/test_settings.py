"""Settings from the environment: the documented defaults on a clean environment, and every
timeout or size that is infinite, NaN or <= 0 refused with a ConfigError naming the variable."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

from ckpt_core._settings import NO_DEADLINE_S, update_seconds
from ckpt_core._settings import (ENV_VARS, auto_delta_threads, delta_threads, fault_threads, gc_pause_enabled, liveness,
                                 load_settings, progress_log_s, usable_cores)
from ckpt_core.errors import ConfigError

EXTRA = ("PS_PAUSE_GC", "PS_FAULT_THREADS", "CKPT_HEARTBEAT_S", "CKPT_PEER_TIMEOUT_S", "CKPT_PROGRESS_LOG_S")


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(ENV_VARS) + list(EXTRA):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_load_settings_on_a_clean_environment_gives_the_documented_defaults(clean_env):
    s = load_settings()
    doc = {name: default for name, (_, default, _) in ENV_VARS.items()}
    assert s.rank == int(doc["RANK"]) and s.world_size == int(doc["WORLD_SIZE"])
    assert doc["LOCAL_RANK"] == "RANK" and s.local_rank == s.rank
    assert s.master_addr == doc["MASTER_ADDR"] and s.master_port == int(doc["MASTER_PORT"])
    assert s.max_bucket_bytes == int(float(doc["PS_MAX_BUCKET_SIZE_GB"]) * (1 << 30))
    assert s.mem_fraction == float(doc["PS_MEM_FRACTION"])
    assert s.num_slots == int(doc["PS_NUM_SLOTS"])
    assert s.collective_timeout_s == float(doc["PS_COLLECTIVE_TIMEOUT_S"])
    assert s.rdma_devices == () and doc["PS_P2P_STORE_RDMA_DEVICES"] == "" and doc["NCCL_IB_HCA"] == ""
    assert gc_pause_enabled() is (doc["PS_PAUSE_GC"] == "1")
    assert fault_threads() == int(doc["PS_FAULT_THREADS"])
    assert doc["PS_DELTA_THREADS"] == "auto" and delta_threads() == auto_delta_threads(usable_cores(), 1)


@pytest.mark.parametrize("cores, ranks, want", [
    (2, 1, 2), (4, 1, 4), (16, 1, 16), (128, 1, 16),   # one rank: every core, at most 16
    (16, 8, 4), (64, 8, 8), (192, 8, 16), (8, 8, 4),    # ranks share the cores, at least 4 where there are 4
    (1, 1, 1), (2, 8, 2), (3, 0, 3),
])
def test_the_automatic_delta_threads_share_the_cores_among_the_hosts_ranks(cores, ranks, want):
    assert auto_delta_threads(cores, ranks) == want


def test_delta_threads_auto_reads_the_local_world_size_and_an_explicit_count_wins(clean_env):
    clean_env.setenv("LOCAL_WORLD_SIZE", "8")
    assert delta_threads() == auto_delta_threads(usable_cores(), 8)
    clean_env.setenv("PS_DELTA_THREADS", "auto")
    assert delta_threads() == auto_delta_threads(usable_cores(), 8)
    clean_env.setenv("PS_DELTA_THREADS", "3")
    assert delta_threads() == 3
    clean_env.setenv("PS_DELTA_THREADS", "many")
    with pytest.raises(ConfigError, match="PS_DELTA_THREADS"):
        delta_threads()


def test_environment_values_are_used_and_explicit_arguments_win(clean_env):
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "3")
    clean_env.setenv("PS_MAX_BUCKET_SIZE_GB", "0.5")
    clean_env.setenv("NCCL_IB_HCA", "mlx5_0,mlx5_1")
    s = load_settings()
    assert (s.rank, s.world_size, s.local_rank, s.max_bucket_bytes) == (1, 3, 1, 1 << 29)
    assert s.rdma_devices == ("mlx5_0", "mlx5_1")
    s = load_settings(rank=0, max_bucket_gb=1)
    assert (s.rank, s.max_bucket_bytes) == (0, 1 << 30)


BAD = ["0", "-5", "nan", "inf", "-inf"]


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("var", ["PS_COLLECTIVE_TIMEOUT_S", "PS_MAX_BUCKET_SIZE_GB"])
def test_a_timeout_or_size_that_is_not_finite_and_positive_is_a_config_error_naming_it(clean_env, var, value):
    clean_env.setenv(var, value)
    with pytest.raises(ConfigError, match=var):
        load_settings()


@pytest.mark.parametrize("var, value, reader", [
    ("PS_MAX_BUCKET_SIZE_GB", "1e300", load_settings),   # was int(inf): a raw OverflowError
    ("PS_COLLECTIVE_TIMEOUT_S", "1e300", load_settings),  # was timedelta(seconds=1e300): OverflowError later
    ("PS_NUM_SLOTS", "100000000000", load_settings),      # choose_layout looped once per slot
    ("PS_FAULT_THREADS", "1000000000", fault_threads),     # a thread each
    ("PS_DELTA_THREADS", "1000000000", delta_threads),
    ("PS_DELTA_BUCKETS", "1000", load_settings),
    ("PS_DELTA_BUCKETS", "0", load_settings),
    ("CKPT_HEARTBEAT_S", "1e300", liveness),               # time.sleep(1e300): OverflowError
    ("CKPT_PROGRESS_LOG_S", "1e300", progress_log_s),
])
def test_a_huge_setting_is_a_config_error_naming_it_and_its_bound(clean_env, var, value, reader):
    clean_env.setenv(var, value)
    with pytest.raises(ConfigError, match=f"{var} must be") as info:
        reader()
    assert "<=" in str(info.value) or ".." in str(info.value) or "]" in str(info.value), str(info.value)


def test_the_command_lines_slot_and_seconds_bounds_are_the_settings_ones():
    from ckpt_core._cli_args import MAX_SECONDS, MAX_SLOTS
    from ckpt_core._settings import MAX_NUM_SLOTS, MAX_SETTING_S
    assert (MAX_SLOTS, MAX_SECONDS) == (MAX_NUM_SLOTS, MAX_SETTING_S)


@pytest.mark.parametrize("value", ["nan", "inf", "0", "1.5"])
def test_a_memory_fraction_outside_0_1_is_a_config_error_naming_it(clean_env, value):
    clean_env.setenv("PS_MEM_FRACTION", value)
    with pytest.raises(ConfigError, match="PS_MEM_FRACTION"):
        load_settings()


@pytest.mark.parametrize("value", [math.inf, math.nan, 0, -1, "big"])
def test_an_explicit_bucket_bound_that_is_not_finite_and_positive_is_a_config_error(clean_env, value):
    with pytest.raises(ConfigError, match="max_bucket_gb"):
        load_settings(max_bucket_gb=value)


@pytest.mark.parametrize("value", [math.nan, 0, -3, timedelta(0), timedelta(seconds=-1), "10", True, None])
def test_an_update_timeout_that_is_nan_or_not_positive_is_a_config_error(value):
    with pytest.raises(ConfigError, match="update timeout"):
        update_seconds(value)


@pytest.mark.parametrize("value", [math.inf, timedelta.max, 1e300])
def test_an_infinite_update_timeout_means_no_deadline_and_does_not_overflow(value):
    assert update_seconds(value) == NO_DEADLINE_S


def test_a_finite_update_timeout_is_kept():
    assert update_seconds(timedelta(minutes=2)) == 120.0 and update_seconds(3) == 3.0


@pytest.mark.parametrize("raw, asked, given", [("", True, True), ("1", True, True), ("0", True, False),
                                               ("0", False, False), ("off", True, False)])
def test_ckpt_slices_0_turns_a_drivers_request_for_slices_off_and_says_so(monkeypatch, caplog, raw, asked, given):
    import logging

    from ckpt_core.engines.driver import slices_wanted
    monkeypatch.setenv("CKPT_SLICES", raw)
    with caplog.at_level(logging.WARNING):
        assert slices_wanted(asked, logging.getLogger("t")) is given
    assert ("CKPT_SLICES=0 turns them off" in caplog.text) == (asked and not given)


def test_a_ckpt_slices_that_is_no_bool_is_a_config_error(monkeypatch):
    from ckpt_core.engines.driver import slices_wanted
    monkeypatch.setenv("CKPT_SLICES", "maybe")
    with pytest.raises(ConfigError, match="CKPT_SLICES='maybe' is not a valid bool"):
        slices_wanted(True)


@pytest.mark.parametrize("raw, mode", [("", "gaps"), ("0", "off"), ("off", "off"), ("1", "all"), ("true", "all"),
                                       ("all", "all"), ("check", "check"), (" Check ", "check"), ("gaps", "gaps")])
def test_ckpt_delta_triton_names_where_the_fused_kernels_run(monkeypatch, raw, mode):
    from ckpt_core._settings import delta_triton
    monkeypatch.setenv("CKPT_DELTA_TRITON", raw)
    assert delta_triton() == mode


def test_a_ckpt_delta_triton_of_no_known_mode_is_a_config_error_listing_the_modes(monkeypatch):
    from ckpt_core._settings import delta_triton
    monkeypatch.setenv("CKPT_DELTA_TRITON", "scatter")
    with pytest.raises(ConfigError, match="CKPT_DELTA_TRITON='scatter'.*0, 1 \\(all\\), check, gaps or all"):
        delta_triton()


@pytest.mark.parametrize("mode, check, gaps, scatter", [("0", False, False, False), ("check", True, False, False),
                                                        ("gaps", True, True, False), ("1", True, True, True)])
def test_the_delta_kernels_are_offered_per_use_as_ckpt_delta_triton_says(monkeypatch, mode, check, gaps, scatter):
    import torch

    from ckpt_core.delta import _kernels
    built = object()   # stands for the compiled kernels: only the gating is under test here
    monkeypatch.setattr(_kernels, "_STATE", {"kernels": built, "failed": False})
    monkeypatch.setenv("CKPT_DELTA_TRITON", mode)
    cuda = torch.device("cuda", 0)
    assert (_kernels.kernels(cuda) is built) == check
    assert (_kernels.kernels(cuda, "gaps") is built) == gaps
    assert (_kernels.kernels(cuda, "scatter") is built) == scatter
    assert _kernels.kernels(torch.device("cpu"), "scatter") is None   # never for other devices
