"""Which delta companion an ``update(name, ..., delta=...)`` moves, agreed on every rank before anything moves.

A version may have several companions: ``name@delta`` (its delta from the base it was registered with)
and folds ``name@delta:<base>`` (``fold_delta``: its deltas folded into one from an older version).
Each rank tells, in one exchange (:func:`view`, gathered by the caller), which companions of ``name`` it
can serve or read (registered here, or in the owners' metas it loaded: P2P only), from which base,
and what its engines hold when it is a target (what this PS last made live there; None: unknown).
:func:`choose` then picks, alike on every rank, the companion whose base the targets' engines hold:

- the targets' records agree on a version ``H`` and some rank has a fold from ``H``: that one, which
  every rank must have under the same name (registered on every rank, or loaded on every rank);
- otherwise (records unknown, or no fold from ``H`` anywhere) ``name@delta``, as before folds
  existed: its base must be known and the same on every rank, and an ``H`` that differs from it is a
  skipped version, refused with the advice (the chain to apply in order, or ``fold_delta``).

Anything missing or disagreeing is one ``DeltaBaseError`` on every rank. An engine worker still
refuses a base it does not hold in its handshake (``apply._Update.on_plan``).
"""

from __future__ import annotations

from ckpt_core.delta.versions import FOLD, advice, base_of_manifests, companion, fold_companion
from ckpt_core.errors import DeltaBaseError

Candidates = dict[str, list]   # base -> [companion name, registered on this rank, in the metas it loaded]


def candidates(name: str, registered: dict[str, str], loaded: dict[str, list[str]]) -> Candidates:
    """This rank's companions of version ``name``: ``registered`` (base -> companion, this rank's own)
    and ``loaded`` (companion -> its tensor names, from loaded metas: the base is read from the manifests,
    which must name ``name``; ``DeltaBaseError`` if they disagree)."""
    out: Candidates = {base: [comp, True, False] for base, comp in registered.items()}
    for comp, names in loaded.items():
        if comp != companion(name) and not comp.startswith(name + FOLD):
            continue
        base = base_of_manifests(names, name)
        if base is None or comp not in (companion(name), fold_companion(name, base)):
            continue   # not a delta of name (a checkpoint that happens to share the prefix)
        entry = out.setdefault(base, [comp, False, False])
        if entry[0] == comp:
            entry[2] = True
    return out


def view(name, cands: Candidates, default: str | None, holds: str | None, target: bool) -> dict:
    """This rank's side of the exchange. ``default``: the base of ``name@delta`` here (registered or loaded)."""
    return {"delta": name, "problem": None, "candidates": cands, "default": default, "holds": holds, "target": target}


def choose(views: list[dict], name: str, *, p2p: bool, known: dict[str, str]) -> tuple[str, str]:
    """``(base, companion)`` of the delta every rank moves (see the module docstring); the same on
    every rank, or the same ``DeltaBaseError`` on every rank. ``known``: the deltas this rank knows
    (version -> base), for the advice."""
    what = f"P2P delta update({name!r})" if p2p else f"delta update({name!r})"
    records = sorted({v["holds"] for v in views if v.get("target") and v.get("holds") is not None})
    if len(records) > 1:
        shown = ", ".join(f"rank {r} last made {v['holds']!r} live" for r, v in enumerate(views)
                          if v.get("target") and v.get("holds") is not None)
        raise DeltaBaseError(f"{what} refused: the target engines hold different versions ({shown}): no one delta "
                             f"brings them all to {name!r}; update it whole")
    defaults = sorted({v["default"] for v in views if v.get("default") is not None})
    if len(defaults) > 1:
        told = ", ".join(f"rank {r} {v.get('default')!r}" for r, v in enumerate(views))
        raise DeltaBaseError(f"{what} refused: ranks disagree on the base of {name!r} ({told})")
    held = records[0] if records else None
    if held is not None and any(v["candidates"].get(held, [companion(name)])[0] != companion(name) for v in views):
        return held, _companion_from(views, name, held, what, p2p)   # a fold from what the engines hold
    base = _default(views, name, what, p2p)
    if held is not None and held != base:
        r = next(r for r, v in enumerate(views) if v.get("target") and v.get("holds") == held)
        raise DeltaBaseError(f"{what} refused: the delta of {name!r} applies to {base!r}, but rank {r} last made "
                             f"{held!r} live in its engines; {advice(known, name, held)}")
    return base, companion(name)


def _companion_from(views: list[dict], name: str, base: str, what: str, p2p: bool) -> str:
    """The one companion of ``name`` from ``base`` that every rank serves or reads alike."""
    lacking = [r for r, v in enumerate(views) if base not in v["candidates"]]
    if lacking:
        having = [r for r in range(len(views)) if r not in lacking]
        raise DeltaBaseError(f"{what} refused: rank(s) {lacking} have no delta of {name!r} from {base!r} (rank(s) "
                             f"{having} have one): fold_delta({name!r}, base={base!r}) on every rank"
                             + (" of the owners' world, then gather_metas and load the metas again" if p2p else ""))
    comps = [v["candidates"][base] for v in views]
    if len({c[0] for c in comps}) != 1:
        told = ", ".join(f"rank {r} {c[0]!r}" for r, c in enumerate(comps))
        raise DeltaBaseError(f"{what} refused: ranks disagree on which delta of {name!r} leads from {base!r} ({told})")
    if not (all(c[1] for c in comps) or (p2p and all(c[2] for c in comps))):
        raise DeltaBaseError(f"{what} refused: the delta {comps[0][0]!r} is registered on rank(s) "
                             f"{[r for r, c in enumerate(comps) if c[1]]} and in the loaded metas of rank(s) "
                             f"{[r for r, c in enumerate(comps) if c[2]]}: every rank must serve it, or every rank "
                             "read it from the owners' metas")
    return str(comps[0][0])


def _default(views: list[dict], name: str, what: str, p2p: bool) -> str:
    """The base of ``name@delta`` that every rank agrees on (its registered delta)."""
    comp = companion(name)

    def has(v: dict, i: int) -> bool:
        c = v["candidates"].get(v.get("default"))
        return c is not None and c[0] == comp and bool(c[i])
    registered = [r for r, v in enumerate(views) if has(v, 1)]
    loaded = [r for r, v in enumerate(views) if has(v, 2)]
    missing = [r for r, v in enumerate(views) if v.get("default") is None]
    everywhere = len(registered) == len(views) or (p2p and len(loaded) == len(views))
    if not p2p and (missing or not everywhere):
        raise DeltaBaseError(f"{what} refused: {name!r} was not registered with a base on rank(s) "
                             f"{missing or list(range(len(views)))}: update it whole")
    if missing or not everywhere:
        raise DeltaBaseError(f"{what} refused: rank(s) {missing or list(range(len(views)))} cannot serve or read the "
                             f"delta of {name!r} (registered with base= on rank(s) {registered}, in the loaded metas "
                             f"of rank(s) {loaded}): register {name!r} with base= on every rank of the owners' world "
                             f"(whose gather_metas({name!r}) then carries its delta into their metas for joining "
                             "worlds), or update it whole")
    return str(views[0]["default"])   # the same on every rank (choose checked it)


__all__ = ["candidates", "choose", "view"]
