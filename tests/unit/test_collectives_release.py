"""Collectives.close()/abort() free the groups they made, whatever the backend offers (in one
process: a 1-rank gloo world stands in for the caller's default group)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from ckpt_core.transfer.collectives import Collectives
from ckpt_core._settings import load_settings
from support.ports import free_port


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


@pytest.mark.parametrize("fails", ["req_func", "worker"])
def test_after_a_failed_update_in_a_with_block_rank_0_stops_listening_when_it_closes(tmp_path, fails):
    """A failed update's traceback is alive while ``__exit__`` closes the PS: its frames held the
    update's stop signal and through it the rendezvous store, whose port stayed open (close()
    waited 5 s for it, then gave up)."""
    import torch

    from ckpt_core import ParameterServer
    from ckpt_core.errors import CkptError
    from ckpt_core.ops.sockets import listening_sockets
    from ckpt_core.checkpoint.safetensors import write_file

    path = str(tmp_path / "w.safetensors")
    write_file(path, {"w": torch.arange(64, dtype=torch.float32)})
    port = free_port()

    def req_func(handles):
        if fails == "req_func":
            raise RuntimeError("the engine refused the update")
        import zmq
        from ckpt_core.wire.worker import update_weights_from_ipc

        def load(weights):
            raise ValueError("the engine's loader failed")
        update_weights_from_ipc(zmq.Context.instance(), handles[0][1], 0, run=load, timeout=30)

    with pytest.raises(CkptError):
        with ParameterServer(0, 1, device="cpu", master_addr="127.0.0.1", master_port=port) as ps:
            ps.register_checkpoint("c", files=[path])
            ps.gather_metas("c")
            assert [s for s in listening_sockets() if s[1] == port], "rank 0 serves the store on its port"
            ps.update("c", req_func, timeout=30)
    assert not [s for s in listening_sockets() if s[1] == port], "the store still listens after close()"
