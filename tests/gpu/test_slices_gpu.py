"""Routing by a slice plan on CUDA: NCCL point-to-point sends of strided host-to-device copies, and
the replica layout (a 4-rank PS world feeding two replicas of a 2-rank engine: one send per slice,
then a broadcast in the replica group)."""

import pytest
import torch

from support import slices_world as sw

pytestmark = pytest.mark.gpu


def need_gpus(n: int) -> None:
    have = torch.cuda.device_count()
    if have < n:
        print(f"skipped: needs {n} GPUs for NCCL between PS ranks, this machine has {have}")
        pytest.skip(f"needs {n} GPUs, this machine has {have}")


@pytest.fixture(autouse=True)
def two_gpus():
    need_gpus(2)


def test_each_cuda_engine_worker_receives_exactly_its_slices():
    sw.case_each_worker_receives_its_slices("cuda")


def test_cuda_ranks_that_disagree_on_the_plan_all_refuse_it():
    sw.case_disagreeing_ranks_refuse("cuda")


def test_cuda_replicas_of_a_two_rank_engine_share_one_transfer_per_slice():
    need_gpus(4)
    sw.case_replicas_share_one_transfer("cuda")


def test_cuda_trainer_shards_are_read_in_slices_across_owners():
    sw.case_slices_of_trainer_shards("cuda", 2)


def test_cuda_trainer_shards_on_four_ranks_feed_two_replicas():
    need_gpus(4)
    sw.case_slices_of_trainer_shards("cuda", 4)
