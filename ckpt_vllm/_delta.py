"""Delta updates into a live vLLM model (issue 39; docs/deltas.md).

A full update with ``deltas=True`` loads as usual, then maps where each checkpoint tensor lives in
the engine (``_delta_map.build_map``: the loading recorded, the live layers inspected, the bytes
checked). A delta is then applied in time proportional to what changed:

- tensors whose live region holds the checkpoint's bytes verbatim (norms; on a GPU, bf16 linear
  layers and embeddings) get their changed elements scattered straight into the live tensor, then
  digest-checked (``DeltaReceiver``); they are not reloaded;
- tensors of layers vLLM derives (vLLM-CPU's prepacked linears, MoE kernels, quantized layers, a tied
  lm_head) are rebuilt in checkpoint format from the held version's bytes plus the delta, checked
  against the version's digests, and only the layers holding a changed tensor are reloaded, whole,
  through vLLM's layerwise reload of those layers alone (``ReloadSession.begin(layers=...)``), once
  every PS rank agreed that every bucket arrived and was checked (``defer_reload``). Layers holding
  no changed tensor are not touched.

The held version's bytes of a reloaded tensor come from the engine where a verbatim copy stays live
(an embedding vLLM-CPU also prepacks), else from a host copy kept per worker of exactly those
tensors. A failure on any rank undoes the scatters on every worker; nothing was reloaded before the
agreement. Where the map cannot place a tensor (or an MTP drafter shares the checkpoint), every
delta reloads the whole model from a full host copy, as the first slice did.

Staged deltas (``stage=..., deltas=True``, whole or with ``slices=``): the payloads are staged while
the engine generates (refused at once unless the worker holds their base, kept by the same slicing)
and applied in the commit's pause the same way (:func:`commit_staged_delta`), the base checked again
there on every worker.

Sliced deltas (``update_weights_from_ipc(..., slices=digest, deltas=True)``; docs/deltas.md, "Sliced
deltas"): a sliced full update maps this worker's boxes (``build_map(replay=)``) and keeps the boxes
it received that the map does not place; a sliced delta's box payloads are scattered into their live
regions or rebuilt from the kept boxes, each checked against its box's digest, and the changed layers
reloaded through the slice plan's replay. A delta whose slicing differs from the kept copy's (sliced
vs whole, another plan) is refused before anything is written.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ckpt_core import update_weights_from_ipc as _core_update_weights_from_ipc
from ckpt_core.delta.apply import DeltaReceiver, Weights, delta_of_plan
from ckpt_core.delta.host_copy import HostCopier, copier_from_settings
from ckpt_core.delta.lin64 import lin64_many
from ckpt_core.errors import CkptError, ConfigError, DeltaBaseError

from ._delta_map import DeltaMap, Digested, build_map
from ._reload import LiveWrites, ReloadSession
from ._sessions import abort_sessions, count_over_workers, drafter_target, finish_sessions, new_sessions

log = logging.getLogger("ckpt_vllm")


def receiver_of(worker: Any) -> DeltaReceiver:
    """This worker's delta state (held version, kept checkpoint-format copy), made on first use."""
    rx = getattr(worker, "_ckpt_delta_rx", None)
    if rx is None:
        rx = worker._ckpt_delta_rx = DeltaReceiver(live=lambda name: None, defer_reload=True, complete=True)
    return rx


def host_copier_of(worker: Any) -> HostCopier:
    """This worker's host copier (``ckpt_core.delta.host_copy``: page-locked staging of CKPT_HOST_COPY_MIB,
    made on first use and kept with the worker, so a full update's host copies reuse it)."""
    copier = getattr(worker, "_ckpt_host_copier", None)
    if copier is None:
        copier = worker._ckpt_host_copier = copier_from_settings()
    return copier


def _use_map(rx: DeltaReceiver, m: DeltaMap) -> None:
    rx.live = m.live
    rx.live_box = None if m.whole or m.boxes is None else m.live_box
    rx.base = None if m.whole else m.base
    rx.complete = True if m.whole else m.companions


class _Reloads:
    """The delta's reload of the changed layers (or of the whole model when the map is whole)."""

    def __init__(self, worker: Any, m: DeltaMap, replay: Any = None, writes: LiveWrites | None = None):
        self.worker, self.map, self.replay, self.writes = worker, m, replay, writes
        self.figures: dict = {"reloaded_layers": [], "reload_tensors": 0, "reload_s": 0.0}

    def __call__(self, weights: Weights) -> None:
        t0 = time.perf_counter()
        names = [n for n, _ in weights]
        if self.map.whole:
            sessions = new_sessions(self.worker, self.replay, self.writes)
            layers = ["<whole model>"]
        else:
            layers = self.map.layers(names)
            sessions = [ReloadSession(self.worker.model_runner.model, self.worker.model_config, label="model (delta)",
                                      writes=self.writes)]
            if self.replay is not None:
                sessions[0].wrap = self.replay.wrap
        try:
            if not self.map.whole:
                sessions[0].begin(layers)
            for s in sessions:
                s.load(weights)
            finish_sessions(sessions)
        except BaseException:
            abort_sessions(sessions)
            raise
        self.figures["reloaded_layers"] += layers
        self.figures["reload_tensors"] += len(weights)
        self.figures["reload_s"] += time.perf_counter() - t0


def _map_of(worker: Any, kept: dict, replay: Any = None) -> DeltaMap:
    if drafter_target(worker) is not None:
        return DeltaMap(whole="an MTP drafter shares the checkpoint")
    try:
        return build_map(worker.model_runner.model, worker.model_config, worker.device, kept, replay)
    except Exception as exc:   # noqa: BLE001 - the update is live already: deltas still apply, whole
        why = str(exc) if isinstance(exc, CkptError) else f"mapping failed: {type(exc).__name__}: {exc}"
        log.warning("ckpt deltas: every delta reloads the whole model: %s", why,
                    exc_info=not isinstance(exc, CkptError))
        return DeltaMap(whole=why)


def receive_with_deltas(worker: Any, zmq_ctx, zmq_handle: str, index: int, *, timeout: float,
                        version: str | None, replay: Any = None,
                        writes: LiveWrites | None = None) -> tuple[dict, list[ReloadSession]]:
    """One update that may be a delta; a full one is mapped and kept for the next delta. ``version``
    names what a full update makes live (required). ``replay``: the slice plan the update is routed by
    (``_slices.ReplayPlan``; None: whole tensors). ``writes``: marked before the update first writes into
    the live model (a full update's load, a delta's reload; a delta whose undo did not finish). Returns
    the result and the full update's reload sessions (none for a delta)."""
    if not isinstance(version, str) or not version:
        raise ConfigError("an update with deltas=True needs version=: a later delta names its base by it")
    rx = receiver_of(worker)
    m: DeltaMap = getattr(worker, "_ckpt_delta_map", None) or DeltaMap(whole="no full update mapped it yet")
    sliced = None if replay is None else replay.digest
    _use_map(rx, m)
    reloads = _Reloads(worker, m, replay, writes)
    kept: dict = {}
    received: dict[str, Digested] = {}   # a full update's tensors by their digests, taken where they arrived
    sessions: list[ReloadSession] = []   # begun by a full update's plan; a delta touches no layer before its reload
    spent = {"digest_s": 0.0, "host_copy_s": 0.0, "host_copy_bytes": 0}   # a full update's own costs, beside the load
    forecast: list[DeltaMap | None] = [None]   # which tensors need a host copy (None: every one)

    def run(weights):   # a full update: loaded, and what the next delta needs kept
        for s in sessions:
            s.load(weights)
        t0 = time.perf_counter()
        digests = lin64_many(t for _, t in weights)
        t1 = time.perf_counter()
        wanted = []
        for (name, t), digest in zip(weights, digests):
            received[name] = Digested(t.dtype, tuple(t.shape), digest)
            if forecast[0] is None or forecast[0].keeps(name):
                wanted.append((name, t))
        # complete on return: the tensors are views into the receive buffer, reused once this bucket is done
        copier = host_copier_of(worker)
        kept.update(zip((n for n, _ in wanted), copier.copy(wanted, timeout=timeout)))
        spent["digest_s"] += t1 - t0
        spent["host_copy_s"] += time.perf_counter() - t1
        spent["host_copy_bytes"] += copier.last["bytes"]

    def on_plan(tensors):
        if delta_of_plan(tensors) is not None:   # a delta: of the slicing the kept copy has
            problem = _slicing_problem(worker, sliced)
            if problem is not None:
                raise ConfigError(f"{problem}: update the version whole (nothing was written)")
            return cb.on_plan(tensors)
        cb.on_plan(tensors)
        forecast[0] = _forecast(worker, tensors, replay, m)
        sessions.extend(new_sessions(worker, replay, writes))
        for s in sessions:
            s.check_plan(name for name, _, _ in tensors)
            s.check_whole_layers(name for name, _, _ in tensors)

    rx.reload = reloads
    cb: Any = None   # the update's callbacks, once begun
    try:
        with rx.update(run=run, post_hook=lambda: finish_sessions(sessions), version=version, pipelined=True) as cb:
            _core_update_weights_from_ipc(zmq_ctx, zmq_handle, index, run=cb.run, on_plan=on_plan,
                                          post_hook=cb.post_hook, timeout=timeout,
                                          slices=None if replay is None else replay.route)
    except BaseException:
        _undo_unfinished(cb, writes)
        abort_sessions(sessions)
        raise
    finally:
        rx.reload = None
    figures = dict(rx.last)
    if received:   # a full update: its tensors are the next delta's base
        t0 = time.perf_counter()
        m = worker._ckpt_delta_map = _map_of(worker, received, replay)
        worker._ckpt_delta_slices = sliced
        rx.kept = {n: t for n, t in kept.items() if m.keeps(n)}
        uncopied = sorted(n for n in received if m.keeps(n) and n not in kept)
        if uncopied:   # the forecast took a region as verbatim that the load did not leave so: no delta of this
            rx.held = None   # version can rebuild those tensors; the next full update copies them (its map says so)
            log.warning("ckpt deltas: the map after the load keeps %d tensor(s) the forecast did not copy (e.g. "
                        "%s): a delta of %r will be refused (base unknown); the next full update keeps them",
                        len(uncopied), uncopied[:3], version)
        figures["map"] = dict(m.figures(), kept=len(rx.kept), kept_bytes=sum(t.nbytes for t in rx.kept.values()),
                              host_copies=len(kept), forecast=forecast[0] is not None, uncopied=len(uncopied),
                              map_s=time.perf_counter() - t0,
                              host_copy_gbps=spent["host_copy_bytes"] / max(spent["host_copy_s"], 1e-9) / 1e9, **spent)
        log.info("ckpt deltas: %s", figures["map"])
    elif figures.get("delta"):
        figures.update(reloads.figures)
        log.info("ckpt delta %s -> %s: %d tensors scattered, %d layers reloaded (%d tensors) in %.3f s",
                 figures.get("base"), figures.get("version"), figures.get("scattered", 0),
                 len(reloads.figures["reloaded_layers"]), reloads.figures["reload_tensors"],
                 reloads.figures["reload_s"])
    if sessions:
        tensors, nbytes = sessions[0].tensors, sessions[0].bytes
    else:   # a delta: the tensors it scattered or reloaded, the payload bytes it received
        tensors = figures.get("scattered", 0) + figures.get("reload_tensors", 0)
        nbytes = figures.get("payload_bytes", 0)
    return {"tensors": tensors, "bytes": nbytes, "held": rx.held, "delta": figures}, sessions


def _forecast(worker: Any, listing, replay: Any, prior: DeltaMap) -> DeltaMap | None:
    """Before a full update with ``deltas=True`` loads anything: which of its tensors the next delta will need
    a host copy of (``DeltaMap.keeps``), so that the update copies those only, not every tensor it receives
    (pageable copies of the whole model). The last full update's map, where it mapped exactly these tensors
    (the same model and layers: what its load left verbatim, checked byte for byte then); None (copy every
    tensor) for the first full update, under a slice plan, with an MTP drafter, or a map that is whole. A
    map of the plan alone (without the bytes) is no forecast: processing may rewrite a region in place
    (vLLM-CPU's MoE experts: 48 of 58 tensors of a small Qwen3-MoE), which only the bytes after the load show."""
    if replay is not None or drafter_target(worker) is not None or prior.whole:
        return None
    return prior if set(prior.scatter) | set(prior.group_of) == {n for n, _, _ in listing} else None


def _undo_unfinished(cb: Any, writes: LiveWrites | None) -> None:
    """After a failed update: a delta whose undo raised part-way left scatters in the live model."""
    if writes is not None and cb is not None and cb.delta is not None and cb.undo_log:
        writes.mark()


def _slicing(digest: str | None) -> str:
    return "whole (no slice plan)" if digest is None else f"by slice plan {digest[:12]}"


def _slicing_problem(worker: Any, sliced: str | None) -> str | None:
    """Why a delta routed by plan ``sliced`` (None: whole tensors) cannot apply to the base this worker
    keeps (kept by another slicing), or None."""
    kept_for = getattr(worker, "_ckpt_delta_slices", None)
    if kept_for == sliced:
        return None
    return f"this worker keeps its base {_slicing(kept_for)}, the delta comes {_slicing(sliced)}"


def _base_problem(worker: Any, delta: tuple[str, str] | None, sliced: str | None) -> str | None:
    """Why the delta ``(base, version)`` routed by ``sliced`` does not apply to what this worker holds
    now (another version, or its base kept by another slicing), or None. Checked when a delta is
    staged and again at its commit: the engine may have taken another update in between."""
    held = receiver_of(worker).held
    if delta is None:
        return "the stage holds no delta"
    if held != delta[0]:
        return f"this worker holds {held!r}, not the base {delta[0]!r} of the delta of {delta[1]!r}"
    return _slicing_problem(worker, sliced)


def check_staged_plan(worker: Any, tensors, sliced: str | None = None) -> tuple[str, str] | None:
    """A stage's plan (``deltas=True``; ``sliced``: the digest of the slice plan it is routed by):
    ``(base, version)`` when it is a delta of the version this worker holds, kept by the same slicing;
    ``DeltaBaseError`` when it is not (nothing staged); None for a full update (staged as usual)."""
    delta = delta_of_plan(tensors)
    problem = None if delta is None else _base_problem(worker, delta, sliced)
    if problem is not None:
        raise DeltaBaseError(f"{problem}: nothing was staged")
    return delta


def commit_staged_delta(worker: Any, buckets: list[Weights], version: str, replay: Any = None,
                        writes: LiveWrites | None = None) -> dict:
    """Apply a staged delta (``stage=..., deltas=True``) in the commit's pause, as an update applies
    one: its base checked again on every worker (the engine may have taken another update since the
    stage: then refused on all, nothing written), scatters and rebuilt tensors checked on every worker,
    then agreed over the engine's workers (a failure on any worker undoes every scatter on all of them),
    then the changed layers reloaded. ``replay``: the slice plan it was staged by (each worker applies
    its boxes' payloads and reloads through the plan's replay, as a sliced delta update does). ``writes``:
    marked before the reload of the changed layers (or when the undo of the scatters did not finish)."""
    rx = receiver_of(worker)
    m: DeltaMap = getattr(worker, "_ckpt_delta_map", None) or DeltaMap(whole="no full update mapped it yet")
    listing = [(n, t.dtype, tuple(t.shape)) for bucket in buckets for n, t in bucket]
    gone = _base_problem(worker, delta_of_plan(listing), None if replay is None else replay.digest)
    failed = count_over_workers(gone is not None)
    if failed:
        raise DeltaBaseError(f"cannot commit the staged delta of {version!r}: {failed} worker(s) of the engine no "
                             f"longer hold its base ({gone or 'this one does'}); nothing was written, the "
                             "stage was dropped")
    _use_map(rx, m)
    reloads = _Reloads(worker, m, replay, writes)
    rx.reload = reloads
    cb: Any = None   # the update's callbacks, once begun
    try:
        with rx.update(run=lambda weights: None, version=version) as cb:
            cb.on_plan(listing)
            problem: BaseException | None = None
            try:
                for bucket in buckets:
                    cb.run(bucket)
            except Exception as exc:   # noqa: BLE001 - agreed below: every worker undoes its scatters
                problem = exc
            if count_over_workers(problem is not None):
                raise problem or ConfigError("another worker of the engine failed to apply the staged delta; "
                                             "every worker undid it")
            cb.post_hook()
    except BaseException:
        _undo_unfinished(cb, writes)
        raise
    finally:
        rx.reload = None
    figures = dict(rx.last, **reloads.figures)
    return {"tensors": figures.get("scattered", 0) + figures.get("reload_tensors", 0),
            "bytes": figures.get("payload_bytes", 0), "held": rx.held, "delta": figures}
