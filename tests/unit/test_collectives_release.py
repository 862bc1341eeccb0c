"""Collectives.close()/abort() free the groups they made, whatever the backend offers (in one
process: a 1-rank gloo world stands in for the caller's default group)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from ckpt_core.transfer.collectives import Collectives
from ckpt_core._settings import load_settings
from harness import free_port


@pytest.fixture
def world():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ours(coll: Collectives) -> list:
    return [coll.new_group([0]), coll.new_group([0])]


@pytest.mark.parametrize("how", ["close", "abort"])
def test_groups_of_a_backend_without_abort_are_destroyed_instead(world, monkeypatch, how):
    """abort() of a backend that has none (a device plugin's) must not leave the group registered."""
    def no_abort(group=None):
        raise NotImplementedError("this backend cannot abort")
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", no_abort)
    coll = Collectives(load_settings(rank=0, world_size=1), "gloo", auto_pg=False)
    groups = _ours(coll)
    coll.data_backend = "fake-device"   # close() aborts the groups of every non-gloo data backend
    getattr(coll, how)()
    left = [g for g in groups if g in dist.distributed_c10d._world.pg_map]
    assert not left and coll.abort_finished, "the groups the Collectives made are gone"
    assert dist.is_initialized(), "the caller's default group stays"


def test_close_destroys_gloo_groups_and_keeps_the_default_group(world):
    coll = Collectives(load_settings(rank=0, world_size=1), "gloo", auto_pg=False)
    groups = _ours(coll)
    coll.close()
    coll.close()   # idempotent
    assert not [g for g in groups if g in dist.distributed_c10d._world.pg_map] and dist.is_initialized()
