"""A PS rank killed or frozen mid-update under NCCL: the survivor's broadcast can never complete.

The survivor must not sit in NCCL forever (nor be torn down by NCCL's watchdog): it fails with a
typed error within PS_COLLECTIVE_TIMEOUT_S, aborts its communicators, the engine workers leave
the dead update, and a new PS world then updates the same engine processes bit-exact.
"""

import pytest
import torch

from support import ps_fault_cases as ps_faults  # the CPU cases, run here with kind="cuda"
from support.engine import EngineFront

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def front():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    f = EngineFront("cuda", 2)
    yield f
    f.close()


@pytest.mark.parametrize("victim", [1, 0], ids=["rank1", "rank0-store-host"])
def test_a_ps_rank_killed_under_nccl_fails_the_survivor_in_time(front, victim, tmp_path):
    ps_faults.kill_a_ps_rank_mid_update("cuda", front, victim, tmp_path)
    ps_faults.assert_engines_left_and_a_new_world_delivers(front, seed=180 + victim, kind="cuda")


def test_a_frozen_ps_rank_under_nccl_fails_the_survivor_within_the_collective_timeout(front, tmp_path):
    ps_faults.freeze_a_ps_rank_mid_update("cuda", front, tmp_path)
    ps_faults.assert_engines_left_and_a_new_world_delivers(front, seed=191, kind="cuda")
