"""The first exchange of a P2P update: every rank's pre-checks and the update's identity, agreed.

A problem on any rank (bad timeout, req_func, ranks or name; a target without metas or
Mooncake; an owner of this world that no longer holds the checkpoint) and any disagreement
between ranks (the checkpoint's name, the engine wire, the metas' digest, ``ranks``, the kind
of update) is raised on every rank alike, before a group is made or anything moves: the world
stays usable. The checks themselves are the broadcast update's (``transfer/prechecks.py``).

With a slice plan (``p2p/slices.py``) the same exchange carries the plan's digest (every rank must
agree on it; the targets, in rank order, are its engine ranks 0, 1, ...), every rank's check of
the plan against the targets and the checkpoint, and each owner's digests of the plan's boxes.
A joining world's owners send nothing: its targets take the box digests from their loaded metas
(``slices.published_boxes``), where the owners published them (``get_metas(slices=plan)``).
"""

from __future__ import annotations

import operator

from ckpt_core.checkpoint.device import refuse_device_resident
from ckpt_core.errors import CheckpointNotFoundError, ConfigError
from ckpt_core.p2p.metas import Source
from ckpt_core.p2p.slices import check_call, published_boxes
from ckpt_core.p2p.state import P2PState
from ckpt_core.transfer.context import Catalog, UpdateContext
from ckpt_core.transfer.prechecks import IDENTITY, problem_of, raise_agreed, same_call, same_kind


def targets_of(ranks, world_size: int) -> tuple[int, ...]:
    try:
        out = tuple(sorted({operator.index(r) for r in ranks}))
    except TypeError as exc:
        raise ConfigError(f"ranks must be a list of integers, got {ranks!r}") from exc
    if not out or out[0] < 0 or out[-1] >= world_size:
        raise ConfigError(f"ranks {list(ranks)} are not all in [0, {world_size})")
    return out


def _metas_digest(catalog: Catalog, name: str, src: Source) -> str:
    return catalog.plans.digest(f"p2p:{name}", src.metas)


def _target_view(ctx: UpdateContext, state: P2PState, name: str) -> tuple[Source, dict]:
    """A target's own checks and what it tells the others: its metas digest, the (bucket size,
    slots) its free memory allows, and, for metas gathered in this world, the owner ranks."""
    src = state.source(name)
    store = state.ensure_store(required=True)
    assert store is not None  # noqa: S101 - type narrowing: ensure_store(required=True) raises without one
    store.quarantine.reap()
    # an owner whose share is only 0-byte tensors is never read from: it needs no store
    missing = [r for r, p in enumerate(src.peers) if p is None and any(m.nbytes for m in src.metas[r])]
    if missing:
        raise ConfigError(f"owner rank(s) {missing} of {name!r} do not serve it over P2P (start the owners with "
                          "serve_p2p=True or PS_P2P_SERVE=1; Mooncake installed there? registered without "
                          "on_device=True?)")
    metas = src.metas
    fp = _metas_digest(state.catalog, name, src)
    layout = ctx.layout(state.catalog.plans.sizes(metas, fp))   # a tensor in pieces counts whole; once per layout
    owners = None if name in state.loaded else [r for r, ms in enumerate(metas) if ms]
    return src, {"fp": fp, "layout": layout, "owners": owners}


def _bystander_view(state: P2PState, name: str) -> dict:
    """A rank outside ``ranks`` that knows the checkpoint's metas tells their digest too."""
    try:
        return {"fp": _metas_digest(state.catalog, name, state.source(name))}
    except ConfigError:
        return {}


def _view(ctx: UpdateContext, state: P2PState, name, targets, problem) -> tuple[Source | None, dict]:
    if not isinstance(name, str):
        raise ConfigError(f"checkpoint name must be a string, got {name!r}")
    if problem is None and ctx.rank in targets:
        return _target_view(ctx, state, name)
    return None, _bystander_view(state, name)


def _slices_view(ctx: UpdateContext, state: P2PState, name: str, slices, targets,
                 src: Source | None) -> tuple[dict, list | None]:
    """This rank's checks of a sliced call and, on an owner of this world, its box digests (in the
    view); on a target of a joining world, the owners' published box digests (returned)."""
    catalog = state.catalog
    metas = src.metas if src is not None else catalog.metas.get(name)
    if metas is not None:
        check_call(slices, targets, metas)
    if src is not None and name in state.loaded:   # owners of another world: their digests are in the metas
        return {}, published_boxes(name, src, slices)
    out = {}
    ckpt, gathered = catalog.checkpoints.get(name), catalog.metas.get(name)
    if ckpt is not None and gathered is not None and gathered[ctx.rank] and name in state.gathered:
        out["boxes"] = state.boxes_of(name, slices)
    return out, None


def first_exchange(ctx: UpdateContext, state: P2PState, name, req_func, ranks, timeout,
                   slices=None) -> tuple[float, tuple[int, ...], Source | None, list, list | None]:
    """Every rank's pre-checks and identity, agreed in one exchange (see the module docstring).
    Returns (deadline, targets (in rank order), source, target views, and with ``slices``: every
    owner rank's box digests)."""
    deadline, problem = ctx.precheck_call(req_func, timeout, slices)   # a non-plan, or slices on the stock wire
    targets: tuple[int, ...] | None = None
    src, loaded_boxes = None, None
    extra: dict = {}
    try:
        targets = targets_of(ranks, ctx.world_size)
        if isinstance(name, str):   # an owner here: its readers would read its host memory
            refuse_device_resident(state.catalog.checkpoints.get(name), name, "a P2P update (Mooncake reads the "
                                   "owners' host memory)", ctx.rank)
        src, extra = _view(ctx, state, name, targets, problem)
        if slices is not None and problem is None:
            more, loaded_boxes = _slices_view(ctx, state, name, slices, targets, src)
            extra.update(more)
    except Exception as exc:   # ours or not: told to every rank, nobody is left waiting in a collective
        problem = problem or problem_of(exc)
    holds = isinstance(name, str) and name in state.catalog.checkpoints
    view = {"targets": targets and list(targets), "problem": problem, "holds": holds,
            "name": name if isinstance(name, str) else repr(name), "wire": ctx.wire,
            "slices": None if slices is None else getattr(slices, "digest", repr(slices)), **extra}
    views = ctx.coll.all_gather_json(view)
    what = f"P2P update({name!r})"
    raise_agreed([v.get("problem") for v in views], what)
    assert targets is not None  # noqa: S101 - type narrowing: bad ranks= were a problem, raised above
    same_kind(views, what)
    same_call(views, "P2P update", IDENTITY)
    same_call(views, "P2P update", {"slices": "slice plan"})
    if len({tuple(v["targets"]) for v in views}) != 1:
        raise ConfigError(f"{what} refused: ranks disagree on the targets: {[v['targets'] for v in views]}")
    gone = sorted({r for v in views for r in v.get("owners") or () if not views[r]["holds"]})
    if gone:
        raise CheckpointNotFoundError(f"{what} refused: checkpoint {name!r} is not registered on owner "
                                      f"rank(s) {gone} (unregistered since gather_metas?)")
    if len({v["fp"] for v in views if "fp" in v}) != 1:
        told = {r: v["fp"][:12] for r, v in enumerate(views) if "fp" in v}
        raise ConfigError(f"{what} refused: ranks disagree on the metas of {name!r} ({told}): "
                          "gather or load them again everywhere")
    sliced = None if slices is None else (
        loaded_boxes if loaded_boxes is not None else [v.get("boxes") for v in views])
    return deadline, targets, src, [views[r] for r in targets], sliced
