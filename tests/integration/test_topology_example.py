"""examples/vllm_update.py in a topology of several engines: who posts what, and flag errors that
must come before any wait (the driver is the reference's examples/update.py, ported)."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from ckpt_core import CheckpointFormatError, ConfigError
from ckpt_core._requests import group_handles

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_update.py"
HANDLES = [(f"K{r}", f"ipc://@h{r}") for r in range(4)]


def _example():
    spec = importlib.util.spec_from_file_location("vllm_update_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_first_rank_of_each_group_posts_its_groups_handles_and_the_others_nothing():
    assert [group_handles(HANDLES, r, 2) for r in range(4)] == [HANDLES[0:2], None, HANDLES[2:4], None]
    assert [group_handles(HANDLES, r, None) for r in range(4)] == [HANDLES, None, None, None]
    assert [group_handles(HANDLES, r, 1) for r in range(4)] == [[h] for h in HANDLES]
    for bad in (0, -2, 3):
        with pytest.raises(ConfigError, match="inference groups"):
            group_handles(HANDLES, 0, bad)


def test_endpoints_and_sockets_are_one_for_all_groups_or_one_per_group():
    ex = _example()
    args = ex.parse_args(["--checkpoint-path", "x", "--inference-parallel-size", "2",
                          "--endpoint", "http://a:1,http://b:2", "--uds", "/run/one.sock"])
    assert ex.check_args(args, 4) == (2, ["http://a:1", "http://b:2"], ["/run/one.sock", "/run/one.sock"])
    args = ex.parse_args(["--checkpoint-path", "x", "--inference-parallel-size", "1", "--uds", "/a,/b"])
    assert ex.check_args(args, 2) == (1, ["http://localhost:19730"] * 2, ["/a", "/b"])
    args = ex.parse_args(["--checkpoint-path", "x", "--inference-parallel-size", "1", "--uds", "/a,/b,/c"])
    with pytest.raises(ConfigError, match="2 engine"):
        ex.check_args(args, 2)


@pytest.mark.parametrize("ips", ["0", "-1", "3"])
def test_an_inference_parallel_size_that_is_not_a_positive_divisor_is_an_error(ips):
    ex = _example()
    with pytest.raises(ConfigError, match="--inference-parallel-size must be a positive divisor"):
        ex.check_args(ex.parse_args(["--checkpoint-path", "x", "--inference-parallel-size", ips]), 4)


@pytest.mark.parametrize("state", ["missing", "empty"])
def test_a_missing_or_empty_checkpoint_directory_is_reported_before_waiting_for_the_server(tmp_path, state):
    ex = _example()
    path = tmp_path / "ckpt"
    if state == "empty":
        path.mkdir()
    t0 = time.monotonic()
    with pytest.raises((ConfigError, CheckpointFormatError), match="does not exist|no .safetensors"):
        # nobody listens on the Unix socket: waiting for it would take --ready-timeout
        ex.main(["--checkpoint-path", str(path), "--uds", str(tmp_path / "nobody.sock"), "--ready-timeout", "120"])
    assert time.monotonic() - t0 < 60, "the checkpoint error must not wait for the server (generous ceiling)"
