"""Registering straight from training shards (issue 23), on CPU: real FSDP2 and TP on gloo, real
engine-worker processes, the PS inside each trainer process."""

import pytest

from support.engine import EngineFront
from support.shards_world import run_trainers


def _check_world(res: dict, front: EngineFront, world: int, steps: int) -> list:
    for r in range(world):
        assert all(isinstance(x, dict) for x in res[r]), res[r]
    for step in range(steps):
        want = res[0][step]["want"]
        assert all(res[r][step]["want"] == want for r in range(world)), "full_tensor() agrees on every rank"
    final = res[0][steps - 1]["want"]
    for i in range(world):
        assert front.digests(i) == final, f"engine worker {i} holds every full tensor, bit-exact"
    return [res[r][steps - 1] for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_shards_reach_every_engine_worker_whole_without_a_gather(world):
    front = EngineFront("cpu", world)
    try:
        res = run_trainers(world, front.address, steps=2)
        last = _check_world(res, front, world, 2)
        model_bytes = last[0]["bytes"]
        # each rank registered exactly its local shard; together exactly the model, once
        assert [x["registered"] for x in last] == [x["local"] for x in last]
        assert sum(x["registered"] for x in last) == model_bytes
        assert max(x["registered"] for x in last) < model_bytes / world * 1.2 + 512
        assert all(x["plans"] == 1 for x in last), "the second step reused the first step's plan"
        assert front.fanouts == 2
    finally:
        front.close()


def test_a_2d_fsdp_x_tp_mesh_with_column_and_row_wise_layers_arrives_bit_exact():
    front = EngineFront("cpu", 4)
    try:
        res = run_trainers(4, front.address, tp=2, steps=2, timeout=360)
        last = _check_world(res, front, 4, 2)
        placements = last[0]["placements"]
        # the layouts this test is about: FSDP2's strided shard over a column-wise TP shard (boxes of
        # rows), a row-wise TP shard under FSDP (boxes of rows x columns: strided pieces), a replica
        assert placements["blocks.0.up.weight"] == ["_StridedShard(0)", "Shard(0)"], placements
        assert placements["blocks.0.down.weight"] == ["Shard(0)", "Shard(1)"], placements
        assert placements["blocks.0.down.bias"] == ["Shard(0)", "Replicate()"], placements
        assert placements["embed.weight"] == ["Shard(0)"], placements   # on the dp sub-mesh: a copy per TP rank
        # replicas (down.bias over tp) are stored once: the ranks together hold the model exactly once
        assert sum(x["registered"] for x in last) == last[0]["bytes"]
        assert sum(x["local"] for x in last) > last[0]["bytes"]
        assert all(x["plans"] == 1 for x in last)
    finally:
        front.close()
