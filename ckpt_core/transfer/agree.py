"""The exchanges before a broadcast update: gathering the metas, and the update's first exchange.

``gather_metas``: every rank learns every rank's tensors of a checkpoint, checked alike everywhere.

Each rank checks the call (``UpdateContext.precheck_call``) and its own share of the checkpoint
without a collective; the problem, if any, travels in the one exchange that also carries every
rank's metas digest and the (bucket size, slots) its free memory allows, so that every rank
raises the same error (``transfer/prechecks.py``) or plans the same buckets. The P2P update's
counterpart is ``p2p/agree.py``.
"""

from __future__ import annotations

import time
from typing import TypedDict

from ckpt_core.checkpoint.sources import RegisteredCheckpoint
from ckpt_core.errors import CheckpointFormatError, CheckpointNotFoundError, CkptError, ConfigError
from ckpt_core.planning.buckets import Plan, delta_companion, first_shared_name
from ckpt_core.planning.pieces import group_pieces
from ckpt_core.planning.slices import SlicePlan
from ckpt_core.transfer.context import Catalog, UpdateContext
from ckpt_core.transfer.prechecks import (
    IDENTITY,
    Problem,
    meta_row,
    problem_of,
    raise_agreed,
    same_call,
    same_kind,
    tensor_meta,
)


class LayoutView(TypedDict, total=False):
    """One rank's view in the update's first exchange: its problem, or its metas digest and the
    (bucket size, slots) its free memory allows; then the update's identity and slice plan."""
    problem: Problem | None
    fp: str
    bucket: int
    slots: int
    name: str
    wire: str
    slices: str | None


def precheck(ctx: UpdateContext, catalog: Catalog, name, req_func, timeout,
             slices=None) -> tuple[float, RegisteredCheckpoint | None, list | None]:
    """This rank's own checks of a broadcast update (no collective): (deadline, checkpoint, problem).

    The problem is not raised here but sent in the first exchange, so that every rank
    raises it (:func:`agree_plan`) and none is left waiting in a collective.
    """
    deadline, problem = ctx.precheck_call(req_func, timeout, slices)
    if problem is not None:
        return deadline, None, problem
    try:
        return deadline, own_share(catalog, name, ctx.rank), None
    except CkptError as exc:
        return deadline, None, problem_of(exc)


def own_share(catalog: Catalog, name, rank: int) -> RegisteredCheckpoint:
    """The checkpoint this rank sends from; a rank that loaded metas giving it nothing gets an empty one."""
    if not isinstance(name, str):
        raise ConfigError(f"checkpoint name must be a string, got {name!r}")
    ckpt, metas = catalog.checkpoints.get(name), catalog.metas.get(name)
    if metas is None:
        if ckpt is None:
            raise CheckpointNotFoundError(f"checkpoint {name!r} is not registered on rank {rank}")
        raise ConfigError(f"call gather_metas({name!r}) on every rank before update({name!r})")
    mine = metas[rank]
    if ckpt is None:
        if mine:
            raise CheckpointNotFoundError(f"checkpoint {name!r} is not registered on rank {rank}, "
                                          f"whose metas list {len(mine)} tensors for it")
        return RegisteredCheckpoint(name, [], {})
    if mine is not ckpt.metas and list(mine) != list(ckpt.metas):
        raise ConfigError(f"the metas of {name!r} for rank {rank} do not describe the checkpoint "
                          f"registered there; call gather_metas({name!r}) on every rank again")
    return ckpt


def agree_plan(ctx: UpdateContext, catalog: Catalog, name: str, problem: list | None,
               slices=None) -> tuple[Plan, int, tuple[str, str]]:
    """All ranks agree on (bucket size, slots) from their free memory, then plan (cached).

    The same exchange carries every rank's pre-check problem: if any rank has one, every
    rank raises it. Returns the plan, the slots to use and the plan's wire form (JSON, digest).
    """
    view: LayoutView = {"problem": problem}
    if problem is None:
        try:
            view = layout_view(ctx, catalog, name, slices)
        except Exception as exc:   # ours or not: told to every rank, none is left waiting
            view = {"problem": problem_of(exc)}
    # the update's identity: ranks naming two checkpoints of one layout would send a mix of both
    view["name"], view["wire"] = name if isinstance(name, str) else repr(name), ctx.wire
    view["slices"] = slices.digest if isinstance(slices, SlicePlan) else None   # not a plan: a problem above
    views = ctx.coll.all_gather_json(view)
    raise_agreed([v.get("problem") for v in views], f"update({name!r})")
    same_kind(views, f"update({name!r})")
    same_call(views, "update", IDENTITY)
    metas, fp = catalog.metas[name], view["fp"]
    if len({v["fp"] for v in views}) != 1:
        raise ConfigError(f"ranks disagree on the metas of {name!r}: call gather_metas on every rank again")
    if len({v["slices"] for v in views}) != 1:
        raise ConfigError(f"ranks disagree on the slice plan of update({name!r}): "
                          f"{[v['slices'] for v in views]} (give every rank the same plan, or none)")
    size, slots = min(v["bucket"] for v in views), min(v["slots"] for v in views)
    plan, wire = catalog.plans.get(metas, fp, size, slices=slices, rank=ctx.rank)
    return plan, max(1, min(slots, len(plan.buckets))), wire


def layout_view(ctx: UpdateContext, catalog: Catalog, name: str, slices=None) -> LayoutView:
    """This rank's metas digest and the (bucket size, slots) its free memory allows (with ``slices``, for
    what the sliced update moves)."""
    metas = catalog.metas[name]
    digest = catalog.plans.digest(name, metas)
    size, slots = ctx.layout(catalog.plans.sizes(metas, digest, slices if isinstance(slices, SlicePlan) else None),
                             delta=delta_companion(name))
    return {"fp": digest, "bucket": size, "slots": slots}


def gather_metas(ctx: UpdateContext, catalog: Catalog, name) -> None:
    """Collective (``ParameterServer.gather_metas``): every rank's metas of checkpoint ``name``, checked
    (one owner per tensor, pieces that tile) and installed in ``catalog`` alike on every rank. A local
    problem (a name that is not a string) travels in the exchange: every rank raises it."""
    t0 = time.perf_counter()
    ckpt = mine = problem = None
    if isinstance(name, str):   # a local problem goes into the exchange: no rank is left waiting
        ckpt = catalog.checkpoints.get(name)
        mine = None if ckpt is None else [meta_row(m) for m in ckpt.metas]
    else:
        problem = problem_of(ConfigError(f"checkpoint name must be a string, got {name!r}"))
    # the name travels too: ranks gathering two checkpoints would each install a mix of both
    gathered = ctx.coll.all_gather_json({"metas": mine, "problem": problem,
                                         "name": name if isinstance(name, str) else repr(name)})
    raise_agreed([g["problem"] for g in gathered], f"gather_metas({name!r})")
    same_call(gathered, "gather_metas", {"name": "checkpoint"})
    gathered = [g["metas"] for g in gathered]
    missing = [r for r, g in enumerate(gathered) if g is None]
    if missing or ckpt is None:   # this rank's own share is None only when it is missing too
        raise CheckpointNotFoundError(f"checkpoint {name!r} is not registered on rank(s) {missing}")
    metas = [ckpt.metas if r == ctx.rank else
             [tensor_meta(*row, where=f"rank {r}'s metas of {name!r}") for row in g]   # as load_metas does
             for r, g in enumerate(gathered)]
    shared = first_shared_name(metas)
    if shared:
        raise CheckpointFormatError(f"tensor is registered on rank {shared[1]} and rank {shared[2]}", tensor=shared[0])
    pieced = group_pieces(metas)   # pieces must tile their tensors: the same verdict on every rank
    catalog.metas[name] = metas
    ctx.log.info("gathered metas of %r: %d tensors (%d of them in pieces) on %d ranks in %.3f s", name,
                 sum(1 for ms in metas for m in ms if m.box is None) + len(pieced), len(pieced),
                 ctx.world_size, time.perf_counter() - t0)
