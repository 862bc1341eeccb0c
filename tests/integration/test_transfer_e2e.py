"""End to end on CPU: real PS processes (gloo), real engine-worker processes, /dev/shm IPC buffers."""

import os

import pytest

from support import e2e_cases as cases
from ckpt_core import split_checkpoint_files
from ckpt_core.checkpoint.safetensors import write_file


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
    res = cases.case_engine_never_connects("cpu", 2, timeout_s=3.0)
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
    from support.engine import EngineFront
    from support.world import run_ps_world
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
    from support.engine import EngineFront
    from support.world import run_ps_world
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


def test_a_slow_worker_with_more_buckets_than_slots_gets_every_bucket_intact():
    """The ring's reuse guard: with 2 slots and many buckets, a slot is refilled only once the
    worker is done with the bucket it held (the workers dwell in every bucket before reading it)."""
    from support.engine import EngineFront
    from support.world import FreshCheckpoints, PsWorld
    front = EngineFront("cpu", 2, behavior={"sleep_s": 0.05})
    try:
        with PsWorld("cpu", 2, init={"max_bucket_gb": (16 << 10) / (1 << 30)}, env={"PS_NUM_SLOTS": "2"}) as ps:
            name, want = FreshCheckpoints(ps, seed=12, per_rank=12).new("ring")
            got = ps.update(name, front, 60)
            assert all(o.ok for o in got.values()), got
            assert got[0].value["slots"] == 2 and got[0].value["buckets"] >= 8, got[0].value
            for i in range(2):
                assert front.digests(i) == want, f"engine worker {i} read a slot that was refilled under it"
    finally:
        front.close()


def _late_event_world(env: dict):
    from support.world import PsWorld
    return PsWorld("cpu", 2, init={"max_bucket_gb": (16 << 10) / (1 << 30)}, env=env)


def test_device_events_that_complete_later_run_the_pipelines_waits_for_real():
    """CKPT_TEST_CPU_EVENT_DELAY_S: cpu events report done later, as a GPU's do, so the pipeline
    defers notices and waits for slots for real; every bucket still arrives intact."""
    from support.engine import EngineFront
    from support.world import FreshCheckpoints
    front = EngineFront("cpu", 2)
    try:
        with _late_event_world({"CKPT_TEST_CPU_EVENT_DELAY_S": "0.02", "PS_NUM_SLOTS": "2"}) as ps:
            name, want = FreshCheckpoints(ps, seed=13, per_rank=12).new("late")
            got = ps.update(name, front, 60)
            assert all(o.ok for o in got.values()), got
            for r, o in got.items():
                waits = o.value["waits"]
                assert waits["deferred"] > 0 and waits["awaited"] > 0, f"rank {r} never waited: {waits}"
            for i in range(2):
                assert front.digests(i) == want
    finally:
        front.close()


def test_a_worker_that_reports_a_bucket_done_only_once_it_has_the_next_gets_every_bucket():
    """A pipelined worker (``wire.worker.Unfinished``: a delta's buckets on a GPU) reports bucket i done only once
    bucket i+1 arrived. With device events that complete later (notices deferred) and 2 slots, the PS sends the
    next bucket's notice before it waits for a slot's done (it waited forever before: the first GPU run)."""
    from support.engine import EngineFront
    from support.world import FreshCheckpoints
    front = EngineFront("cpu", 2, behavior={"hold": True})
    try:
        with _late_event_world({"CKPT_TEST_CPU_EVENT_DELAY_S": "0.02", "PS_NUM_SLOTS": "2"}) as ps:
            name, want = FreshCheckpoints(ps, seed=14, per_rank=12).new("held")
            got = ps.update(name, front, 30)
            assert all(o.ok for o in got.values()), got
            assert got[0].value["buckets"] >= 8 and got[0].value["waits"]["deferred"] > 0, got[0].value
            for i in range(2):
                assert front.digests(i) == want
    finally:
        front.close()


def test_a_broadcast_that_never_completes_in_time_fails_every_rank_naming_the_collective_timeout():
    from support.asserts import assert_every_rank_failed
    from support.engine import EngineFront
    from support.world import FreshCheckpoints
    front = EngineFront("cpu", 2)
    try:
        # 15 s: the collective timeout also bounds the world's rendezvous, slow on a loaded machine
        with _late_event_world({"CKPT_TEST_CPU_EVENT_DELAY_S": "600", "PS_COLLECTIVE_TIMEOUT_S": "15"}) as ps:
            name, _ = FreshCheckpoints(ps, seed=14).new("stuck")
            got = ps.update(name, front, 120)
            assert_every_rank_failed(got, "UpdateTimeoutError", "did not complete within PS_COLLECTIVE_TIMEOUT_S=15")
            again = ps.update(name, front, 10)     # the groups are not trusted again
            assert_every_rank_failed(again, "TransportError", "broke in an earlier update")
    finally:
        front.close()


def test_shm_files_registered_without_inplace_pinning_are_copied(tmp_path):
    """use_inplace_pin_memory=False: a /dev/shm file is copied at registration, so rewriting it
    afterwards changes nothing that is pushed."""
    import torch
    from support.data import fresh_tensors, want_digests
    from support.engine import EngineFront
    from support.world import PsWorld
    gen = torch.Generator().manual_seed(21)
    shm = cases.ShmDir()
    front = EngineFront("cpu", 2)
    try:
        data = {r: fresh_tensors({f"s{r}.a": ((512,), torch.bfloat16), f"s{r}.b": ((9, 9), torch.float32)}, gen)
                for r in range(2)}
        paths = {r: shm.write(f"r{r}.safetensors", data[r]) for r in range(2)}
        with PsWorld("cpu", 2) as ps:
            got = ps.all("register", per_rank={r: ("c", {"files": [paths[r]], "use_inplace_pin_memory": False})
                                               for r in range(2)})
            assert all(o.ok for o in got.values()), got
            for r in range(2):   # same size, other bytes: an in-place map would push these
                write_file(paths[r], {n: t + 1 for n, t in data[r].items()})
            assert all(o.ok for o in ps.all("gather", "c").values())
            got = ps.update("c", front, 30)
            assert all(o.ok for o in got.values()), got
            for i in range(2):
                assert front.digests(i) == want_digests(*data.values())
    finally:
        front.close()
        shm.close()


def test_unregister_with_force_frees_the_shared_pool_and_without_it_keeps_it():
    import torch
    from support.world import PsWorld
    with PsWorld("cpu", 1) as ps:
        pooled = {"named_tensors": {"w": torch.randn(1 << 18)}, "use_shared_memory_pool": True}
        assert ps.all("register", ("a", pooled))[0].ok
        held = ps.all("pool_bytes")[0].value
        assert held >= 1 << 20
        assert ps.all("unregister", ("a", {}))[0].ok and ps.all("pool_bytes")[0].value == held
        assert ps.all("register", ("b", pooled))[0].ok
        assert ps.all("unregister", ("b", {"force": True}))[0].ok
        assert ps.all("pool_bytes")[0].value is None


def test_the_gc_is_paused_during_an_update_on_the_ps_and_in_the_worker_and_resumed_after():
    from support.engine import EngineFront
    from support.world import FreshCheckpoints, PsWorld
    front = EngineFront("cpu", 2)
    try:
        with PsWorld("cpu", 2, init={"max_bucket_gb": (16 << 10) / (1 << 30)}) as ps:
            name, want = FreshCheckpoints(ps, seed=31).new("gc")
            got = ps.all("update_gc_probe", (name, front.address, 30))
            assert all(o.ok for o in got.values()), got
            for r, o in got.items():   # req_func runs on rank 0 at least (on every rank after issue 10)
                seen = o.value["gc_during_update"]
                assert o.value["gc_after"] is True and not any(seen) and (r or seen == [False]), f"rank {r}: {o.value}"
            for i in range(2):
                assert front.stats(i)["gc_in_run"] is False, f"engine worker {i} received with the GC running"
                assert front.digests(i) == want
    finally:
        front.close()
