"""Hardening (issue 14): each defect a hostile or unusual caller found, reproduced in a real PS world.

Every case here failed before its fix: it states the promise, provokes the defect with real
processes (PS ranks over gloo, engine workers behind an engine front) and asserts the outcome:
the typed error, the engines' digests, and a world that still delivers afterwards.
"""

from __future__ import annotations

import pytest
import torch

from harness import EngineFront, FreshCheckpoints, PsWorld, fresh_tensors, want_digests
from ckpt_core._safetensors import write_file

INIT = {"max_bucket_gb": (16 << 10) / (1 << 30)}


@pytest.fixture(scope="module")
def world():
    front = EngineFront("cpu", 2)
    ps = PsWorld("cpu", 2, init=INIT)
    try:
        yield ps, front, FreshCheckpoints(ps, seed=1414)
    finally:
        ps.close()
        front.close()


def assert_world_still_delivers(ps, front, ckpts) -> None:
    name, want = ckpts.new("genuine")
    got = ps.update(name, front, 30)
    assert all(o.ok for o in got.values()), got
    for i in range(ps.size):
        held = front.digests(i)
        assert {n: held.get(n) for n in want} == want, f"engine worker {i} does not hold {name}"
    ckpts.drop(name)


# -- defect 1: a share made only of 0-byte tensors ------------------------------------------------
def test_a_rank_whose_share_is_only_zero_byte_tensors_delivers_them(world, tmp_path):
    ps, front, ckpts = world
    gen = torch.Generator().manual_seed(1)
    data0 = fresh_tensors({"w0": ((300,), torch.bfloat16), "w1": ((5, 7), torch.float32)}, gen)
    zeros = {"z1": torch.empty(0), "z2": torch.empty(3, 0, dtype=torch.float16)}
    only_empty = str(tmp_path / "empty.safetensors")
    write_file(only_empty, {"zf": torch.empty(0, 4, dtype=torch.bfloat16)})
    got = ps.all("register", per_rank={0: ("zero", {"named_tensors": data0}),
                                       1: ("zero", {"named_tensors": zeros, "files": [only_empty]})})
    assert all(o.ok for o in got.values()), got
    assert all(o.ok for o in ps.all("gather", "zero").values())
    got = ps.update("zero", front, 30)
    assert all(o.ok for o in got.values()), got
    want = want_digests(data0, zeros, {"zf": torch.empty(0, 4, dtype=torch.bfloat16)})
    for i in range(2):
        held = front.digests(i)
        assert {n: held.get(n) for n in want} == want, f"engine worker {i} lacks the 0-byte tensors"
    assert all(o.ok for o in ps.all("unregister", ("zero", {})).values())
    assert_world_still_delivers(ps, front, ckpts)
