"""P2P joiners read each piece of a checkpoint registered in pieces from the owner that holds it
(Mooncake's real TCP transport on loopback, two simulated hosts)."""

import pytest
import torch

from ckpt_core import TensorShard
from support.data import digest, fresh_tensor
from support.engine import EngineFront
from support.world import PsWorld
from support.p2p_cases import JOINERS, OWNERS, SMALL, all_ok, call

pytest.importorskip("mooncake.engine", reason="Mooncake (the p2p extra) is not installed: "
                    "scripts/test.sh installs mooncake-transfer-engine-non-cuda and libibverbs1")


def test_a_joiner_world_pulls_pieces_from_each_owner_and_its_engines_get_whole_tensors(tmp_path):
    gen = torch.Generator().manual_seed(31)
    w = fresh_tensor((96, 40), torch.float32, gen)      # rows: two owners' row ranges (direct)
    d = fresh_tensor((40, 96), torch.bfloat16, gen)     # columns: strided pieces (placed after the broadcast)
    b = fresh_tensor((5,), torch.float16, gen)
    spec = {0: {"named_tensors": {"w": TensorShard(w[:50].clone(), (96, 40), (0, 0)),
                                  "d": TensorShard(d[:, :48].clone(), (40, 96), (0, 0)), "b": b}},
            1: {"named_tensors": {"w": TensorShard(w[50:].clone(), (96, 40), (50, 0)),
                                  "d": TensorShard(d[:, 48:].clone(), (40, 96), (0, 48))}}}
    want = {"w": digest(w), "d": digest(d), "b": digest(b)}
    path = str(tmp_path / "metas.json")
    with PsWorld("cpu", 2, init=SMALL, env=OWNERS) as owners:
        all_ok(owners.all("register", None, per_rank={r: ("c", spec[r]) for r in range(2)}))
        all_ok(owners.all("gather", "c"))
        all_ok(call(owners, "save_metas", path, ranks=[0]))
        with PsWorld("cpu", 2, init=SMALL, env=JOINERS) as joiners:
            all_ok(call(joiners, "load_metas", path))
            front = EngineFront("cpu", 2)
            try:
                got = all_ok(call(joiners, "p2p_update", "c", front.address, 60, [0, 1]))
                assert got[0].value["buckets"] >= 2, "the case spans several buckets"
                for i in range(2):
                    assert front.digests(i) == want, f"joiner engine worker {i}"
            finally:
                front.close()
