"""Delta updates inside SGLang's scheduler: where each checkpoint tensor lives, and one load's delta.

Our loader's ``load`` op (``staging.py``) takes a delta (the plan's names carry its manifests,
``ckpt_core/delta/versions.py``) the way ``ckpt_core.delta.apply.DeltaReceiver`` describes: changed
elements scattered into live tensors that hold the checkpoint's bytes verbatim, every other changed
tensor rebuilt (held bytes + delta) and handed to SGLang's own ``load_weights`` with the other
tensors of the modules it loads into, then the post-load processing of those modules only.

**The map** (:class:`DeltaMap`), built after a full load with ``deltas`` from what the model shows,
never from names or model families:

- the load itself, recorded (:class:`_Recorder`, a torch dispatch mode around SGLang's
  ``load_weights``): every write into a parameter's storage, and for a copy the checkpoint tensor
  it reads (its bytes in the received bucket) and whether it read that tensor whole;
- the live parameters after SGLang's post-load processing: still the objects written (same
  storage, shape, dtype), and the modules holding them unquantized (``quant_method`` absent or
  SGLang's ``Unquantized*``) and holding no tensor beside their parameters and buffers;
- the bytes: the region a checkpoint tensor was copied into equals it, byte for byte (cast back
  where SGLang widened bf16/fp16 to float32: exact both ways).

A checkpoint tensor written once, whole, into one contiguous region of such a parameter, no other
write touching that region, is *scattered*. Checkpoint tensors and the modules they are written
into form groups (q/k/v and their ``qkv_proj``, an embedding and the tied ``lm_head`` it is also
copied into): a group is scattered only when all of it is; any other group is *reloaded* whole
(its changed tensors rebuilt, its unchanged ones from the host copy the worker keeps of exactly
those groups). A tensor whose load the recording does not see reloads with every module's
post-processing (as a full load). A tensor-parallel shard reads part of its tensor: reloaded
(the worker keeps the whole tensor; SGLang's loader shards it again).

**Refused** (the delta's first bucket raises ``DeltaBaseError``, so ``delta="fallback"`` sends it
whole): a model with a model-wide ``post_load_weights`` (it derives across modules: not re-run for
one), or a module whose post-load processing replaced the parameters the load wrote (a quantized
layer that repacks into new tensors: loading it again per module is not what a cold load does).
"""

from __future__ import annotations

import bisect
import logging
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ckpt_core.delta.apply import WIDENING, DeltaReceiver
from ckpt_core.delta.encode import bytes_of
from ckpt_core.delta.groups import Groups
from ckpt_core.delta.host_copy import HostCopier, copier_from_settings
from ckpt_core.delta.versions import MANIFEST, PAYLOAD, parse_manifest_name
from ckpt_core.errors import CheckpointFormatError, ConfigError, DeltaBaseError

__all__ = ["DeltaMap", "SglangDeltas", "build_map", "is_delta_name"]

log = logging.getLogger("ckpt_sglang.staging")

Weights = list[tuple[str, torch.Tensor]]


def is_delta_name(name: str) -> bool:
    return name.startswith(PAYLOAD) or name.startswith(MANIFEST)


@dataclass(frozen=True)
class _Write:
    param: str           # the parameter written (one of its names)
    start: int           # element offset in the parameter
    numel: int
    contiguous: bool     # the written view is one contiguous run
    source: str | None   # the checkpoint tensor copied from (None: not a copy of one)
    whole: bool          # the source is that whole tensor, as received


class _Recorder(TorchDispatchMode):
    """Every write into a parameter's storage during SGLang's ``load_weights`` (see the module doc)."""

    def __init__(self, params: dict[int, list[tuple[str, torch.Tensor]]]):
        super().__init__()
        self.params = params   # storage data_ptr -> [(name, parameter)] in that storage
        self.sources: list[tuple[int, int, str, torch.Tensor]] = []   # (start, end, name, tensor), sorted
        self.writes: list[_Write] = []

    def add_sources(self, weights: Weights) -> None:
        for name, t in weights:
            if t.numel():
                start = t.data_ptr()
                self.sources.append((start, start + t.numel() * t.element_size(), name, t))
        self.sources.sort(key=lambda s: s[0])

    def clear_sources(self) -> None:
        self.sources = []

    def _source(self, src) -> tuple[str | None, bool]:
        if not isinstance(src, torch.Tensor) or src.numel() == 0 or src.device.type == "meta":
            return None, False
        ptr = src.data_ptr()
        i = bisect.bisect_right([s[0] for s in self.sources], ptr) - 1
        if i < 0 or ptr >= self.sources[i][1]:
            return None, False
        _, _, name, t = self.sources[i]
        whole = (ptr == t.data_ptr() and tuple(src.shape) == tuple(t.shape) and src.dtype == t.dtype
                 and src.is_contiguous())
        return name, whole

    def _param_at(self, value: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """The parameter whose bytes the written view ``value`` starts in (None: no parameter's)."""
        ptr = value.data_ptr()
        for pname, param in self.params.get(value.untyped_storage().data_ptr(), ()):
            if param.data_ptr() <= ptr < param.data_ptr() + max(param.numel(), 1) * param.element_size():
                return pname, param
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        positional = [a for a in schema.arguments if not a.kwarg_only]
        for i, a in enumerate(schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            value = args[i] if not a.kwarg_only and i < len(args) else kwargs.get(a.name)
            if not isinstance(value, torch.Tensor) or value.device.type == "meta" or value.numel() == 0:
                continue
            found = self._param_at(value)
            if found is None:
                continue
            pname, param = found
            source, whole = (None, False)
            if func.overloadpacket is torch.ops.aten.copy_ and len(args) > 1 and len(positional) > 1:
                source, whole = self._source(args[1])
            start = (value.data_ptr() - param.data_ptr()) // max(param.element_size(), 1)
            self.writes.append(_Write(pname, start, value.numel(), value.is_contiguous(), source, whole))
        return out


def _param_storages(model: torch.nn.Module) -> dict[int, list[tuple[str, torch.Tensor]]]:
    out: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, p in model.named_parameters():
        if p.device.type != "meta" and p.numel():
            out.setdefault(p.untyped_storage().data_ptr(), []).append((name, p))
    return out


@dataclass
class DeltaMap:
    """One worker's map (see the module doc)."""

    scatter: dict[str, torch.Tensor] = field(default_factory=dict)   # name -> its live region (checkpoint shape)
    anchors: dict[str, tuple[str, torch.Tensor, int]] = field(default_factory=dict)   # name -> (param name,
    # the parameter object, its data_ptr) of a scattered tensor, checked again before each delta
    modules_of: dict[str, tuple[str, ...] | None] = field(default_factory=dict)   # reloaded name -> modules
    # written (None: not seen: every module is post-processed)
    groups: list[tuple[str, ...]] = field(default_factory=list)       # reloaded names, by group
    group_of: dict[str, int] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)                 # reloaded name -> why not scattered
    refuse: str | None = None   # why no delta applies to this model
    seconds: dict[str, float] = field(default_factory=dict)

    def companions(self, names: list[str]) -> list[str]:
        """Every tensor of the groups ``names`` belong to."""
        seen = sorted({self.group_of[n] for n in names if n in self.group_of})
        return [n for g in seen for n in self.groups[g]]

    def modules(self, names: list[str]) -> list[str] | None:
        """The modules a reload of ``names`` writes into (None: not all known: post-process every module)."""
        out: set[str] = set()
        for n in names:
            mods = self.modules_of.get(n)
            if mods is None:
                return None
            out.update(mods)
        return sorted(out)

    def stale(self, model: torch.nn.Module) -> str | None:
        """Why a scattered tensor's live region is no longer the parameter it was mapped in (None: all are)."""
        params = dict(model.named_parameters(remove_duplicate=False))
        for name, (pname, param, ptr) in self.anchors.items():
            p = params.get(pname)
            if p is not param or p.data_ptr() != ptr:
                return f"the parameter {pname} that {name} was mapped into was replaced since the last full update"
        return None

    def figures(self) -> dict:
        return {"scatterable": len(self.scatter), "groups": len(self.groups), "kept": sum(map(len, self.groups)),
                "refuse": self.refuse, "seconds": dict(self.seconds)}


def _owners(model: torch.nn.Module) -> dict[int, list[str]]:
    """id of each parameter -> the modules holding it (tied parameters: several)."""
    out: dict[int, list[str]] = {}
    for qname, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                out.setdefault(id(p), []).append(qname)
    return out


def _module_problem(module: torch.nn.Module) -> str | None:
    """Why ``module`` may compute from something other than its parameters as loaded (None: it does not)."""
    method = getattr(module, "quant_method", None)
    if method is not None and not type(method).__name__.startswith("Unquantized"):
        return f"quantization method {type(method).__name__}"
    own = {id(t) for t in list(module._parameters.values()) + list(module._buffers.values()) if t is not None}
    derived = [k for k, v in vars(module).items() if isinstance(v, torch.Tensor) and id(v) not in own]
    if derived:
        return f"it holds tensors {derived[:3]} beside its parameters"
    return None


def build_map(model: torch.nn.Module, rec: _Recorder, before: dict[str, tuple[torch.Tensor, int]],
              kept: dict[str, torch.Tensor]) -> DeltaMap:
    """Decide, per checkpoint tensor of ``kept`` (host copies of the version just loaded), scatter or
    reload (see the module doc). ``before``: each parameter and its data pointer when the load was recorded."""
    t0 = time.perf_counter()
    out = DeltaMap()
    if callable(getattr(model, "post_load_weights", None)):
        out.refuse = (f"{type(model).__name__} runs a model-wide post_load_weights after loading (it derives across "
                      "modules), which is not re-run for the changed modules alone")
        return out
    params = dict(model.named_parameters(remove_duplicate=False))
    owners = _owners(model)
    modules = dict(model.named_modules(remove_duplicate=False))
    written_by: dict[str, list[_Write]] = {}
    on_param: dict[str, list[_Write]] = {}
    for w in rec.writes:
        on_param.setdefault(w.param, []).append(w)
        if w.source is not None:
            written_by.setdefault(w.source, []).append(w)
    # a parameter the load wrote must still be that object, where it was, after post-processing
    for pname, (p, ptr) in before.items():
        if pname not in on_param:
            continue
        live = params.get(pname)
        if live is not p or live.data_ptr() != ptr or live.shape != p.shape or live.dtype != p.dtype:
            mods = owners.get(id(p), [pname.rpartition(".")[0]])
            method = getattr(modules.get(mods[0]), "quant_method", None)
            out.refuse = (f"post-load processing of {mods[0]} ({type(method).__name__ if method else 'its module'}) "
                          f"replaced the parameter {pname} the load wrote: it cannot be re-run for one module; "
                          "deltas go whole (delta='fallback')")
            return out
    # groups of checkpoint names and the modules they are written into
    groups = Groups()
    find = groups.find
    for name in kept:
        find("t:" + name)
        for w in written_by.get(name, []):
            for mod in owners.get(id(params[w.param]), []):
                groups.union("t:" + name, "m:" + mod)
    problems: dict[str, str] = {}
    regions: dict[str, tuple[str, torch.Tensor, torch.Tensor]] = {}
    for name, src in kept.items():
        why, region = _scatter_region(name, src, written_by.get(name, []), on_param, params, owners, modules)
        if why is None and region is not None:
            regions[name] = region
        else:
            problems[name] = why or "no region"
    # the bytes of every candidate region, compared with what was loaded
    for name, (pname, p, view) in list(regions.items()):
        src = kept[name]
        held = view if view.dtype == src.dtype else view.to(src.dtype)
        if not torch.equal(bytes_of(held.contiguous().cpu()), bytes_of(src.contiguous())):
            problems[name] = "after post-load processing its live region does not hold the bytes loaded"
            del regions[name]
    members: dict[str, list[str]] = {}
    for name in kept:
        members.setdefault(find("t:" + name), []).append(name)
    for names in members.values():
        bad = [n for n in names if n in problems]
        if not bad:
            for n in names:
                pname, p, view = regions[n]
                out.scatter[n] = view
                out.anchors[n] = (pname, p, p.data_ptr())
            continue
        index = len(out.groups)
        out.groups.append(tuple(sorted(names)))
        for n in names:
            out.group_of[n] = index
            out.why[n] = problems.get(n) or f"grouped with {bad[0]}: {problems[bad[0]]}"
            ws = written_by.get(n)
            out.modules_of[n] = None if not ws else tuple(sorted(
                {m for w in ws for m in owners.get(id(params[w.param]), [])}))
    out.seconds["decide"] = time.perf_counter() - t0
    return out


def _scatter_region(name, src, writes, on_param, params, owners, modules):
    """(None, (param name, parameter, live view in the checkpoint's shape)) when checkpoint tensor
    ``name`` may be scattered into its live region (bytes not compared here), else (why, None)."""
    if len(writes) != 1:
        return (f"written {len(writes)} times" if writes else "no write of it into a parameter was seen"), None
    w = writes[0]
    if not w.whole or not w.contiguous or w.numel != src.numel():
        return "read in part (a tensor-parallel shard), or copied into a non-contiguous region", None
    others = [o for o in on_param.get(w.param, []) if o is not w and o.start < w.start + w.numel
              and w.start < o.start + o.numel]
    if others:
        return f"its region of {w.param} is written by something else too ({others[0].source})", None
    p = params[w.param]
    if not p.is_contiguous():
        return f"{w.param} is not contiguous", None
    if p.dtype != src.dtype and (src.dtype, p.dtype) not in WIDENING:
        return f"it lands in {p.dtype}, neither its {src.dtype} nor a float32 it widens to exactly", None
    for mod in owners.get(id(p), []):
        why = _module_problem(modules[mod])
        if why is not None:
            return f"{mod}: {why}", None
    view = p.detach().reshape(-1).narrow(0, w.start, w.numel).view(src.shape)
    return None, (w.param, p, view)


class SglangDeltas:
    """One scheduler process's delta state: the version it holds, the map, the kept host copies."""

    def __init__(self):
        self.map: DeltaMap | None = None
        self.model: torch.nn.Module | None = None
        self.device: torch.device | None = None
        self.session = False   # the current load runs inside SGLang's weight-update session
        self.reload_figures: dict = {}
        self._ours = 0
        self.rx = DeltaReceiver(live=self._live, reload=self._reload)
        self.copier: HostCopier | None = None   # page-locked staging for a full update's host copies, made once

    def host_copies(self, weights: Weights, timeout: float) -> list[torch.Tensor]:
        """Host copies of a full update's received tensors, complete on return (the IPC buffer is reused),
        through this process's :class:`HostCopier` (not one pageable ``.to("cpu")`` per tensor); a stuck
        device copy raises after ``timeout`` seconds (the load's own), naming its tensors."""
        if self.copier is None:
            self.copier = copier_from_settings()
        return self.copier.copy(list(weights), timeout=timeout)

    @property
    def held(self) -> str | None:
        return self.rx.held

    def forget(self) -> None:
        self.map, self.rx.held, self.rx.kept = None, None, {}

    @contextmanager
    def ours(self):
        """Around our own calls of the model's ``load_weights`` (see :meth:`guard`)."""
        self._ours += 1
        try:
            yield
        finally:
            self._ours -= 1

    def guard(self, model: torch.nn.Module) -> None:
        """Wrap ``model.load_weights`` (on the instance, once) so that a load that is not ours (SGLang's own
        ``/update_weights_from_ipc`` or ``/update_weights_from_disk``, which load through it) makes this
        worker forget the version it held: a delta after it is refused, never applied to other weights."""
        current = getattr(model, "load_weights", None)
        if current is None or getattr(current, "_ckpt_deltas", None) is self:
            return
        inner = current

        def load_weights(weights, *args, **kwargs):
            if not self._ours and self.rx.held is not None:
                log.warning("ckpt deltas: the model was loaded outside our loader; the held version %r is "
                            "forgotten (deltas are refused until a full update with deltas)", self.rx.held)
                self.forget()
            return inner(weights, *args, **kwargs)

        load_weights._ckpt_deltas = self   # type: ignore[attr-defined]
        model.load_weights = load_weights

    def _live(self, name: str) -> torch.Tensor | None:
        return None if self.map is None else self.map.scatter.get(name)

    def _reload(self, weights: Weights) -> None:
        """SGLang's ``load_weights`` with ``weights`` and the unchanged tensors of their groups, then the
        post-load processing of the modules they are written into."""
        model, dmap = self.model, self.map
        if model is None or dmap is None:
            raise CheckpointFormatError("a delta reached a worker that holds no map of its model")
        t0 = time.perf_counter()
        given = {n for n, _ in weights}
        batch = list(weights)
        for n in dmap.companions(sorted(given)):
            if n not in given:
                t = self.rx.kept.get(n)
                if t is None:
                    raise CheckpointFormatError("the engine reloads this unchanged tensor with a changed one and this "
                                                "worker holds no copy of it", tensor=n)
                batch.append((n, t))
        target = [(n, t.to(self.device) if self.device is not None else t) for n, t in batch]
        with torch.no_grad(), self.ours():
            model.load_weights(target)
        mods = dmap.modules([n for n, _ in batch])
        if not self.session:   # a session's end post-processes (SGLang 0.5.23)
            post_process(model, self.device, mods)
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.reload_figures = {"reloaded_modules": mods if mods is not None else ["*"],
                               "reload_tensors": len(batch), "reload_s": time.perf_counter() - t0}

    def check_bucket(self, names: list[str]) -> None:
        """``DeltaBaseError`` (nothing written) when this worker cannot apply a delta whose bucket carries
        ``names``: no map or version held, deltas refused for this model, or a manifest of another base."""
        manifests = [m for m in (parse_manifest_name(n) for n in names) if m is not None]
        if self.map is not None and self.map.refuse:
            raise DeltaBaseError(f"this worker holds {self.held!r} but takes no delta of this model: "
                                 f"{self.map.refuse}; nothing was written (update it whole)")
        for base, version, _, _ in manifests:
            if base != self.held or self.map is None:
                raise DeltaBaseError(f"this worker holds {self.held!r}, not the base {base!r} of the delta of "
                                     f"{version!r}: nothing was written (update it whole)")
        if self.held is None or self.map is None:
            raise DeltaBaseError("this worker holds None, not the base of this delta: no full update with deltas "
                                 "made a version live here; nothing was written (update it whole)")

    # -- one load -------------------------------------------------------------------
    def load(self, model: torch.nn.Module, device: torch.device, version: str | None, keep: bool,
             session: bool, timeout: float) -> "DeltaLoad":
        """One load op; ``timeout``: the op's own bound in seconds (its host copies wait no longer)."""
        self.model, self.device, self.session = model, device, session
        self.guard(model)
        return DeltaLoad(self, model, version, keep, timeout)


def post_process(model: torch.nn.Module, device, modules: list[str] | None) -> None:
    """What SGLang 0.5.17's IPC route runs after loading, for ``modules`` (None: every module, and the
    model's ``post_load_weights``): each quantized module's ``process_weights_after_loading``."""
    try:
        from sglang.srt.model_loader.loader import device_loading_context
    except ImportError:   # pragma: no cover - moved in a later release, or outside SGLang
        device_loading_context = None
    wanted = None if modules is None else set(modules)
    for qname, module in model.named_modules():
        if wanted is not None and qname not in wanted:
            continue
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            with device_loading_context(module, device) if device_loading_context and device is not None \
                    else nullcontext():
                method.process_weights_after_loading(module)
    if modules is None and hasattr(model, "post_load_weights"):
        model.post_load_weights()


class DeltaLoad:
    """One ``load`` op: a full update (recorded and kept when ``keep``) or a delta (its payloads held
    until every bucket arrived, then applied by the stock loop's post hook). Use :meth:`transaction`
    around the whole op, TP agreement included: leaving it by an exception undoes the delta."""

    def __init__(self, state: SglangDeltas, model: torch.nn.Module, version: str | None, keep: bool,
                 timeout: float):
        self.state, self.model, self.version, self.keep, self.timeout = state, model, version, keep, timeout
        self.delta: bool | None = None   # decided by the first bucket
        self.stash: Weights = []
        self.names: list[str] = []
        self.recorder: _Recorder | None = None
        self.before: dict[str, tuple[torch.Tensor, int]] = {}
        self.kept: dict[str, torch.Tensor] = {}
        self.cb = None
        self.figures: dict = {}
        self.wrote = False   # set just before it first writes into the model (load_weights, a delta's apply)

    def transaction(self):
        rx = self.state.rx
        return _Transaction(self, rx)

    # -- the stock loop's callbacks --------------------------------------------------
    def run(self, weights: Weights) -> None:
        names = [n for n, _ in weights]
        delta = any(is_delta_name(n) for n in names)
        if self.delta is None:
            self.delta = delta
            if not delta and self.keep:
                storages = _param_storages(self.model)
                self.before = {n: (p, p.data_ptr()) for group in storages.values() for n, p in group}
                self.recorder = _Recorder(storages)
        if delta != self.delta or (delta and not all(is_delta_name(n) for n in names)):
            raise CheckpointFormatError("an update mixes delta payloads and whole tensors")
        if delta:
            self.state.check_bucket(names)   # refused at once, nothing written, when it cannot apply here
            self.names.extend(names)
            self.stash.extend((n, t.clone()) for n, t in weights)   # the IPC buffer is reused
            return
        if self.recorder is not None:
            self.kept.update(zip(names, self.state.host_copies(weights, self.timeout)))
            self.recorder.add_sources(weights)
            try:
                with torch.no_grad(), self.state.ours(), self.recorder:
                    self.wrote = True
                    self.model.load_weights(weights)
            finally:
                self.recorder.clear_sources()
        else:
            with self.state.ours():
                self.wrote = True
                self.model.load_weights(weights)

    def post_hook(self) -> None:
        """A delta: every bucket arrived (the PS agreed it on every rank): check and apply it."""
        if not self.delta:
            return
        if self.cb is None:
            raise RuntimeError("DeltaLoad.post_hook outside its transaction")
        self.cb.on_plan([(n, "uint8", ()) for n in self.names])   # the base check, every manifest
        self._check_version()
        stale = self.state.map.stale(self.model) if self.state.map is not None else None
        if stale:
            raise DeltaBaseError(f"{stale}; nothing was written (update it whole)")
        self.state.reload_figures = {}
        self.wrote = True   # scattered or reloaded from here on (undone if the delta fails)
        self.cb.run(self.stash)
        self.cb.post_hook()
        self.stash = []

    def _check_version(self) -> None:
        if self.cb is None or self.cb.delta is None:
            return
        _, version = self.cb.delta
        if self.version is not None and str(self.version) != version:
            raise ConfigError(f"the load names version {self.version!r}, but the delta it received is of {version!r}")

    # -- after the loop ------------------------------------------------------------------
    def finish_full(self) -> None:
        """A full update's end (after SGLang's post-load processing): the map, and the kept copies trimmed."""
        st = self.state
        if not self.keep or self.recorder is None:
            return
        t0 = time.perf_counter()
        try:
            dmap = build_map(self.model, self.recorder, self.before, self.kept)
        except Exception as exc:   # noqa: BLE001 - a map that cannot be built refuses deltas, not the update
            log.exception("ckpt deltas: cannot map the model; deltas are refused until the next full update")
            dmap = DeltaMap(refuse=f"the map of the model failed ({type(exc).__name__}: {exc})")
        dmap.seconds["map"] = time.perf_counter() - t0
        st.map = dmap
        keep = {n for g in dmap.groups for n in g}
        st.rx.kept = {} if dmap.refuse else {n: t for n, t in self.kept.items() if n in keep}
        self.kept = {}
        kept_bytes = sum(t.numel() * t.element_size() for t in st.rx.kept.values())
        self.figures["map"] = dict(dmap.figures(), kept_bytes=kept_bytes, recorded_writes=len(self.recorder.writes))
        self.recorder = None
        if dmap.refuse:
            log.warning("ckpt deltas: refused for this model: %s", dmap.refuse)


class _Transaction:
    """``DeltaReceiver.update`` around one load; see :meth:`DeltaLoad.transaction`."""

    def __init__(self, load: DeltaLoad, rx: DeltaReceiver):
        self.load, self.rx = load, rx
        self._cm: Any = None

    def __enter__(self) -> DeltaLoad:
        load = self.load
        self._cm = self.rx.update(run=lambda w: None, version=load.version if load.keep else None)
        load.cb = self._cm.__enter__()
        return load

    def __exit__(self, exc_type, exc, tb):
        load, cm = self.load, self._cm
        if cm is None:
            return False
        if exc_type is not None and load.delta is False and load.wrote:
            load.state.forget()   # a failed full load that wrote: the model may hold a mix
        suppressed = cm.__exit__(exc_type, exc, tb)
        if exc_type is None:
            if load.delta:
                load.figures["delta"] = dict(self.rx.last, **load.state.reload_figures)
            elif not load.keep or load.delta is None:
                load.state.forget()   # an update without deltas (or of no tensor, so unmapped): no delta after it
        return suppressed
