"""Direct full updates: tensors of verbatim layers copied straight into the live model (issue 38).

A full update normally feeds every tensor through vLLM's layerwise reload (``_reload.py``): each
weight is dry-run on the meta layer, buffered, handed to its loader (an MoE layer's once per expert
and projection), and each layer is processed and copied back. On a model of thousands of tensors
that Python, not the bytes, is the update. Where the engine itself shows that a layer reads its
parameters exactly as loaded, none of it is needed: the bytes can go where the loader would put them.

``update_weights_from_ipc(..., direct=True)`` (``VllmClient.update(direct=True)``):

- **Recording** (the first such update of a plan, or after the map was dropped): the update goes the
  usual way, every tensor through the reload, and the ``lin64`` digest of every received tensor is
  taken on its device. Afterwards ``_delta_map.build_map`` records the model's own loading over
  zero-storage tensors and inspects the live layers: a group of tensors and layers is *scattered*
  when every layer of it is verbatim (post-load processing kept the checkpoint-format parameters and
  derived nothing) and every tensor of it was written whole, once, into one region that now holds
  its bytes (the digest of the live region, cast back where bf16/fp16 is served widened to float32,
  equals the received one). Nothing is loaded by the recording.
- **Direct** (every later update of the same plan): the plan is compared with the recorded one
  (names, dtypes, shapes, in full) and every parameter holding a direct region with the one recorded
  (the same object, at the same address, in the same model); any difference sends the update the
  usual way and records the map again. Each bucket's scattered tensors are copied into their live
  regions in one batched copy (``torch._foreach_copy_``: no host sync per tensor); the other groups
  go through vLLM's layerwise reload of their layers alone (``ReloadSession.begin(layers=...)``),
  checked and finalized as a full update is.

A plan the map cannot place (``DeltaMap.whole``), or a model with an MTP drafter sharing the
checkpoint, is remembered as such: its updates go the usual way without recording again.

On failure: the direct copies already made hold the new weights, as the layers a full update's
reload had processed do; every reloaded layer not yet processed gets its live tensors back (old
weights, ``ReloadSession.abort``). The engine keeps serving; push the checkpoint again, or stage and
commit for all or nothing. The map is kept (it describes the model, not its weights).
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ckpt_core import update_weights_from_ipc as _core_update_weights_from_ipc
from ckpt_core.delta.lin64 import lin64_many

from ._delta_map import DeltaMap, Digested, build_map
from ._reload import LiveWrites, ReloadSession
from ._sessions import abort_sessions, drafter_target, finish_sessions, new_sessions

__all__ = ["DirectMap", "map_direct", "receive_direct"]

log = logging.getLogger("ckpt_vllm")
Listing = Sequence[tuple[str, Any, tuple[int, ...]]]   # (name, torch dtype, shape) of a plan (``Hello.listing``)


@dataclass(eq=False)
class DirectMap:
    """Where the tensors of one plan go in one live model: copied (``targets``), or reloaded with
    their layers (``layers``); ``unusable``: why this plan always goes the usual way."""

    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    model: Any   # a weak reference to the model the map describes
    targets: dict[str, torch.Tensor] = field(default_factory=dict)
    layers: list[str] = field(default_factory=list)
    guards: list[tuple[torch.nn.Module, str, torch.Tensor, int]] = field(default_factory=list)
    unusable: str | None = None
    figures: dict = field(default_factory=dict)
    _seen: Listing | None = None   # the last listing found equal to specs (the core caches it per plan)

    def mismatch(self, model: torch.nn.Module, listing: Listing) -> str | None:
        """Why an update of ``listing`` into ``model`` cannot use this map (then it is recorded again)."""
        if self.model() is not model:
            return "the model is not the one the map was recorded on"
        if listing is not self._seen:
            if (len(listing) != len(self.specs) or len({n for n, _, _ in listing}) != len(self.specs)
                    or any(self.specs.get(n) != (d, tuple(s)) for n, d, s in listing)):
                return "the plan's names, dtypes or shapes differ from the plan the map was recorded from"
            self._seen = listing
        for module, leaf, param, ptr in self.guards:
            if module._parameters.get(leaf) is not param or param.data_ptr() != ptr:
                return f"a live parameter ({leaf} of {type(module).__name__}) was replaced since the map was recorded"
        return None

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The checkpoint layout an update of this plan makes live (``_ckpt_made_live``)."""
        return {n: (str(d).removeprefix("torch."), s) for n, (d, s) in self.specs.items()}


def map_direct(worker: Any, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
               digests: dict[str, str]) -> DirectMap:
    """The direct map of the plan just loaded whole (``specs``, with each tensor's received ``digests``)."""
    t0 = time.perf_counter()
    model = worker.model_runner.model
    out = DirectMap(dict(specs), weakref.ref(model))
    if drafter_target(worker) is not None:
        out.unusable = "an MTP drafter loads the same checkpoint"
    else:
        kept = {n: Digested(d, s, digests[n]) for n, (d, s) in specs.items()}
        try:
            m = build_map(model, worker.model_config, worker.device, kept)
        except Exception as exc:   # noqa: BLE001 - the update is live already: later ones go the usual way
            log.warning("ckpt direct: the map could not be recorded, updates of this plan reload every layer: "
                        "%s: %s", type(exc).__name__, exc, exc_info=True)
            m = DeltaMap(whole=f"recording failed: {type(exc).__name__}: {exc}")
        _fill(out, model, m)
    out.figures.update(map_s=time.perf_counter() - t0, whole=out.unusable)
    log.info("ckpt direct map: %d of %d tensors copied directly, %d layers reloaded (%s) in %.3f s",
             len(out.targets), len(specs), len(out.layers), out.unusable or "usable", out.figures["map_s"])
    return out


def _fill(out: DirectMap, model: torch.nn.Module, m: DeltaMap) -> None:
    if m.whole:
        out.unusable = f"the map places not every tensor: {m.whole}"
        return
    modules = dict(model.named_modules(remove_duplicate=False))
    out.targets = dict(m.scatter)
    out.layers = sorted({layer for layers, _ in m.groups for layer in layers})
    seen: set[int] = set()
    for pname in m.source.values():
        owner, _, leaf = pname.rpartition(".")
        module = modules[owner]
        param = module._parameters[leaf]
        if param is not None and id(param) not in seen:
            seen.add(id(param))
            out.guards.append((module, leaf, param, param.data_ptr()))
    why = sorted({m.why[n] for n in m.why})
    out.figures.update(direct_tensors=len(out.targets), reloaded_groups=len(m.groups), why_reloaded=why[:8],
                       record_s=m.seconds.get("record"), decide_s=m.seconds.get("decide"))


class _Receive:
    """The callbacks of one full update with ``direct=True``; which way it goes is decided from its plan."""

    def __init__(self, worker: Any, current: DirectMap | None, writes: LiveWrites | None = None):
        self.worker, self.map, self.writes = worker, current, writes
        self.model = worker.model_runner.model
        self.sessions: list[ReloadSession] = []
        self.direct = False
        self.why: str | None = None   # why this update goes the usual way
        self.digests: dict[str, str] | None = None   # taken while recording
        self.specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.figures = {"direct_tensors": 0, "direct_bytes": 0, "copy_s": 0.0, "reload_tensors": 0}

    def on_plan(self, listing: Listing) -> None:
        m = self.map
        mismatch = "no map recorded yet" if m is None else m.mismatch(self.model, listing)
        self.why = mismatch or (m.unusable if m is not None else None)
        self.direct = self.why is None
        if self.direct:
            assert m is not None  # noqa: S101 - type narrowing: why is None only with a map
            if m.layers:
                session = ReloadSession(self.model, self.worker.model_config, label="model (direct update)",
                                        writes=self.writes)
                self.sessions.append(session)
                session.begin(m.layers)
            return
        self.sessions.extend(new_sessions(self.worker, writes=self.writes))
        for s in self.sessions:
            s.check_plan(name for name, _, _ in listing)
            s.check_whole_layers(name for name, _, _ in listing)
        if mismatch is not None:   # record this plan's map after the update (once per plan)
            self.digests = {}
            self.specs = {n: (d, tuple(s)) for n, d, s in listing}

    def run(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        if not self.direct:
            for s in self.sessions:
                s.load(weights)
            if self.digests is not None:
                self.digests.update(zip((n for n, _ in weights), lin64_many(t for _, t in weights)))
            return
        assert self.map is not None  # noqa: S101 - direct only with a map
        targets = self.map.targets
        dst, src, rest = [], [], []
        for name, t in weights:
            live = targets.get(name)
            if live is None:
                rest.append((name, t))
            else:
                dst.append(live)
                src.append(t)
        t0 = time.perf_counter()
        if dst:
            if self.writes is not None:
                self.writes.mark()
            with torch.no_grad():
                torch._foreach_copy_(dst, src)
            self.figures["direct_tensors"] += len(dst)
            self.figures["direct_bytes"] += sum(t.nbytes for t in src)
        self.figures["copy_s"] += time.perf_counter() - t0
        if rest:
            self.sessions[0].load(rest)
            self.figures["reload_tensors"] += len(rest)

    def post_hook(self) -> None:
        finish_sessions(self.sessions)


def receive_direct(worker: Any, zmq_ctx, zmq_handle: str, index: int, *, timeout: float,
                   writes: LiveWrites | None = None) -> tuple[dict, DirectMap | None]:
    """One full update with ``direct=True`` (see the module doc): the worker's result, with ``direct``
    (which way it went, ``path``: direct, or reload and why; its counts and seconds), and the map the
    worker keeps for the next update (recorded by this one, or the one it used). ``writes``: marked
    before the first direct copy or reload into the live model."""
    t0 = time.perf_counter()
    rx = _Receive(worker, getattr(worker, "_ckpt_direct", None), writes)
    try:
        _core_update_weights_from_ipc(zmq_ctx, zmq_handle, index, run=rx.run, on_plan=rx.on_plan,
                                      post_hook=rx.post_hook, timeout=timeout)
    except BaseException:
        abort_sessions(rx.sessions)
        raise
    total = time.perf_counter() - t0
    m = rx.map
    figures: dict = {"path": "direct" if rx.direct else "reload", **rx.figures}
    if rx.direct:
        assert m is not None  # noqa: S101 - direct only with a map
        figures["reloaded_layers"] = len(m.layers)
        tensors = rx.figures["direct_tensors"] + rx.figures["reload_tensors"]
        nbytes = rx.figures["direct_bytes"] + (rx.sessions[0].bytes if rx.sessions else 0)
    else:
        figures["why"] = rx.why
        tensors, nbytes = rx.sessions[0].tensors, rx.sessions[0].bytes
        if rx.digests is not None:
            m = map_direct(worker, rx.specs, rx.digests)
            figures["map"] = dict(m.figures)
    seconds = dict(rx.sessions[0].seconds) if rx.sessions else {"begin": 0.0, "load": 0.0, "finish": 0.0}
    seconds.update(copy=rx.figures["copy_s"], total=total)
    return {"tensors": tensors, "bytes": nbytes, "drafter": len(rx.sessions) > 1 and not rx.direct,
            "seconds": seconds, "direct": figures}, m
