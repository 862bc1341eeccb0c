"""A slice plan for the CPU routing tests: tensors split by rows, by columns, and read whole, as
two engine ranks' loaders would read them (``planning/slices.py``); used through the harness's
``call`` command inside each PS process."""

from __future__ import annotations

import torch

from ckpt_core.planning.slices import RankSlices, SliceKey, SlicePlan, Write, plan_from_json, plan_to_json
from harness import make_req_func

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
