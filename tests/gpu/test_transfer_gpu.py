"""The end-to-end cases again, on CUDA: NCCL broadcast, pinned host memory, CUDA IPC buffers."""

import pytest
import torch

from support import e2e_cases as cases

pytestmark = pytest.mark.gpu


def need(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, this machine has {torch.cuda.device_count()}")


@pytest.mark.parametrize("world", [1, 2])
def test_files_named_tensors_and_shm_arrive_bit_exact_on_cuda(world, tmp_path):
    need(world)
    cases.case_mixed_sources_uneven_shares("cuda", world, tmp_path, updates=3)


def test_two_checkpoints_and_the_pinned_shared_pool_on_cuda():
    need(2)
    cases.case_two_checkpoints_and_shared_pool("cuda", 2)


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_an_engine_error_on_the_last_bucket_fails_every_cuda_rank_and_a_retry_succeeds(fail_rank):
    need(2)
    cases.case_engine_fails_then_retry("cuda", 2, fail_rank)


def test_an_engine_that_never_connects_times_out_on_cuda():
    need(2)
    cases.case_engine_never_connects("cuda", 2, timeout_s=5.0)


def test_the_ipc_descriptor_is_plain_json_and_close_is_idempotent():
    """No pickle: the CUDA IPC descriptor survives a JSON round trip; close() is idempotent."""
    import json
    from ckpt_core.devices import get_backend

    need(1)
    b = get_backend("cuda")
    torch.cuda.synchronize(0)
    torch.cuda.empty_cache()   # earlier tests' cached blocks would serve the buffer without new device memory
    free0 = torch.cuda.mem_get_info(0)[0]
    buf = b.alloc_ipc(256 << 20, 0, "t")
    desc = json.loads(json.dumps(buf.descriptor))
    assert desc == buf.descriptor and desc["kind"] == "cuda" and desc["nbytes"] == 256 << 20
    assert torch.cuda.mem_get_info(0)[0] <= free0 - (256 << 20)
    buf.close()   # idempotent; an export nobody mapped is held by torch until a consumer lets go
    buf.close()


def test_device_and_host_memory_stay_flat_over_many_updates_and_failures():
    """60 updates with a failing one in the middle: free device memory and PS RSS end where they began."""
    need(2)
    from support.engine import EngineFront
    from support.world import run_ps_world
    gen = torch.Generator().manual_seed(21)
    front = EngineFront("cuda", 2)
    try:
        spec = {r: {"named_tensors": cases.tensors(f"m{r}", 8, gen, min_elems=1 << 16, max_elems=1 << 20)}
                for r in range(2)}
        upd = ("update", ("c", front.address, 60))
        bad = ("update", ("c", front.address, 60, {1: {"fail_bucket": 0}}))
        script = [("init", {}), ("register", ("c", spec)), ("gather", "c"), upd, ("mem", None)]
        script += [upd] * 30 + [bad] + [upd] * 29 + [("mem", None)]
        res = run_ps_world("cuda", 2, script, timeout=400)
        for r in range(2):
            steps = res[r]
            assert steps[-1][0] == "ok" and steps[4][0] == "ok", steps[-3:]
            errors = [s for s in steps if s[0] != "ok"]
            assert len(errors) == 1 and errors[0][1] == "RemoteWorkerError", errors
            before, after = steps[4][1], steps[-1][1]
            print(f"rank {r}: device free {before['device_free'] / 2**20:.0f} -> {after['device_free'] / 2**20:.0f} MiB, "
                  f"PS allocated {before['allocated'] / 2**20:.1f} -> {after['allocated'] / 2**20:.1f} MiB, "
                  f"PS RSS {before['rss'] / 2**20:.0f} -> {after['rss'] / 2**20:.0f} MiB")
            assert after["allocated"] <= before["allocated"] + (1 << 20)
            assert after["device_free"] >= before["device_free"] - (64 << 20)
            assert after["rss"] <= before["rss"] + (200 << 20)
        want = cases.want_digests(*(v["named_tensors"] for v in spec.values()))
        assert all(front.digests(i) == want for i in range(2))
    finally:
        front.close()
