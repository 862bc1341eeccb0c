"""Issue 14 under NCCL on 2 GPUs: close() during an update (defect 4) and the process groups,
NCCL communicators and device memory of ParameterServers created inside a trainer's default
group (defect 5). Same cases as the CPU tests (ps_fault_cases), run with kind="cuda"."""

import pytest
import torch

from support import ps_fault_cases as cases
from support.engine import EngineFront

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _need_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")


@pytest.mark.parametrize("world", [1, 2])
def test_close_during_an_update_under_nccl_stops_every_rank_then_frees(world, tmp_path):
    if world == 2:
        _need_two_gpus()
    elif not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    front = EngineFront("cuda", world)
    try:
        cases.close_a_rank_mid_update("cuda", front, tmp_path, world)
    finally:
        front.close()


@pytest.mark.parametrize("mode", ["close", "abort"])
def test_parameter_servers_in_a_trainers_nccl_default_group_leave_no_groups_fds_or_device_memory(mode):
    _need_two_gpus()
    # an NCCL communicator holds tens of MiB of device memory; ten leaked ones are unmistakable
    cases.assert_census_clean(cases.group_census("cuda", 10, mode), device_slack=64 * MiB)


def test_a_read_only_shm_file_on_cuda_is_copied_into_pinned_memory_and_unlinked_after_success():
    """Defect 3 on CUDA: pinning in place (cudaHostRegister) needs write access to the pages, so a
    read-only /dev/shm file is copied instead while a writable one is pinned where it lies; both
    deliver their exact bytes, and unlink_inplace_files=True deletes them only after the success."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import os
    from support.e2e_cases import ShmDir
    from support.data import digest, fresh_tensors
    from support.inplace_cases import register_as_unprivileged, write_owned
    shm = ShmDir()
    os.chmod(shm.path, 0o777)   # the unprivileged child deletes files in it
    try:
        gen = torch.Generator().manual_seed(3)
        a = fresh_tensors({"a.w": ((4096, 256), torch.bfloat16)}, gen)
        b = fresh_tensors({"b.w": ((77, 3), torch.float32), "b.v": ((5,), torch.float16)}, gen)
        files = [write_owned(shm, "a.safetensors", a, 0o644), write_owned(shm, "b.safetensors", b, 0o444)]
        got = register_as_unprivileged(files, unlink=True, kind="cuda")
        assert got["ok"], got
        assert sorted(got["in_place"]) == [False, True], f"one region pinned in place, one copied: {got}"
        assert got["digests"] == {n: digest(t) for n, t in {**a, **b}.items()}
        assert got["exist"] == [False, False], "unlink_inplace_files=True deletes the files after a success"
    finally:
        shm.close()
