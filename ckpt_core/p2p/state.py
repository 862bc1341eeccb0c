"""A ParameterServer's P2P side (:class:`P2PState`): its Mooncake store, what it serves, the owners'
stores it learned (gathered in this world or loaded from a metas document), the target groups.

Built by the facade with the rank's update context and catalog (``transfer/context.py``); the P2P
update (``p2p/update.py``) and its first exchange (``p2p/agree.py``) receive it.
"""

from __future__ import annotations

import os
from dataclasses import replace

from ckpt_core._settings import p2p_env
from ckpt_core.checkpoint.device import refuse_device_resident
from ckpt_core.errors import CkptError, ConfigError, TransportError
from ckpt_core.p2p import metas as _metas
from ckpt_core.p2p.digests import tensor_digests
from ckpt_core.p2p.metas import Peer, Source
from ckpt_core.p2p.slices import box_digests, check_plan
from ckpt_core.p2p.store import P2PStore, open_store
from ckpt_core.planning.nics import is_loopback, loopback_owners
from ckpt_core.transfer.context import Catalog, UpdateContext
from ckpt_core.transfer.prechecks import problem_of, raise_agreed, same_call

SETTLE_AT_CLOSE_S = 10.0


def check_reachable(doc: dict) -> None:
    """``save_metas``' check: no owner in ``doc`` publishes a loopback address, unless this rank's
    PS_P2P_HOST was set to one on purpose (every world on one host). ``ConfigError`` otherwise."""
    bad = loopback_owners(doc)
    if bad and not is_loopback(p2p_env()["host"]):
        shown = ", ".join(f"{n!r} owner rank {r} at {a}" for n, r, a in bad[:4])
        raise ConfigError(f"saving metas refused: {shown} publish a loopback address, which a joiner on "
                          "another host would read from its own loopback; set PS_P2P_HOST to an address other "
                          "hosts reach (or to a loopback address on purpose when every world runs on this host)")


class P2PState:
    """A ParameterServer's P2P side: its store, the owners' stores it learned, target groups.

    Given the rank's update context (settings, collectives, log) and the catalog it serves and
    reads metas from (the facade's: checkpoints, metas, plans)."""

    def __init__(self, ctx: UpdateContext, catalog: Catalog):
        self.ctx, self.catalog = ctx, catalog
        self.store: P2PStore | None = None
        self.store_error: str | None = None
        self.served: dict[str, dict[int, tuple[int, int]]] = {}   # checkpoint -> regions this rank serves
        self.stamps: dict[str, tuple[int, tuple[int, str]]] = {}  # checkpoint -> (slot, stamp)
        self.digests: dict[str, dict[str, str]] = {}               # checkpoint -> tensor digests it serves
        self.gathered: dict[str, list[Peer | None]] = {}         # checkpoint -> every owner's store
        self.loaded: dict[str, Source] = {}                       # checkpoint -> from load_metas
        self.groups: dict[tuple[int, ...], object] = {}
        self.box_digests: dict[tuple[str, str], dict] = {}        # (checkpoint, slice plan digest) -> its box digests
        self.sliced_plans: dict[tuple, tuple] = {}                 # p2p/slices.py routing, by what it depends on

    # -- the store -------------------------------------------------------------
    def ensure_store(self, *, required: bool) -> P2PStore | None:
        """The store, created on first use. Without Mooncake: None, or ConfigError if ``required``."""
        if self.store is None and self.store_error is None:
            ctx = self.ctx
            try:   # serving (registering checkpoints) only when asked for: docs/p2p.md, p2p/store.py
                self.store = open_store(ctx.settings, ctx.backend, ctx.device_index, ctx.log,
                                        serving=ctx.settings.serve_p2p)
            except CkptError as exc:
                self.store_error = str(exc)
        if self.store is None and required:
            raise ConfigError(self.store_error or "no P2P store")
        return self.store

    def on_register(self, name: str, ckpt) -> None:
        """Serve a newly registered checkpoint's host regions (only with serve_p2p: its store exists)."""
        store = self.store if self.ctx.settings.serve_p2p else None
        if store is None:
            return
        if ckpt.on_device:   # Mooncake reads host memory: a P2P update of it is refused (p2p/agree.py)
            self.ctx.log.info("checkpoint %r is registered on the device: not served to P2P readers", name)
            return
        regions = {rid: (r.tensor.data_ptr(), r.nbytes) for rid, r in ckpt.regions.items() if r.nbytes > 0}
        try:
            for ptr, n in regions.values():
                store.register(ptr, n)
            self.stamps[name] = store.stamp()
            self.digests[name] = tensor_digests(ckpt)
        except TransportError as exc:   # broadcast updates still work; a P2P update will name this rank
            self.ctx.log.warning("checkpoint %r is not served to P2P readers: %s", name, exc)
            for ptr, _ in regions.values():
                store.unregister(ptr)
            return
        self.served[name] = regions

    def on_unregister(self, name: str) -> None:
        if name in self.stamps and self.store is not None:   # first: a reader's next check fails
            self.store.clear_stamp(self.stamps.pop(name)[0])
        self.digests.pop(name, None)
        for key in [k for k in self.box_digests if k[0] == name]:
            del self.box_digests[key]
        for ptr, _ in self.served.pop(name, {}).values():
            if self.store is not None:
                self.store.unregister(ptr)
        self.gathered.pop(name, None)

    def describe(self, name: str) -> dict | None:
        if self.store is None or name not in self.served:
            return None
        return self.store.describe(self.served[name], self.stamps[name][1], self.digests.get(name)).to_json()

    def gather(self, name: str) -> None:
        """Collective (after gather_metas): every rank learns every owner's store for ``name``."""
        docs = self.ctx.coll.all_gather_json(self.describe(name))
        self.gathered[name] = [None if d is None else _metas.parse_peer(d, f"rank {r}") for r, d in enumerate(docs)]

    def publish_slices(self, plans) -> None:
        """Collective of the owners' world (``get_metas(slices=...)``): every owner digests the boxes
        each plan reads of its tensors (``slices.box_digests``: after checking them against their
        registration digests again; cached per checkpoint and plan), for every checkpoint gathered
        here that the plan fits, and every rank records every owner's box digests in its gathered
        stores, so the metas document it writes from now on carries them (until gather_metas or
        unregister). A problem on any rank (a plan that fits none of them, rewritten bytes) is
        raised on every rank alike and records nothing."""
        catalog = self.catalog
        plans = list(plans) if isinstance(plans, (list, tuple)) else [plans]
        names = sorted(n for n in self.gathered if n in catalog.metas)
        mine: dict[str, dict[str, dict]] = {}   # checkpoint -> plan digest -> this owner's box digests
        fits: dict[str, list[str]] = {}         # plan digest -> the checkpoints it fits
        problem = None
        try:
            if not plans:
                raise ConfigError("get_metas(slices=...) needs a SlicePlan or a list of them")
            for plan in plans:
                why = {}
                for name in names:
                    try:
                        check_plan(plan, catalog.metas[name])
                    except ConfigError as exc:
                        why[name] = str(exc)
                        continue
                    fits.setdefault(plan.digest, []).append(name)
                    if name not in catalog.checkpoints or not catalog.metas[name][self.ctx.rank]:
                        continue   # this rank owns nothing of it
                    refuse_device_resident(catalog.checkpoints[name], name, "publishing slices to P2P readers",
                                           self.ctx.rank)
                    mine.setdefault(name, {})[plan.digest] = self.boxes_of(name, plan)
                if plan.digest not in fits:
                    raise ConfigError(f"the slice plan {plan.digest[:12]} fits none of the gathered checkpoints "
                                      f"{names}: " + "; ".join(f"{n!r}: {w}" for n, w in why.items()))
        except Exception as exc:   # ours or not: every rank learns it, nobody waits in the exchange
            problem = problem_of(exc)
        views = self.ctx.coll.all_gather_json({"problem": problem, "boxes": mine, "names": names,
                                          "plans": [getattr(p, "digest", repr(p)) for p in plans]})
        raise_agreed([v["problem"] for v in views], "get_metas(slices=...)")
        same_call(views, "get_metas(slices=...)", {"names": "gathered checkpoints", "plans": "slice plans"})
        for name in names:   # an owner with box digests serves a store (box_digests refuses one without digests)
            self.gathered[name] = [p if p is None or not v["boxes"].get(name) else
                                   replace(p, slices={**(p.slices or {}), **v["boxes"][name]})
                                   for p, v in zip(self.gathered[name], views)]

    def boxes_of(self, name: str, plan) -> dict:
        """This owner's digests of the boxes ``plan`` reads of its tensors of ``name``
        (``slices.box_digests``: after checking them against their registration digests); computed
        once per (checkpoint, plan), dropped on unregister."""
        key = (name, plan.digest)
        if key not in self.box_digests:
            self.box_digests[key] = box_digests(self.catalog.checkpoints[name], self.digests.get(name), plan,
                                                self.ctx.rank)
        return self.box_digests[key]

    def metas_document(self) -> dict:
        metas = {n: s.metas for n, s in self.loaded.items()} | dict(self.catalog.metas)
        peers = {n: s.peers for n, s in self.loaded.items()} | self.gathered
        return _metas.dump(metas, peers)

    def parse(self, doc) -> tuple[dict[str, Source], dict]:
        """``load_metas``'s first step, installing nothing: a path or a versioned document is read
        and validated whole. Returns (the checkpoints for P2P updates, the per-rank dicts of those
        whose owner count is this world's size, for broadcast updates); an unversioned dict
        passes through as the second (``parse_metas`` validates it)."""
        if isinstance(doc, (str, os.PathLike)):
            doc = _metas.read(doc)
        if not _metas.is_versioned(doc):
            return {}, doc
        parsed = _metas.parse(doc)
        return parsed, _metas.to_legacy({n: s for n, s in parsed.items() if len(s.metas) == self.ctx.world_size})

    def close(self) -> None:
        self.groups.clear()   # the Collectives destroy them; a closed PS must not keep them alive
        if self.store is not None:
            self.store.close(SETTLE_AT_CLOSE_S)
            self.store = None   # its TransferEngine goes with it: no port of this PS stays open

    # -- update ----------------------------------------------------------------
    def source(self, name: str) -> Source:
        if name in self.loaded:
            return self.loaded[name]
        if name in self.catalog.metas and name in self.gathered:
            return Source(self.catalog.metas[name], self.gathered[name])
        raise ConfigError(f"P2P update of {name!r}: call gather_metas({name!r}) on the owners' world, or "
                          "load_metas(...) with their metas, on every rank first")

    def group(self, targets: tuple[int, ...]):
        """The target ranks' data group; created once (a collective of the whole world)."""
        if targets not in self.groups:   # owned by the Collectives: close()/abort() free it with the others
            self.groups[targets] = self.ctx.coll.new_group(list(targets))
        return self.groups[targets]
