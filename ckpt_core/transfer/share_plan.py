"""Every parameter-server rank gets the same slice plan, by digest when it holds that plan already.

A recorded plan of a large model is tens of MB of JSON (Qwen3-235B at TP 8: 72 MB, 3.7 s to parse
and check), and a driver shares it before every update. So the ranks first exchange only the
plan's digest (or why a rank has none); when every rank already holds the plan of that digest
(shared before: :class:`SharedPlans`) that is all; else the source rank's JSON follows and every
rank parses and checks it (``planning.slices.plan_from_json``).
"""

from __future__ import annotations

from ckpt_core.errors import ConfigError
from ckpt_core.planning.slices import SlicePlan, plan_from_json, plan_to_json


class SharedPlans:
    """The last few plans a rank shared, by digest (each is immutable)."""

    def __init__(self, size: int = 4):
        self.size, self._plans = size, {}

    def get(self, digest: str) -> SlicePlan | None:
        return self._plans.get(digest)

    def put(self, plan: SlicePlan) -> SlicePlan:
        self._plans.pop(plan.digest, None)
        while len(self._plans) >= self.size:
            self._plans.pop(next(iter(self._plans)))
        self._plans[plan.digest] = plan
        return plan


def share_plan(coll, rank: int, plan: SlicePlan | None, *, src: int | None, error: str | None,
               known: SharedPlans) -> SlicePlan:
    """Collective over ``coll`` (``all_gather_json``): rank ``src``'s plan on every rank (``src=None``:
    the lowest rank that passed one). A rank's ``error`` (why it has none) is raised on every rank."""
    mine = {"error": error} if error is not None else (
        {"digest": plan.digest} if plan is not None and src in (None, rank) else None)
    offers = coll.all_gather_json(mine)
    failed = [f"rank {r}: {o['error']}" for r, o in enumerate(offers) if o is not None and "error" in o]
    if failed:
        raise ConfigError(f"no slice plan to share: {'; '.join(failed)}")
    if src is None:
        src = next((r for r, o in enumerate(offers) if o is not None), None)
    if src is None or offers[src] is None:
        raise ConfigError(f"rank {src} shared no slice plan" if src is not None else "no rank shared a slice plan")
    digest = offers[src]["digest"]
    local = plan if plan is not None and rank == src else known.get(digest)
    if all(coll.all_gather_json(local is not None)):
        return known.put(local)
    shared = plan_from_json(coll.all_gather_json(plan_to_json(plan) if rank == src else None)[src])
    if shared.digest != digest:   # the same document hashed on two ranks: never expected
        raise ConfigError(f"rank {src}'s slice plan arrived as {shared.digest}, announced as {digest}")
    return known.put(shared)
