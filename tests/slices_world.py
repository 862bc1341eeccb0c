"""A slice plan for the CPU routing tests: tensors split by rows, by columns, and read whole, as
two engine ranks' loaders would read them (``planning/slices.py``); used through the harness's
``call`` command inside each PS process."""

from __future__ import annotations

import torch

from ckpt_core.planning.slices import RankSlices, SliceKey, SlicePlan, Write, plan_from_json, plan_to_json
from harness import EngineFront, PsWorld, digest, make_req_func

SHAPES = {"rows": (6, 4), "cols": (4, 6), "norm": (5,)}


def tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def plan(world: int = 2) -> SlicePlan:
    ranks = []
    for r in range(world):
        needs = {"rows": ((0, 3 * r, 3),), "cols": ((1, 3 * r, 3),), "norm": None}
        params = {"p_rows": (3, 4), "p_cols": (4, 3), "p_norm": (5,)}
        writes = (Write("p_rows", (), "rows"), Write("p_cols", (), "cols"), Write("p_norm", (), "norm"))
        ranks.append(RankSlices(r, needs, params, writes))
    return SlicePlan(SliceKey("slices-world", f"tp={world}", "test"),
                     {n: ("F32", s, 4) for n, s in SHAPES.items()}, tuple(ranks))


def want(seed: int, rank: int) -> dict[str, torch.Tensor]:
    """What engine rank ``rank`` must receive: its rows, its columns, the whole norm."""
    t = tensors(seed)
    return {"rows": t["rows"][3 * rank: 3 * rank + 3], "cols": t["cols"][:, 3 * rank: 3 * rank + 3].contiguous(),
            "norm": t["norm"]}


def sliced_update(ps, rank, name, address, timeout, doc):
    """An update routed by the plan ``doc`` (None: this rank passes no plan)."""
    req = make_req_func(address) if rank == 0 else (lambda h: None)
    return ps.update(name, req, timeout=timeout, slices=None if doc is None else plan_from_json(doc))


def plan_doc() -> dict:
    return plan_to_json(plan())


def _register(world: PsWorld, t: dict) -> None:
    world.all("register", per_rank={0: ("c", {"named_tensors": {"rows": t["rows"], "norm": t["norm"]}}),
                                    1: ("c", {"named_tensors": {"cols": t["cols"]}})})
    world.all("gather", "c")


def case_each_worker_receives_its_slices(kind: str) -> None:
    """Each worker holds exactly its rows, its columns and the whole norm; the result says how many
    bytes each rank received."""
    front = EngineFront(kind, 2)
    try:
        with PsWorld(kind, 2) as world:
            _register(world, tensors(7))
            got = world.all("call", ("slices_world", "sliced_update", ("c", front.address, 60, plan_doc())))
            for r in range(2):
                assert got[r].ok, got[r]
                result = got[r].value["slices"]
                assert result["received_bytes"] == [plan().rank_bytes(0), plan().rank_bytes(1)] == [116, 116]
                assert result["whole_bytes"] == 212
            for r in range(2):
                assert front.digests(r) == {n: digest(x) for n, x in want(7, r).items()}, f"worker {r}"
    finally:
        front.close()


def case_disagreeing_ranks_refuse(kind: str) -> None:
    """A rank without the plan: every rank refuses before any engine is asked; the next update works."""
    front = EngineFront(kind, 2)
    try:
        with PsWorld(kind, 2) as world:
            t = tensors(8)
            _register(world, t)
            got = world.all("call", per_rank={0: ("slices_world", "sliced_update", ("c", front.address, 30, plan_doc())),
                                              1: ("slices_world", "sliced_update", ("c", front.address, 30, None))})
            for r in range(2):
                assert not got[r].ok and got[r].error == "ConfigError" and "disagree on the slice plan" in got[r].message
            assert front.fanouts == 0, "no engine was asked to load anything"
            again = world.all("update", ("c", front.address, 30, None))
            assert all(again[r].ok for r in range(2)), again
            for r in range(2):
                assert front.digests(r) == {n: digest(x) for n, x in t.items()}
    finally:
        front.close()
