"""A full update through the npu backend: 2 PS processes, 2 engine-worker processes, ZeroMQ, HCCL.

No NPU here: the fake torch_npu (tests/fakes) maps the NPU calls onto CPU shared memory
and HCCL onto gloo, and the fake npu-smi reports which process opened which chip. The
npu kind is found through the entry point of the installed package, the device keys
come from npu-smi, ASCEND_RT_VISIBLE_DEVICES remaps logical to physical chips.
"""

import sys

import pytest

from support import e2e_cases as cases
from fakes import npu_board
from fakes.ascend_env import FAKES, board_env, installed  # noqa: F401 - a fixture


@pytest.fixture
def npu_host(installed, tmp_path, monkeypatch):
    """This test's children (spawned: they inherit sys.path and the environment) see an NPU host:
    2 NPUs of 2 chips, logical devices 0 and 1 are chips 3 and 1."""
    for k, v in board_env(tmp_path / "board", [0, 1], 2, visible="3,1").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "path", sys.path + [str(installed), str(FAKES)])
    return tmp_path / "board"


def test_files_named_tensors_and_shm_arrive_bit_exact_through_the_npu_backend(npu_host, tmp_path):
    (tmp_path / "ckpt").mkdir()
    res = cases.case_mixed_sources_uneven_shares("npu", 2, tmp_path / "ckpt", updates=2)
    assert len(res) == 5
    users = npu_board.users()
    assert sorted(users) == [1, 3], "rank/worker 0 on chip 3, rank/worker 1 on chip 1"
    assert all(len(pids) == 2 for pids in users.values()), f"one PS rank and one engine worker per chip: {users}"


def test_an_engine_error_fails_every_npu_rank_and_a_retry_succeeds(npu_host):
    cases.case_engine_fails_then_retry("npu", 2, 1)
