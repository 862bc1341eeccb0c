"""Drop-in parity on CUDA (2 GPUs): the reference's test scenario, every rank's req_func feeding its
own worker process (NCCL broadcast, CUDA IPC buffers, pinned host memory, /dev/shm in place)."""

import pytest
import torch

from support import parity_cases as cases

pytestmark = pytest.mark.gpu


def need(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, this machine has {torch.cuda.device_count()}")


def test_every_ranks_req_func_feeds_its_own_worker_on_cuda(tmp_path):
    need(2)
    cases.case_reference_scenario("cuda", 2, tmp_path)


def test_a_req_func_failing_or_hanging_on_rank_1_fails_every_cuda_rank_naming_rank_1():
    need(2)
    cases.case_req_func_faults_on_rank_1("cuda")
