"""What the PS ranks of ``test_slices_refusals.py`` run (through ``PsWorld``'s ``call`` command): a
sliced update, or a share of a slice plan, where a rank may pass something that is not a plan (its
digest, which an engine client's ``update(slices=)`` takes, or its JSON)."""

from __future__ import annotations

from ckpt_core.planning.slices import plan_to_json
from support import slices_world as sw
from support.engine import make_req_func

TP = 2


def _as(what: str):
    """The ``slices`` argument a rank passes: the plan, its digest, its JSON, or nothing."""
    plan = sw.plan(TP)
    return {"plan": plan, "digest": plan.digest, "json": plan_to_json(plan), "none": None}[what]


def update_with(ps, rank, name, address, timeout, what):
    """``update(name, slices=<what>)``; rank 0 posts the handles to the engine front."""
    req = make_req_func(address) if rank == 0 else (lambda h: None)
    return ps.update(name, req, timeout=timeout, slices=_as(what))


def share_with(ps, rank, what, src=0):
    """``share_slice_plan(<what>, src=src)``: the plan's digest on every rank, or the error raised."""
    return ps.share_slice_plan(_as(what), src=src).digest


def share_then_update(ps, rank, name, address, timeout):
    """The documented flow: rank 0's plan shared with every rank, then a sliced update by it."""
    plan = ps.share_slice_plan(_as("plan") if rank == 0 else None, src=0)
    req = make_req_func(address) if rank == 0 else (lambda h: None)
    return ps.update(name, req, timeout=timeout, slices=plan)
