"""End to end on CPU: real PS processes (gloo), real engine-worker processes, /dev/shm IPC buffers."""

import os
import time

import pytest

import e2e_cases as cases
from ckpt_core import split_checkpoint_files
from ckpt_core._safetensors import write_file


@pytest.mark.parametrize("world", [2, 3])
def test_files_named_tensors_and_shm_arrive_bit_exact_across_several_updates(world, tmp_path):
    cases.case_mixed_sources_uneven_shares("cpu", world, tmp_path)


def test_a_single_rank_world_updates_its_engine(tmp_path):
    cases.case_mixed_sources_uneven_shares("cpu", 1, tmp_path, updates=2)


def test_two_checkpoints_switch_by_name_and_the_shared_pool_is_reused():
    cases.case_two_checkpoints_and_shared_pool("cpu", 2)


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_an_engine_error_on_the_last_bucket_fails_every_rank_and_a_retry_succeeds(fail_rank):
    cases.case_engine_fails_then_retry("cpu", 2, fail_rank)


def test_an_engine_that_never_connects_times_out_naming_the_rank():
    t0 = time.monotonic()
    res = cases.case_engine_never_connects("cpu", 2, timeout_s=3.0)
    assert time.monotonic() - t0 < 60
    assert "timed out waiting for engine worker" in res[1][3][2] and "to connect" in res[1][3][2]


def test_hf_directory_is_split_across_ranks_exactly_once(tmp_path):
    import json
    import torch
    names = []
    for i in range(5):
        n = f"model-{i:05d}-of-00005.safetensors"
        write_file(str(tmp_path / n), {f"w{i}": torch.randn(100 * (i + 1))})
        names.append(n)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {f"w{i}": n for i, n in enumerate(names)}}))
    shares = [split_checkpoint_files(str(tmp_path), r, 2) for r in range(2)]
    flat = sorted(os.path.basename(p) for s in shares for p in s)
    assert flat == sorted(names)
    assert all(shares), "both ranks get files"


def test_a_req_func_failing_after_the_workers_finished_still_fails_the_update():
    from harness import EngineFront, run_ps_world
    import torch
    front = EngineFront("cpu", 2)
    try:
        spec = {r: {"named_tensors": cases.tensors(f"q{r}", 3, torch.Generator().manual_seed(r))} for r in range(2)}
        res = run_ps_world("cpu", 2, [("init", {}), ("register", ("c", spec)), ("gather", "c"),
                                      ("update", ("c", front.address, 30, {"req_fail_after": True})),
                                      ("update", ("c", front.address, 30))])
        for r in range(2):
            assert res[r][3][:2] == ("error", "RemoteWorkerError"), res[r][3]
            assert "req_func failed after the engine finished" in res[r][3][2]
            assert res[r][4][0] == "ok"
    finally:
        front.close()


def test_an_engine_refusing_the_plan_fails_the_update_before_any_weight_is_loaded():
    """on_plan sees the whole update first: a missing tensor stops it with nothing loaded anywhere."""
    from harness import EngineFront, run_ps_world
    import torch
    front = EngineFront("cpu", 2)
    try:
        spec = {r: {"named_tensors": cases.tensors(f"p{r}", 3, torch.Generator().manual_seed(40 + r))} for r in range(2)}
        strict = {1: {"require": ["lm_head.weight"]}}
        res = run_ps_world("cpu", 2, [("init", {}), ("register", ("c", spec)), ("gather", "c"),
                                      ("update", ("c", front.address, 30, strict))])
        for r in range(2):
            assert res[r][3][:2] == ("error", "RemoteWorkerError"), res[r][3]
            assert "during handshake" in res[r][3][2] and "lm_head.weight" in res[r][3][2]
        assert front.digests(0) == {} and front.digests(1) == {}, "nothing may be loaded"
    finally:
        front.close()
