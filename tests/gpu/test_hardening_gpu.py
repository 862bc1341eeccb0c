"""Issue 14 under NCCL on 2 GPUs: close() during an update (defect 4) and the process groups,
NCCL communicators and device memory of ParameterServers created inside a trainer's default
group (defect 5). Same cases as the CPU tests (ps_fault_cases), run with kind="cuda"."""

import pytest
import torch

import ps_fault_cases as cases
from harness import EngineFront

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _need_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")


def test_close_during_an_update_under_nccl_stops_every_rank_then_frees(tmp_path):
    _need_two_gpus()
    front = EngineFront("cuda", 2)
    try:
        cases.close_a_rank_mid_update("cuda", front, tmp_path)
    finally:
        front.close()


@pytest.mark.parametrize("mode", ["close", "abort"])
def test_parameter_servers_in_a_trainers_nccl_default_group_leave_no_groups_fds_or_device_memory(mode):
    _need_two_gpus()
    got = cases.group_census("cuda", 10, mode)
    for r, c in got.items():
        before, after = c["before"], c["after"]
        assert after["groups"] == before["groups"], f"rank {r} leaked process groups: {c}"
        assert after["fds"] <= before["fds"] + 4, f"rank {r} leaked descriptors: {c}"
        # an NCCL communicator holds tens of MiB of device memory; ten leaked ones are unmistakable
        assert after["device_free"] >= before["device_free"] - 64 * MiB, f"rank {r} leaked device memory: {c}"
