"""Which transfer an ``update`` call becomes, with the delta bookkeeping around it.

``ParameterServer.update`` hands every call to :class:`Updates` (built once by the facade with the
rank's update context, catalog, P2P state and delta versions): a full broadcast update, a full P2P
update (``ranks=[...]``), or a delta of either (``delta=True|"fallback"``, ``versions.py``). It
also keeps what each rank last made live in its engines (``DeltaVersions.engines_hold``): the
engines of the ranks an update reaches, and only theirs (a P2P update leaves the others alone).

A P2P delta (``ranks=[...], delta=...``) moves a companion checkpoint (``name@delta``, or a fold
``name@delta:<base>``) over the unchanged P2P path: owners serve it as they serve any checkpoint
(registered with ``base=`` or folded on a serving rank), readers fetch only its payloads, and the
engine workers apply and check them as on the broadcast path (``apply.py``). Before anything moves,
broadcast or P2P, one exchange (:func:`agree_delta`) agrees on every rank which companion moves (the
one whose base the targets' engines hold, ``choose.py``), where its metas come from (gathered again
in this world when every rank registered it, or the owners' metas every rank loaded) and its base.
Anything missing or disagreeing is one ``DeltaBaseError`` on every rank (or, with ``"fallback"``, a
full update of ``name``).
"""

from __future__ import annotations

from ckpt_core.checkpoint.device import build_device_checkpoint, refuse_device_resident
from ckpt_core.checkpoint.sources import PackedRegion, RegisteredCheckpoint, build_packed
from ckpt_core.delta._sliced_flow import SlicedDeltas
from ckpt_core.delta.choose import candidates, choose, view
from ckpt_core.delta.sliced import sliced_name
from ckpt_core.delta.versions import (
    DELTA_MODES,
    FOLD,
    DeltaVersions,
    base_of_manifests,
    chain_to,
    check_accepts_deltas,
    companion,
    fold_companion,
    run_delta_update,
)
from ckpt_core.errors import CheckpointNotFoundError, CkptError, ConfigError, DeltaBaseError
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
        self.sliced = SlicedDeltas(ctx, catalog, versions)

    # -- registration ------------------------------------------------------------
    def add(self, name: str, ckpt: RegisteredCheckpoint, base: str | None, snapshot: bool = False) -> None:
        """Install registered checkpoint ``name`` in the catalog, served to P2P readers (``serve_p2p`` only);
        with ``base``, first its delta against ``base`` (this rank's share) as the companion checkpoint
        ``name@delta``, served alike. A delta that cannot be encoded releases ``ckpt`` and installs nothing.
        ``snapshot`` (a device-resident version): record what it holds now, checked when it becomes a base."""
        comp = None
        try:
            if snapshot:
                self.versions.snapshot(name, ckpt)
            if base is not None and ckpt.on_device:   # a trainer's versions on its device: encoded there, kept there
                device = self.ctx.backend.device(self.ctx.device_index)
                payloads = self.versions.encode(name, ckpt, base, self.catalog.checkpoints.get(base), device)
                if payloads is not None:
                    comp = build_device_checkpoint(companion(name), self.ctx.backend, self.ctx.device_index, payloads)
            elif base is not None:   # the payloads written straight into the companion's region
                packed = PackedRegion(self.ctx.backend)
                try:
                    payloads = self.versions.encode(name, ckpt, base, self.catalog.checkpoints.get(base),
                                                    alloc=packed.alloc)
                    if payloads is not None:   # None: pieced unlike its base here (delta/pieces.py), no delta
                        comp = build_packed(companion(name), self.ctx.backend, payloads, into=packed)
                finally:
                    packed.release()   # unless the companion took it
        except BaseException:
            self.versions.drop_snapshot(name)
            self.versions.forget(name)   # encoded, then its companion failed: no base recorded for it
            ckpt.release()
            raise
        if comp is not None:
            self.catalog.checkpoints[companion(name)] = comp
            self.p2p.on_register(companion(name), comp)
        self.catalog.checkpoints[name] = ckpt
        self.p2p.on_register(name, ckpt)

    def remove(self, name: str) -> RegisteredCheckpoint:
        """Uninstall and release checkpoint ``name`` (and its delta and folds, if any): its P2P service first (a
        reader's next stamp check fails), then its memory, metas and plans. Returns it (released)."""
        ckpt = self.catalog.checkpoints.pop(name)
        self.sliced.forget(name)   # its sliced deltas go with it
        self.versions.drop_snapshot(name)
        comps = [companion(name)] + [fold_companion(name, b) for b in self.versions.folds.get(name, {})]
        if name in self.versions.bases or name in self.versions.folds or name in self.versions.refused:
            self.versions.forget(name)
        for comp in comps:   # its deltas go with it
            if comp in self.catalog.checkpoints:
                self.remove(comp)
        for version, folds in self.versions.folds.items():   # a fold unregistered on its own
            for base in [b for b in folds if fold_companion(version, b) == name]:
                del folds[base]
        self.p2p.on_unregister(name)
        ckpt.release()
        self.catalog.metas.pop(name, None)
        self.catalog.plans.forget(name)
        return ckpt

    def fold(self, name: str, base: str) -> dict:
        """``ParameterServer.fold_delta``: register this rank's fold of ``name``'s deltas from ``base`` as the
        companion ``name@delta:base`` (``fold.py``), served to P2P readers like any checkpoint. Nothing to do
        when ``name`` was registered with that base or the fold exists. Returns its figures."""
        ckpt = self.catalog.checkpoints.get(name)
        if ckpt is None:
            raise CheckpointNotFoundError(f"checkpoint {name!r} is not registered on rank {self.ctx.rank}")
        if not isinstance(base, str) or not base or base == name:
            raise ConfigError(f"fold_delta({name!r}): base must be another version's name, got {base!r}")
        if self.versions.bases.get(name) == base or base in self.versions.folds.get(name, {}):
            return self.versions.figures_of(name, base)   # a delta from base is registered already
        refuse_device_resident(ckpt, name, "a fold of its deltas", self.ctx.rank)
        base_ckpt = self.catalog.checkpoints.get(base)
        refuse_device_resident(base_ckpt, base, f"a fold of {name!r} from it", self.ctx.rank)
        steps: list = []
        if base_ckpt is None:
            chain = chain_to(self.versions.bases, name)
            if base not in chain[:-1]:
                raise DeltaBaseError(f"cannot fold the deltas of {name!r} from {base!r} on rank {self.ctx.rank}: "
                                     f"{base!r} is not registered here and the registered deltas run "
                                     f"{' -> '.join(chain)}; update {name!r} whole")
            later = chain[chain.index(base) + 1:]
            gone = [v for v in later if companion(v) not in self.catalog.checkpoints]
            if gone:
                raise DeltaBaseError(f"cannot fold the deltas of {name!r} from {base!r} on rank {self.ctx.rank}: the "
                                     f"delta of {gone[0]!r} is not registered here any more")
            steps = [(v, self.catalog.checkpoints[companion(v)]) for v in later]
        comp = fold_companion(name, base)
        try:
            payloads = self.versions.fold(name, ckpt, base, base_ckpt, steps)
            comp_ckpt = build_packed(comp, self.ctx.backend, payloads)
        except BaseException:
            self.versions.folds.get(name, {}).pop(base, None)
            raise
        self.catalog.checkpoints[comp] = comp_ckpt
        self.p2p.on_register(comp, comp_ckpt)
        return self.versions.figures_of(name, base)

    def gather(self, name: str) -> None:
        """Collective (``gather_metas``): ``name``'s metas and owners' stores, and those of its delta and
        folds that every rank registered (so that ``get_metas``/``save_metas`` carry them for joining worlds)."""
        self.gather_one(name)
        comps = [companion(name)] + [fold_companion(name, b) for b in sorted(self.versions.folds.get(name, {}))]
        mine = [c for c in comps if c in self.catalog.checkpoints]
        everyone = self.ctx.coll.all_gather_json(mine)
        for comp in [c for c in everyone[0] if all(c in other for other in everyone)]:   # alike on every rank
            self.gather_one(comp)

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
        if ranks and (slices is not None or self.ctx.wire != "native"):
            raise ConfigError("P2P delta updates take neither slices= nor the stock wire yet (docs/deltas.md): a "
                              "broadcast delta with slices=, or a P2P delta of whole tensors on our wire")
        if slices is not None and self.ctx.wire != "native":
            raise ConfigError("sliced delta updates are updates on our wire only (docs/deltas.md)")
        if delta not in DELTA_MODES:   # refused in the agreement: every rank raises, none waits in it
            agree_delta(self, name, ranks, delta)
        if ranks:
            return self._p2p_delta(name, req_func, ranks, timeout, delta)
        if slices is not None:
            return self._sliced_delta(name, req_func, timeout, slices, delta)
        return run_delta_update(
            self.versions, name, req_func, delta, prepare=lambda: agree_delta(self, name, None, delta, req_func),
            update=lambda n, rf: run_broadcast_update(self.ctx, self.catalog, n, rf, timeout, None),
            bases=self.known_bases)

    def _sliced_delta(self, name: str, req_func: ReqFunc, timeout, slices, mode) -> dict:
        """A broadcast delta routed by slice plan ``slices``: each engine rank receives the changed elements
        of its own boxes (``sliced.py``); a refused one with ``"fallback"`` is a sliced full update."""
        routes: list = []

        def prepare() -> tuple[str, str]:
            base, comp = agree_delta(self, name, None, mode, req_func)   # which delta (or fold), agreed
            routes.append(self.sliced.prepare(name, comp, slices))
            return base, sliced_name(comp, slices)

        def update(checkpoint: str, rf) -> dict:
            if checkpoint == name:   # the fallback: the version itself, by the engine's plan
                return run_broadcast_update(self.ctx, self.catalog, checkpoint, rf, timeout, slices)
            result = run_broadcast_update(self.ctx, self.catalog, checkpoint, rf, timeout, routes[-1])
            full = [slices.rank_bytes(t) for t in range(len(slices.ranks))]
            result["delta"] = {"sliced": dict(self.sliced.figures.get(checkpoint, {}), plan=slices.digest,
                                              full_rank_bytes=full)}
            return result
        return run_delta_update(self.versions, name, req_func, mode, prepare=prepare, update=update,
                                bases=self.known_bases)

    def _full(self, name: str, req_func: ReqFunc, ranks, timeout, slices) -> dict:
        mine = self._reaches_me(ranks)
        held = self.versions.engines_hold
        if mine:
            self.versions.made_live(None)   # until it succeeds, the engines hold a mix
        self.ctx.past_handshake = False
        try:
            if ranks:   # P2P into those ranks, from the owners' host memory (p2p/update.py)
                result = run_p2p_update(self.ctx, self.p2p, name, req_func, ranks, timeout, slices)
            else:
                result = run_broadcast_update(self.ctx, self.catalog, name, req_func, timeout, slices)
        except CkptError as exc:
            # Failed before every rank passed the handshake agreement (the precheck's, the plan's and the
            # handshake's agreements raise on every rank alike; a worker loads only what a bucket notice
            # names): nothing was sent to any engine worker, and the delta base stands. Not where a
            # collective broke (a peer may have passed the agreement this rank failed in).
            if not self.ctx.past_handshake and not getattr(exc, "groups_broken", False):
                if mine:
                    self.versions.made_live(held)
                _retell(exc, untouched_tail(held))
            elif mine:
                _retell(exc, BEGUN_TAIL)
            raise
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

    def _p2p_delta(self, name: str, req_func: ReqFunc, ranks, timeout, mode) -> dict:
        def update(checkpoint: str, rf) -> dict:
            result = run_p2p_update(self.ctx, self.p2p, checkpoint, rf, ranks, timeout, None)
            if checkpoint != name:   # a delta: what the readers moved against what the version weighs
                result["delta"] = {"delta_bytes": self._bytes(checkpoint) or 0, "version_bytes": self._bytes(name)}
            return result
        return run_delta_update(self.versions, name, req_func, mode,
                                prepare=lambda: agree_delta(self, name, ranks, mode), update=update,
                                bases=self.known_bases, affects_engine=self._reaches_me(ranks))

    def _bytes(self, checkpoint: str) -> int | None:
        """Bytes of ``checkpoint``, every owner's (None: this rank knows no metas of it)."""
        loaded = self.p2p.loaded.get(checkpoint)
        metas = loaded.metas if loaded is not None else self.catalog.metas.get(checkpoint)
        return None if metas is None else sum(m.nbytes for ms in metas for m in ms)


BEGUN_TAIL = ("; the transfer had begun: the engines may hold a mix of both versions until a full update succeeds "
              "(an engine's own report says whether it wrote: VllmClient.live_version(), SGLang's weight_versions())")


def untouched_tail(held: str | None) -> str:
    """The tail of a failed full update's error when no bucket was sent to any engine worker."""
    head = "; nothing was sent to any engine worker (the update failed in its plan or handshake, on every rank)"
    if held:
        return f"{head}: the engines still hold version {held!r}, and a delta of it can follow"
    return f"{head}: the engines still hold the weights they held"


def _retell(exc: CkptError, tail: str) -> None:
    """Append ``tail`` to the message of ``exc`` (once), before a remote traceback it carries."""
    text = str(exc)
    if tail in text:
        return
    head, sep, trace = text.partition("\n--- remote traceback ---")
    exc.args = (f"{head}{tail}{sep}{trace}",)


def _delta_view(u: Updates, name, ranks, mode, req_func=None) -> dict:
    """This rank's side of a delta's agreement (``choose.py``); ``req_func``: a broadcast's, which on the
    stock wire must be marked as taking deltas (``versions.accepts_deltas``)."""
    out = view(name if isinstance(name, str) else repr(name), {}, None, None, False)
    try:
        if not isinstance(name, str):
            raise ConfigError(f"checkpoint name must be a string, got {name!r}")
        if mode not in DELTA_MODES:
            raise ConfigError(f"delta must be False, True or 'fallback', got {mode!r}")
        if req_func is not None:
            check_accepts_deltas(req_func, u.ctx.wire)
        if name in u.versions.refused:   # pieced unlike its base on this rank: registered without a delta
            raise DeltaBaseError(u.versions.refused[name])
        version = u.catalog.checkpoints.get(name)
        if u.ctx.wire != "native" and version is not None and any(m.box is not None for m in version.metas):
            raise ConfigError(f"a delta of {name!r}, registered in pieces, moves on our wire only (its piece "
                              "payloads are ours, docs/deltas.md): update it whole over the stock wire")
        target = not ranks or u.ctx.rank in targets_of(ranks, u.ctx.world_size)
        registered = {b: fold_companion(name, b) for b in u.versions.folds.get(name, {})
                      if fold_companion(name, b) in u.catalog.checkpoints}
        if companion(name) in u.catalog.checkpoints and name in u.versions.bases:
            registered[u.versions.bases[name]] = companion(name)
        loaded = {} if not ranks else {c: [m.name for ms in src.metas for m in ms] for c, src in u.p2p.loaded.items()
                                       if c == companion(name) or c.startswith(name + FOLD)}
        cands = candidates(name, registered, loaded)
        default = next((b for b, c in cands.items() if c[0] == companion(name)), None)
        out = view(name, cands, default, u.versions.engines_hold if target else None, target)
    except Exception as exc:   # ours or not: told to every rank, nobody is left waiting in a collective
        out["problem"] = problem_of(exc)
    return out


def agree_delta(u: Updates, name: str, ranks, mode=True, req_func=None) -> tuple[str, str]:
    """Collective over the world, before a delta moves anything (broadcast: ``ranks`` empty; P2P: the
    targets): ``(base, companion)`` of the delta whose base the targets' engines hold (``choose.py``),
    agreed; the companion's metas gathered in this world when every rank registered it. Raises the same
    error on every rank (``DeltaBaseError`` for a missing or mismatched delta or base)."""
    p2p = bool(ranks)
    views = u.ctx.coll.all_gather_json(_delta_view(u, name, ranks, mode, req_func))
    what = f"P2P delta update({name!r})" if p2p else f"delta update({name!r})"
    raise_agreed([v.get("problem") for v in views], what)
    same_call(views, "P2P delta update" if p2p else "delta update", {"delta": "version"})
    base, comp = choose(views, name, p2p=p2p, known=u.known_bases())
    if all(v["candidates"][base][1] for v in views):   # every rank registered it: this world's ranks serve it
        if p2p:
            u.gather_one(comp)
        else:
            gather_metas(u.ctx, u.catalog, comp)
        if base_of_manifests([m.name for ms in u.catalog.metas[comp] for m in ms], name) != base:   # all alike
            raise DeltaBaseError(f"{what} refused: the manifests of {comp!r} name another base than {base!r}")
    return base, comp


__all__ = ["Updates", "agree_delta"]
