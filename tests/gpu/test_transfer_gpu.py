"""The end-to-end cases again, on CUDA: NCCL broadcast, pinned host memory, CUDA IPC buffers."""

import pytest
import torch

import e2e_cases as cases

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


def test_the_ipc_descriptor_is_plain_json_and_the_buffer_is_freed_on_close():
    """No pickle: the CUDA IPC descriptor survives a JSON round trip; close() returns the memory."""
    import json
    from ckpt_core.devices import get_backend

    need(1)
    b = get_backend("cuda")
    free0 = torch.cuda.mem_get_info(0)[0]
    buf = b.alloc_ipc(256 << 20, 0, "t")
    desc = json.loads(json.dumps(buf.descriptor))
    assert desc == buf.descriptor and desc["kind"] == "cuda" and desc["nbytes"] == 256 << 20
    assert torch.cuda.mem_get_info(0)[0] <= free0 - (256 << 20)
    buf.close()
    b.empty_cache()
    assert torch.cuda.mem_get_info(0)[0] >= free0 - (8 << 20)
