"""P2P updates (``update(name, req_func, ranks=[...])``): target ranks pull from the owners' host memory.

Called on every rank of the world (it creates the target group, a collective). Then:

* the target ranks map their engines' IPC buffer as in a broadcast update; each bucket
  of the plan is assigned to one target (``_nics.assign_readers``), which reads the
  bucket's runs straight from the owner's registered host memory into its slot
  (Mooncake, ``_p2p_store``) and broadcasts it inside the target group: the same
  pipeline, wire protocol and worker loop as a broadcast update;
* ranks outside ``ranks`` touch neither their device nor their engine: they only take
  part in the status agreements, so that every rank ends the update with one verdict.

The first exchange (``p2p/agree.py``) agrees every rank's pre-checks and the update's
identity; the pipeline (``p2p/pipeline.py``) carries one status byte per bucket, so a
target never hands its worker a bucket whose read failed. A failed or abandoned read
leaves its staging buffer unsettled (``Quarantine``); it is not reused or freed until
settled. The owners may live in another world: their metas (``_metas``) say where.
With a slice plan (``p2p/slices.py``) target i (the i-th of ``ranks``) is engine rank i: buckets
of its slices are read by it alone and checked against its owners' box digests.
close() in another thread stops the update on every rank, as on the broadcast path.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import replace

from ckpt_core.wire.stock import open_link, wire_handles
from ckpt_core.wire.link import Failure
from ckpt_core.p2p import metas as _metas
from ckpt_core.p2p.agree import first_exchange
from ckpt_core.p2p.metas import Peer, Source
from ckpt_core.p2p.pipeline import GroupColl, NoLink, NoReq, P2PBucket, P2PPipeline, P2PSliceBucket
from ckpt_core.p2p.slices import LANDING_BYTES, box_digests, bucket_runs, check_plan, per_target, route, slice_reads
from ckpt_core.planning.slice_routes import SlicedBucket, rank_placements
from ckpt_core.wire.protocol import plan_fragment
from ckpt_core.planning.nics import assign_readers
from ckpt_core.p2p.store import MARK, P2PStore, open_store
from ckpt_core.p2p.digests import tensor_digests
from ckpt_core.planning.buckets import ALIGN, Plan, align_up
from ckpt_core.wire.protocol import encode_hello
from ckpt_core.transfer.prechecks import problem_of, raise_agreed, same_call
from ckpt_core.transfer.signals import ReqThread, StopSignal
from ckpt_core.errors import CkptError, ConfigError, RemoteWorkerError, TransportError

READ_MARGIN_S = 3.0    # a read must give up this long before the update's deadline, so the ranks can still agree
SETTLE_AT_CLOSE_S = 10.0


class P2PState:
    """A ParameterServer's P2P side: its store, the owners' stores it learned, target groups."""

    def __init__(self, ps):
        self.ps = ps
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
            ps = self.ps
            try:   # serving (registering checkpoints) only when asked for: docs/p2p.md, p2p/store.py
                self.store = open_store(ps, serving=ps.settings.serve_p2p)
            except CkptError as exc:
                self.store_error = str(exc)
        if self.store is None and required:
            raise ConfigError(self.store_error or "no P2P store")
        return self.store

    def on_register(self, name: str, ckpt) -> None:
        """Serve a newly registered checkpoint's host regions (only with serve_p2p: its store exists)."""
        store = self.store if self.ps.settings.serve_p2p else None
        if store is None:
            return
        regions = {rid: (r.tensor.data_ptr(), r.nbytes) for rid, r in ckpt.regions.items() if r.nbytes > 0}
        try:
            for ptr, n in regions.values():
                store.register(ptr, n)
            self.stamps[name] = store.stamp()
            self.digests[name] = tensor_digests(ckpt)
        except TransportError as exc:   # broadcast updates still work; a P2P update will name this rank
            self.ps._log.warning("checkpoint %r is not served to P2P readers: %s", name, exc)
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
        docs = self.ps._coll.all_gather_json(self.describe(name))
        self.gathered[name] = [None if d is None else _metas.parse_peer(d, f"rank {r}") for r, d in enumerate(docs)]

    def publish_slices(self, plans) -> None:
        """Collective of the owners' world (``get_metas(slices=...)``): every owner digests the boxes
        each plan reads of its tensors (``slices.box_digests``: after checking them against their
        registration digests again; cached per checkpoint and plan), for every checkpoint gathered
        here that the plan fits, and every rank records every owner's box digests in its gathered
        stores, so the metas document it writes from now on carries them (until gather_metas or
        unregister). A problem on any rank (a plan that fits none of them, rewritten bytes) is
        raised on every rank alike and records nothing."""
        ps = self.ps
        plans = list(plans) if isinstance(plans, (list, tuple)) else [plans]
        names = sorted(n for n in self.gathered if n in ps._metas)
        mine, problem, fits = {}, None, {}
        try:
            if not plans:
                raise ConfigError("get_metas(slices=...) needs a SlicePlan or a list of them")
            for plan in plans:
                why = {}
                for name in names:
                    try:
                        check_plan(plan, ps._metas[name])
                    except ConfigError as exc:
                        why[name] = str(exc)
                        continue
                    fits.setdefault(plan.digest, []).append(name)
                    if name not in ps._checkpoints or not ps._metas[name][ps.rank]:
                        continue   # this rank owns nothing of it
                    mine.setdefault(name, {})[plan.digest] = self.boxes_of(name, plan)
                if plan.digest not in fits:
                    raise ConfigError(f"the slice plan {plan.digest[:12]} fits none of the gathered checkpoints "
                                      f"{names}: " + "; ".join(f"{n!r}: {w}" for n, w in why.items()))
        except Exception as exc:   # ours or not: every rank learns it, nobody waits in the exchange
            problem = problem_of(exc)
        views = ps._coll.all_gather_json({"problem": problem, "boxes": mine, "names": names,
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
            self.box_digests[key] = box_digests(self.ps._checkpoints[name], self.digests.get(name), plan, self.ps.rank)
        return self.box_digests[key]

    def metas_document(self) -> dict:
        metas = {n: s.metas for n, s in self.loaded.items()} | dict(self.ps._metas)
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
        return parsed, _metas.to_legacy({n: s for n, s in parsed.items() if len(s.metas) == self.ps.world_size})

    def close(self) -> None:
        self.groups.clear()   # the Collectives destroy them; a closed PS must not keep them alive
        if self.store is not None:
            self.store.close(SETTLE_AT_CLOSE_S)
            self.store = None   # its TransferEngine goes with it: no port of this PS stays open

    # -- update ----------------------------------------------------------------
    def source(self, name: str) -> Source:
        if name in self.loaded:
            return self.loaded[name]
        if name in self.ps._metas and name in self.gathered:
            return Source(self.ps._metas[name], self.gathered[name])
        raise ConfigError(f"P2P update of {name!r}: call gather_metas({name!r}) on the owners' world, or "
                          "load_metas(...) with their metas, on every rank first")

    def group(self, targets: tuple[int, ...]):
        """The target ranks' data group; created once (a collective of the whole world)."""
        if targets not in self.groups:   # owned by the Collectives: close()/abort() free it with the others
            self.groups[targets] = self.ps._coll.new_group(list(targets))
        return self.groups[targets]


def run_update(ps, name: str, req_func, ranks, timeout, slices=None) -> dict:
    """Collective over the whole world; see the module docstring. Returns this rank's figures.
    ``slices``: a slice plan whose engine rank i is the i-th of ``ranks`` (``p2p/slices.py``)."""
    t0 = time.perf_counter()
    state: P2PState = ps._p2p
    deadline, targets, src, tv, sliced = first_exchange(ps, name, req_func, ranks, timeout, slices)
    me = ps.rank in targets
    group = state.group(targets)
    update_id = f"{ps._run_id}-{ps._updates}"
    ps._updates += 1
    if not me:
        _stand_by(ps, update_id, deadline)
        return {"name": name, "p2p": True, "target": False, "seconds": {"total": time.perf_counter() - t0}}
    try:
        size = min(v["layout"][0] for v in tv)
        figures, boxes = None, None
        if sliced is None:
            plan, wire = ps._plans.get(src.metas, tv[0]["fp"], size)
            readers = assign_readers([(b.owner, b.nbytes) for b in plan.buckets], list(targets))
            p2p_plan = Plan(plan.bucket_bytes, tuple(_p2p_bucket(b, i, rd) for i, (b, rd) in
                                                     enumerate(zip(plan.buckets, readers))))
        else:
            order, boxes = sliced
            p2p_plan, wire, figures = _sliced_plan(state, src, slices, size, tv[0]["fp"], order, ps.rank)
        slots = max(1, min(min(v["layout"][1] for v in tv), len(p2p_plan.buckets)))
    except Exception as exc:   # ours or not: every rank learns it at the next agreement
        _fail_through(ps, exc, deadline)
    result = _run_target(ps, name, req_func, deadline, targets, group, src, p2p_plan, wire, slots, update_id, t0,
                         boxes)
    if figures is not None:
        result["slices"] = figures
    return result


def _sliced_plan(state: P2PState, src, slices, size: int, fp: str, order: list[int], rank: int):
    """(P2P plan, this target's wire form, the figures of every target) of a sliced update; cached."""
    key = (fp, size, slices.digest, tuple(order), rank)
    if key not in state.sliced_plans:
        routed, owners = route(src.metas, slices, size)
        whole = [i for i, b in enumerate(routed.buckets) if not isinstance(b, SlicedBucket)]
        readers = [order[b.dest] if isinstance(b, SlicedBucket) else -1 for b in routed.buckets]
        for i, rd in zip(whole, assign_readers([(owners[i], routed.buckets[i].nbytes) for i in whole], sorted(order))):
            readers[i] = rd
        landing = min(LANDING_BYTES, size)   # a slot grows by at most the bucket size
        buckets = tuple(_p2p_sliced_bucket(b, i, rd, owners[i], landing) for i, (b, rd) in
                        enumerate(zip(routed.buckets, readers)))
        received, read = per_target(buckets, order)
        figures = {"plan": slices.digest, "targets": list(order), "received_bytes": received, "read_bytes": read,
                   "whole_bytes": slices.whole_bytes()}
        wire = plan_fragment(rank_placements(routed, order.index(rank)))
        while len(state.sliced_plans) >= 4:
            state.sliced_plans.pop(next(iter(state.sliced_plans)))
        state.sliced_plans[key] = (Plan(routed.bucket_bytes, buckets), wire, figures)
    plan, wire, figures = state.sliced_plans[key]
    return plan, wire, dict(figures)


def _p2p_sliced_bucket(b, index: int, reader: int, owner: int, landing: int) -> P2PBucket:
    """A routed bucket of a sliced update as its reader moves it (``b.owner`` is 0 there, see
    ``p2p/slices.route``; ``owner`` is whose it is): a bucket of slices stays with its reader."""
    if isinstance(b, SlicedBucket):   # its slot: the slices, a landing zone for spans read with holes, the status byte
        reads = slice_reads(b, landing=landing)
        land_at = align_up(b.nbytes) if reads.landing else b.nbytes
        return P2PSliceBucket(owner=reader, placements=b.placements, nbytes=land_at + reads.landing + 1, source=owner,
                              index=index, parts=((owner, bucket_runs(b)),), dest=b.dest, boxes=b.boxes, reads=reads,
                              land_at=land_at)
    return P2PBucket(owner=reader, placements=b.placements, nbytes=b.nbytes + 1, source=owner, index=index,
                     parts=((owner, b.copy_runs),))


def _p2p_bucket(b, index: int, reader: int) -> P2PBucket:
    """A planned bucket as its reader moves it: the reader reads every part from the owner that holds
    it (one owner, or each piece's own), broadcasts the whole slot; every target places strided pieces."""
    parts = tuple((s.rank, s.runs) for s in b.segments)
    return P2PBucket(owner=reader, placements=b.placements, nbytes=b.nbytes + 1, scatters=b.scatters, spans=b.spans,
                     source=b.owner, index=index, parts=parts)


def _stand_by(ps, update_id: str, deadline: float) -> None:
    """A rank outside ``ranks`` only takes part in the status agreements. It still has the
    update's stop signal, so that close() here stops the targets at once (``ps._stop_signal``)."""
    link = NoLink()
    signal = StopSignal(ps._coll.store, f"ckpt/{update_id}/abort", ps.rank, None, ps._log)
    ps._stop_signal = signal
    try:
        for phase, final in (("handshake", False), ("transfer", False), ("post-hook", True)):
            if ps._closing is not None and link.failure is None:
                link.failure = Failure(ps.rank, ps.device_uuid, ps._closing)
            _agree(ps, link, NoReq(), deadline, phase, final)
    finally:
        ps._stop_signal = None
        signal.close()


def _fail_through(ps, exc: Exception, deadline: float):
    """A target failed before its first status exchange: tell every rank there (so nobody waits
    for it until the collective timeout), then raise the error here: its own if it is one of
    ours (it says more), else the agreed one, as on the other ranks."""
    link = NoLink()
    tb = "" if isinstance(exc, CkptError) else traceback.format_exc()
    link.failure = Failure(ps.rank, ps.device_uuid, f"{type(exc).__name__}: {exc}", tb)
    try:
        _agree(ps, link, NoReq(), deadline, "handshake", False)
    except CkptError as agreed:
        if not isinstance(exc, CkptError):
            raise agreed from exc
    raise exc


def _run_target(ps, name, req_func, deadline, targets, group, src, plan, wire, slots, update_id, t0,
                box_digests=None) -> dict:
    store = ps._p2p.store
    slot_bytes = align_up(max(plan.largest_bucket, ALIGN))
    try:
        ipc = ps._ensure_ipc(slot_bytes * slots)
        store.register(ipc.tensor.data_ptr(), ipc.nbytes)
    except Exception as exc:   # e.g. no device memory, or Mooncake refusing the registration
        _fail_through(ps, exc, deadline)
    # Every rank's handle, in rank order (the broadcast contract, so req_funcs that pick their group's
    # handles by position work unchanged); only the targets' sockets exist and only targets run req_func.
    # The engines' wire is the broadcast update's (ps.wire: native, or the stock worker's for SGLang).
    handles = wire_handles(ps.wire, update_id, ps._device_keys)
    req = ReqThread(req_func, handles)
    signal = StopSignal(ps._coll.store, f"ckpt/{update_id}/abort", ps.rank, req, ps._log)
    # close() in another thread stops this rank's waits (its worker's and its reads) as on the broadcast path
    should_stop = lambda: ps._closing_stop(link) or signal.should_stop()   # noqa: E731
    link = open_link(ps.wire, ps._zmq, handles[ps.rank][1], update_id, rank=ps.rank, device_key=ps.device_uuid,
                     deadline=deadline, should_stop=should_stop, buckets=plan.buckets,
                     slot_bytes=slot_bytes, ipc=ipc, device_kind=ps.backend.kind)
    times = {"plan": time.perf_counter() - t0}
    pipe = None
    ok = mapped = False
    ps._stop_signal = signal
    try:
        req.start()
        link.send_hello(frame=encode_hello(update_id, device_kind=ps.backend.kind, buffer=ipc.descriptor,
                                           slot_bytes=slot_bytes, num_slots=slots, plan_json=wire[0],
                                           plan_digest=wire[1]))
        mapped = link.wait_ready()
        if not mapped:
            signal.publish(link.failure)
        _agree(ps, link, req, deadline, "handshake", False)
        pipe = P2PPipeline(store=store, peers=src.peers, should_stop=should_stop,
                           read_deadline=deadline - READ_MARGIN_S, plan=plan, rank=ps.rank, index=ps.device_index,
                           backend=ps.backend, ipc=ipc, slot_bytes=slot_bytes, num_slots=slots, host={},
                           coll=GroupColl(ps._coll, group, len(targets)), link=link, copy_stream=ps._copy_stream, log=ps._log,
                           on_failure=signal.publish, deadline=deadline,
                           box_digests=None if box_digests is None else dict(enumerate(box_digests)))
        stats = pipe.run()
        times["pipeline"] = stats.seconds
        _agree(ps, link, req, deadline, "transfer", False)
        link.send_end(ps.keep_device_buffers)
        link.wait_finished()
        _agree(ps, link, req, deadline, "post-hook", True)
        ok = True
    finally:
        ps._stop_signal = None
        signal.close()
        link.end(ok, f"the P2P update failed on rank {ps.rank}: {sys.exc_info()[1]!r}")
        req.join(max(0.0, deadline - time.monotonic()) if ok else 2.0)
        _settle_buffer(ps, store, ipc, pipe, mapped, broken=getattr(sys.exc_info()[1], "groups_broken", False))
    times["total"] = time.perf_counter() - t0
    result = ps._report(name, plan, stats, times, slots=slots, device_buffer_bytes=slot_bytes * slots)
    result.update(p2p=True, target=True, read_bytes=pipe.read_bytes, bytes=plan.total_bytes)
    return result


def _settle_buffer(ps, store, ipc, pipe, mapped: bool, *, broken: bool) -> None:
    """After a target's update: unregister the staging buffer and free it (unless kept), or, while a
    failed read may still land bytes in it, quarantine it with its registration until that settles."""
    if pipe is not None and pipe.pending_read is not None:
        ps._ipc = None
        ptr = ipc.tensor.data_ptr()
        store.quarantine.add(pipe.pending_read, lambda: (store.unregister(ptr), ipc.close()))
        ps._log.warning("P2P staging buffer quarantined until its failed read settles")
        return
    store.unregister(ipc.tensor.data_ptr())   # registered per update: a kept buffer may be freed later
    ps._release_after(mapped, broken=broken)


def _agree(ps, link, req, deadline: float, phase: str, final: bool) -> None:
    """``ParameterServer._agree``; a P2P read failure is a TransportError, not an engine's."""
    try:
        ps._agree(link, req, deadline, phase=phase, final=final)
    except RemoteWorkerError as exc:
        if MARK in str(exc):
            raise TransportError(str(exc)) from exc
        raise


__all__ = ["P2PState", "run_update", "Failure"]
