"""Every parameter-server rank gets the same slice plan, by digest when it holds that plan already.

A recorded plan of a large model is tens of MB of JSON (Qwen3-235B at TP 8: 72 MB, 3.7 s to parse
and check), and a driver shares it before every update. So the ranks first exchange only the
plan's digest (or why a rank has none); when every rank already holds the plan of that digest
(shared before: :class:`SharedPlans`) that is all; else the source rank's JSON follows and every
rank parses and checks it (``planning.slice_json.plan_from_json``).

What a rank can refuse by itself (a ``plan`` that is not a :class:`SlicePlan`, a bad ``src``) travels
in the first exchange as that rank's error, so that every rank raises it and none waits for a peer
that left before the exchange.
"""

from __future__ import annotations

from typing import Any

from ckpt_core.errors import CkptError, ConfigError
from ckpt_core.ops.cache import BoundedCache
from ckpt_core.planning.slice_json import plan_from_json
from ckpt_core.planning.slices import SlicePlan, plan_to_json, require_plan


class SharedPlans:
    """The last few plans a rank shared, by digest (each is immutable)."""

    def __init__(self, size: int = 4):
        self.size = size
        self._plans: BoundedCache[str, SlicePlan] = BoundedCache(size)

    def get(self, digest: str) -> SlicePlan | None:
        return self._plans.get(digest)

    def put(self, plan: SlicePlan) -> SlicePlan:
        return self._plans.put(plan.digest, plan)


def share_plan(coll, rank: int, plan: SlicePlan | None, *, src: int | None, error: str | None,
               known: SharedPlans) -> SlicePlan:
    """Collective over ``coll`` (``all_gather_json``): rank ``src``'s plan on every rank (``src=None``:
    the lowest rank that passed one). A rank's ``error`` (why it has none) is raised on every rank, as
    are a ``plan`` that is not a :class:`SlicePlan` and ranks that name different sources."""
    error = _local_error(plan, src, error)
    mine: dict[str, Any] = {"src": None if error else src}
    if error is not None:
        mine["error"] = error
    elif plan is not None and src in (None, rank):
        mine["digest"] = plan.digest
    offers = coll.all_gather_json(mine)
    elsewhere = [r for r, o in enumerate(offers) if not isinstance(o, dict) or "src" not in o]
    if elsewhere:   # their first exchange met ours: they raise too (it is not theirs), nobody waits
        raise ConfigError(f"share_slice_plan: rank(s) {elsewhere} are in another collective, not sharing a slice plan: "
                          "call it on every rank")
    failed = [f"rank {r}: {o['error']}" for r, o in enumerate(offers) if "error" in o]
    if failed:
        raise ConfigError(f"no slice plan to share: {'; '.join(failed)}")
    if len({o["src"] for o in offers}) != 1 or (src is not None and src >= len(offers)):
        raise ConfigError(f"share_slice_plan: the ranks name the source ranks {[o['src'] for o in offers]} in a "
                          f"world of {len(offers)}: give every rank the same src (or None)")
    if src is None:
        src = next((r for r, o in enumerate(offers) if "digest" in o), None)
    if src is None or "digest" not in offers[src]:
        raise ConfigError(f"rank {src} shared no slice plan" if src is not None else "no rank shared a slice plan")
    digest = offers[src]["digest"]
    local = plan if plan is not None and rank == src else known.get(digest)
    everyone = all(coll.all_gather_json(local is not None))
    if everyone and local is not None:   # everyone: this rank's too
        return known.put(local)
    # rank src announced a digest: it holds the plan
    shared = plan_from_json(coll.all_gather_json(plan_to_json(plan) if rank == src and plan is not None else None)[src])
    if shared.digest != digest:   # the same document hashed on two ranks: never expected
        raise ConfigError(f"rank {src}'s slice plan arrived as {shared.digest}, announced as {digest}")
    return known.put(shared)


def _local_error(plan, src, error) -> str | None:
    """Why this rank cannot take part (the caller's ``error``, a ``plan`` that is not a plan, a ``src``
    that is not a rank number), as the text its first exchange carries; None: it can."""
    if error is not None:
        return error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    try:
        if plan is not None:
            require_plan(plan, "share_slice_plan's plan")
        if src is not None and (isinstance(src, bool) or not isinstance(src, int) or src < 0):
            raise ConfigError(f"share_slice_plan's src must be None or a rank number, got {src!r}")
    except CkptError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
