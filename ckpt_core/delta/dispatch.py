"""Which transfer an ``update`` call becomes, with the delta bookkeeping around it.

``ParameterServer.update`` hands every call to :class:`Updates` (built once by the facade with the
rank's update context, catalog, P2P state and delta versions): a full broadcast update, a full P2P
update (``ranks=[...]``), or a delta of either (``delta=True|"fallback"``, ``versions.py``). It
also keeps what each rank last made live in its engines (``DeltaVersions.engines_hold``): the
engines of the ranks an update reaches, and only theirs (a P2P update leaves the others alone).

A P2P delta (``ranks=[...], delta=...``) moves the companion checkpoint ``name@delta`` over the
unchanged P2P path: owners serve it as they serve any checkpoint (registered with ``base=`` on a
serving rank), readers fetch only its payloads, and the engine workers apply and check them as on
the broadcast path (``apply.py``). Before anything moves, one exchange (:func:`agree_p2p_delta`)
agrees on every rank where the companion's metas come from (gathered again in this world when
every rank registered it, or the owners' metas every rank loaded), the delta's base (each rank's
view: its registration, or the manifests of the metas it loaded), and each target's check that its
engines hold that base. Anything missing or disagreeing is one ``DeltaBaseError`` on every rank
(or, with ``"fallback"``, a full P2P update of ``name``).
"""

from __future__ import annotations

from ckpt_core.checkpoint.sources import RegisteredCheckpoint
from ckpt_core.delta.versions import (
    DELTA_MODES,
    DeltaVersions,
    advice,
    base_of_manifests,
    companion,
    run_delta_update,
    with_precheck,
)
from ckpt_core.errors import CheckpointNotFoundError, ConfigError, DeltaBaseError
from ckpt_core.p2p.agree import targets_of
from ckpt_core.p2p.state import P2PState
from ckpt_core.p2p.update import run_update as run_p2p_update
from ckpt_core.transfer.agree import gather_metas
from ckpt_core.transfer.broadcast import ReqFunc
from ckpt_core.transfer.broadcast import run_update as run_broadcast_update
from ckpt_core.transfer.context import Catalog, UpdateContext
from ckpt_core.transfer.prechecks import problem_of, raise_agreed, same_call


class Updates:
    """One rank's update flows and delta bookkeeping (the facade's ``update``, ``gather_metas`` and
    the delta part of ``register_checkpoint``/``unregister_checkpoint``)."""

    def __init__(self, ctx: UpdateContext, catalog: Catalog, p2p: P2PState, versions: DeltaVersions):
        self.ctx, self.catalog, self.p2p, self.versions = ctx, catalog, p2p, versions

    # -- registration ------------------------------------------------------------
    def add(self, name: str, ckpt: RegisteredCheckpoint, base: str | None) -> None:
        """Install registered checkpoint ``name`` in the catalog, served to P2P readers (``serve_p2p`` only);
        with ``base``, first its delta against ``base`` (this rank's share) as the companion checkpoint
        ``name@delta``, served alike. A delta that cannot be encoded releases ``ckpt`` and installs nothing."""
        if base is not None:
            try:
                comp = self.versions.encode(name, ckpt, base, self.catalog.checkpoints.get(base), self.ctx.backend)
            except BaseException:
                ckpt.release()
                raise
            self.catalog.checkpoints[companion(name)] = comp
            self.p2p.on_register(companion(name), comp)
        self.catalog.checkpoints[name] = ckpt
        self.p2p.on_register(name, ckpt)

    def remove(self, name: str) -> RegisteredCheckpoint:
        """Uninstall and release checkpoint ``name`` (and its delta, if any): its P2P service first (a
        reader's next stamp check fails), then its memory, metas and plans. Returns it (released)."""
        ckpt = self.catalog.checkpoints.pop(name)
        if companion(name) in self.catalog.checkpoints:   # its delta goes with it
            self.versions.forget(name)
            self.remove(companion(name))
        self.p2p.on_unregister(name)
        ckpt.release()
        self.catalog.metas.pop(name, None)
        self.catalog.plans.forget(name)
        return ckpt

    def gather(self, name: str) -> None:
        """Collective (``gather_metas``): ``name``'s metas and owners' stores, and its delta's when every
        rank registered one (so that ``get_metas``/``save_metas`` carry it for joining worlds)."""
        self.gather_one(name)
        everywhere = self.ctx.coll.all_gather_json(companion(name) in self.catalog.checkpoints)
        if all(everywhere):
            self.gather_one(companion(name))

    def gather_one(self, name: str) -> None:
        """Collective: checkpoint ``name``'s metas and every owner's P2P store for it."""
        gather_metas(self.ctx, self.catalog, name)
        self.p2p.gather(name)

    def known_bases(self) -> dict[str, str]:
        """Every delta this rank knows (version -> base): registered here, or in metas it gathered or loaded."""
        out: dict[str, str] = {}
        sources = {n: s.metas for n, s in self.p2p.loaded.items()} | dict(self.catalog.metas)
        for comp, metas in sources.items():
            version = comp[:-len(companion(""))]
            if comp.endswith(companion("")) and version:
                try:
                    base = base_of_manifests([m.name for ms in metas for m in ms], version)
                except DeltaBaseError:
                    continue
                if base is not None:
                    out[version] = base
        return out | self.versions.bases

    # -- update ------------------------------------------------------------------
    def run(self, name: str, req_func: ReqFunc, *, ranks, timeout, slices, delta) -> dict:
        """``ParameterServer.update``'s dispatch (the facade holds the update lock around it)."""
        if not delta:
            return self._full(name, req_func, ranks, timeout, slices)
        if slices is not None or self.ctx.wire != "native":
            raise ConfigError("delta updates are updates of whole tensors on our wire for now: no slices= or "
                              "stock wire (docs/deltas.md)")
        if ranks:
            return self._p2p_delta(name, req_func, ranks, timeout, delta)
        bases = self.known_bases
        return run_delta_update(
            self.versions, name, with_precheck(req_func, lambda: self.versions.precheck(name, bases=bases())), delta,
            prepare=lambda: self._gather_delta(name),
            update=lambda n, rf: run_broadcast_update(self.ctx, self.catalog, n, rf, timeout, None), bases=bases)

    def _full(self, name: str, req_func: ReqFunc, ranks, timeout, slices) -> dict:
        mine = self._reaches_me(ranks)
        if mine:
            self.versions.made_live(None)   # until it succeeds, the engines hold a mix
        if ranks:   # P2P into those ranks, from the owners' host memory (p2p/update.py)
            result = run_p2p_update(self.ctx, self.p2p, name, req_func, ranks, timeout, slices)
        else:
            result = run_broadcast_update(self.ctx, self.catalog, name, req_func, timeout, slices)
        if mine:
            self.versions.made_live(name)
        return result

    def _reaches_me(self, ranks) -> bool:
        """Whether an update with ``ranks`` reaches this rank's engine (bad ``ranks``: assume it does;
        the update refuses them on every rank)."""
        if not ranks:
            return True
        try:
            return self.ctx.rank in targets_of(ranks, self.ctx.world_size)
        except ConfigError:
            return True

    def _gather_delta(self, name: str) -> str | None:
        """A broadcast delta's preparation: the companion's metas gathered from every rank. Returns this
        rank's base (None: none; its precheck refuses it in the update's first exchange, on every rank)."""
        try:
            gather_metas(self.ctx, self.catalog, companion(name))
        except CheckpointNotFoundError as exc:
            raise DeltaBaseError(f"{name!r} was not registered with a base on every rank ({exc})") from exc
        return self.versions.bases.get(name)

    def _p2p_delta(self, name: str, req_func: ReqFunc, ranks, timeout, mode) -> dict:
        def update(checkpoint: str, rf) -> dict:
            result = run_p2p_update(self.ctx, self.p2p, checkpoint, rf, ranks, timeout, None)
            if checkpoint == companion(name):   # what the readers moved against what the version weighs
                delta_bytes, version_bytes = self._sizes(name)
                result["delta"] = {"delta_bytes": delta_bytes, "version_bytes": version_bytes}
            return result
        if mode not in DELTA_MODES:   # refused in the agreement: every rank raises, none waits in it
            agree_p2p_delta(self, name, ranks, mode)
        return run_delta_update(self.versions, name, req_func, mode,
                                prepare=lambda: agree_p2p_delta(self, name, ranks, mode), update=update,
                                bases=self.known_bases, affects_engine=self._reaches_me(ranks))

    def _sizes(self, name: str) -> tuple[int, int | None]:
        """Bytes of ``name``'s delta and of the whole version (None: this rank knows no metas of it), every owner's."""
        def total(n: str) -> int | None:
            metas = self.p2p.loaded[n].metas if n in self.p2p.loaded else self.catalog.metas.get(n)
            return None if metas is None else sum(m.nbytes for ms in metas for m in ms)
        return total(companion(name)) or 0, total(name)


def _delta_view(u: Updates, name, ranks, mode) -> dict:
    """This rank's side of a P2P delta's agreement (see the module docstring)."""
    comp = companion(name) if isinstance(name, str) else None
    view: dict[str, object] = {"delta": name if isinstance(name, str) else repr(name), "problem": None}
    try:
        if comp is None:
            raise ConfigError(f"checkpoint name must be a string, got {name!r}")
        if mode not in DELTA_MODES:
            raise ConfigError(f"delta must be False, True or 'fallback', got {mode!r}")
        target = u.ctx.rank in targets_of(ranks, u.ctx.world_size)
        loaded = u.p2p.loaded.get(comp)
        base = u.versions.bases.get(name)
        if base is None and loaded is not None:
            base = base_of_manifests([m.name for ms in loaded.metas for m in ms], name)
        view.update(registered=comp in u.catalog.checkpoints, loaded=loaded is not None, base=base,
                    holds=u.versions.engines_hold if target else None, target=target)
    except Exception as exc:   # ours or not: told to every rank, nobody is left waiting in a collective
        view["problem"] = problem_of(exc)
    return view


def agree_p2p_delta(u: Updates, name: str, ranks, mode=True) -> str:
    """Collective over the world, before a P2P delta moves anything: the delta's base, agreed; the
    companion's metas gathered in this world when every rank registered it. Raises the same error
    on every rank (``DeltaBaseError`` for a missing or mismatched delta or base)."""
    views = u.ctx.coll.all_gather_json(_delta_view(u, name, ranks, mode))
    what = f"P2P delta update({name!r})"
    raise_agreed([v.get("problem") for v in views], what)
    same_call(views, "P2P delta update", {"delta": "version"})
    where = {k: [r for r, v in enumerate(views) if v.get(k)] for k in ("registered", "loaded")}
    missing = [r for r, v in enumerate(views) if v.get("base") is None]
    everywhere = len(where["registered"]) == len(views) or len(where["loaded"]) == len(views)
    if missing or not everywhere:
        raise DeltaBaseError(f"{what} refused: rank(s) {missing or list(range(len(views)))} cannot serve or read the "
                             f"delta of {name!r} (registered with base= on rank(s) {where['registered']}, in the "
                             f"loaded metas of rank(s) {where['loaded']}): register {name!r} with base= on every "
                             f"rank of the owners' world (whose gather_metas({name!r}) then carries its delta into "
                             "their metas for joining worlds), or update it whole")
    bases = {str(v["base"]) for v in views}
    if len(bases) != 1:
        told = ", ".join(f"rank {r} {v.get('base')!r}" for r, v in enumerate(views))
        raise DeltaBaseError(f"{what} refused: ranks disagree on the base of {name!r} ({told})")
    if len(where["registered"]) == len(views):
        u.gather_one(companion(name))   # every rank registered the delta: this world's owners serve it
        base_of_manifests([m.name for ms in u.catalog.metas[companion(name)] for m in ms], name)   # all alike
    base = bases.pop()
    stale = [(r, v["holds"]) for r, v in enumerate(views) if v.get("target") and v.get("holds") not in (None, base)]
    if stale:
        shown = ", ".join(f"rank {r} last made {h!r} live" for r, h in stale)
        raise DeltaBaseError(f"{what} refused: the delta of {name!r} applies to {base!r}, but {shown} in its "
                             f"engines; {advice(u.known_bases(), name, stale[0][1])}")
    return base


__all__ = ["Updates", "agree_p2p_delta"]
