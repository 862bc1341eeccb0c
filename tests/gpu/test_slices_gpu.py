"""Routing by a slice plan on CUDA: NCCL point-to-point sends of strided host-to-device copies."""

import pytest
import torch

import slices_world as sw

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")


def test_each_cuda_engine_worker_receives_exactly_its_slices():
    sw.case_each_worker_receives_its_slices("cuda")


def test_cuda_ranks_that_disagree_on_the_plan_all_refuse_it():
    sw.case_disagreeing_ranks_refuse("cuda")
