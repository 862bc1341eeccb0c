"""Where vLLM's layerwise reload leaves a layer's kernel unlike a cold load's, and what keeps it right.

- A quant method that remembers its first processing skips steps on the next one
  (:func:`process_as_cold_load`, :data:`FIRST_LOAD_STATE`).
- vLLM-CPU's oneDNN W8A8 kernel points into tensors the reload drops (:func:`install`), and its
  layer's empty ``weight`` slot is deleted when the layer is put back unprocessed
  (:func:`empty_slots`, :func:`restore_empty_slots`).
- vLLM 0.26 re-sums the bytes every buffering layer holds on each weight a layer receives while
  two layers buffer at once, only to word a warning: quadratic in a MoE layer's experts
  (:func:`quiet_buffer_accounting`).

The oneDNN case: vLLM-CPU's int8 W8A8 linear kernel on x86 without AMX (``CPUInt8ScaledMMLinearKernel``'s oneDNN
path: AMD EPYC, Intel before Sapphire Rapids; with AMX it takes another kernel) builds a oneDNN
handle that keeps a raw pointer to the layer's weight scales it was built from. vLLM's layerwise
reload processes a completed layer into new tensors, then copies their values into the layer's
original (live) tensors and drops the new ones (``layerwise._copy_and_restore_kernel_tensors``,
which keeps CUDA graphs' addresses). The handle built during that processing then points to freed
memory and the layer computes with whatever the allocator puts there next: on an AMD EPYC every
W8A8 layer's output differed from a cold load's after an update, and differed again after a
second, identical one, while the update reported success.

:func:`install` wraps that copy so that, first, the tensors such a kernel was built from are kept
alive by the kernel's handle itself (they are the layer's scales and zero points: a few floats per
output channel; the weight is prepacked into the handle and was released). The handle's values
equal the live tensors' (the copy just wrote them there), and the kept tensors go when the handle
does (the next update's processing replaces it).
"""

from __future__ import annotations

import functools
import logging
from contextlib import contextmanager
from importlib import import_module
from typing import Iterator

import torch

log = logging.getLogger("ckpt_vllm")
KEPT = "_ckpt_pointed_tensors"   # on the oneDNN handle: the tensors its raw pointers read
_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
_COPY = "_copy_and_restore_kernel_tensors"
_DEVICE_CHECK = "has_device_tensors"
_MAX_DEPTH = 3   # layer -> quant_method -> scheme -> kernel
_VLLM = "vllm."   # the module prefix of the objects looked into (tests give theirs one)
_warned: list[str] = []


def pointer_kernels(layer: torch.nn.Module):
    """The kernel objects under ``layer`` (its quant method, scheme, ...) that hold a oneDNN handle
    and name the layer tensors they were built from (``layer_param_names``). Only vLLM's own objects
    are looked into (not classes, modules or functions they may hold), a few levels deep."""
    seen, todo = set(), [(layer, 0)]
    while todo:
        obj, depth = todo.pop()
        for value in vars(obj).values():
            if id(value) in seen or not _vllm_object(value):
                continue
            seen.add(id(value))
            if getattr(value, "dnnl_handler", None) is not None and getattr(value, "layer_param_names", None):
                yield value
            elif depth + 1 < _MAX_DEPTH:
                todo.append((value, depth + 1))


def _vllm_object(value) -> bool:
    return (hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module, torch.Tensor))
            and not callable(value) and type(value).__module__.startswith(_VLLM))


def keep_pointed_tensors(layer: torch.nn.Module) -> int:
    """Tie the tensors each oneDNN kernel of ``layer`` was built from to its handle; how many kernels."""
    kernels = list(pointer_kernels(layer))
    for kernel in kernels:
        held = tuple(t for name in kernel.layer_param_names if name
                     and isinstance(t := getattr(layer, name, None), torch.Tensor))
        setattr(kernel.dnnl_handler, KEPT, held)
    return len(kernels)


def empty_slots(modules) -> list[tuple[torch.nn.Module, list[str], list[str]]]:
    """(layer, parameter names, buffer names) registered as None on each of ``modules``' layers that has
    any. The same oneDNN kernel releases its layer's ``weight`` (``weight = None``: prepacked into the
    handle). vLLM's reload records only the tensors a layer holds, so putting a layer back
    unprocessed (an aborted update, a slice recording) deletes such a slot with the checkpoint-format
    tensor that filled it, and the kernel's next ``getattr(layer, "weight")`` raises: the engine fails
    every request. :func:`restore_empty_slots` puts them back."""
    out = []
    for layer in modules:
        params = [n for n, t in layer._parameters.items() if t is None]
        buffers = [n for n, t in layer._buffers.items() if t is None]
        if params or buffers:
            out.append((layer, params, buffers))
    return out


def restore_empty_slots(slots) -> int:
    """Register again, as None, each slot of :func:`empty_slots` a layer lost; how many."""
    put = 0
    for layer, params, buffers in slots:
        for name in params:
            if name not in layer._parameters:
                layer.register_parameter(name, None)
                put += 1
        for name in buffers:
            if name not in layer._buffers:
                layer.register_buffer(name, None)
                put += 1
    return put


@contextmanager
def quiet_buffer_accounting(module=None) -> Iterator[bool]:
    """While our buckets load, vLLM's layerwise loader sees no device tensors for its buffer warning.

    vLLM 0.26's ``online_process_loader`` asks ``has_device_tensors`` on every weight a layer
    receives; when two or more layers are buffering it sums the bytes of every weight each of them
    has buffered (``get_info_size``) and logs a ``warning_once`` whose text carries that sum, so it
    is logged again each time. A fused MoE layer receives one call per expert and projection, so
    this grows with the square of its experts: on one H200, 3.3 s and 3,140 log lines of a 5.7 s
    update of a 4,719-tensor Qwen3-MoE (vLLM-CPU 0.32 already checks once per layer). The answer feeds only that
    advisory warning and its ``LOADING_LAYERS`` set (cleared at finalize), never what a layer loads
    or when it is processed; yields whether there was a check to quiet. Restored on the way out,
    also on failure.
    """
    layerwise = _layerwise(module)
    original = getattr(layerwise, _DEVICE_CHECK, None)
    if original is None:
        yield False
        return
    setattr(layerwise, _DEVICE_CHECK, _no_device_tensors)
    try:
        yield True
    finally:
        setattr(layerwise, _DEVICE_CHECK, original)


def _no_device_tensors(bound_args) -> bool:
    return False


def _layerwise(module=None):
    """vLLM's layerwise reload module (``module`` where a test gives its own), None without vLLM."""
    if module is not None:
        return module
    try:
        return import_module(_LAYERWISE)
    except ImportError:
        return None


def install(module=None) -> bool:
    """Wrap vLLM's copy of processed tensors into a layer's live ones (once per process); False when
    this vLLM has no such step (nothing to wrap: logged once)."""
    layerwise = _layerwise(module)
    original = getattr(layerwise, _COPY, None)
    if original is None:
        if not _warned:
            _warned.append(_COPY)
            # Only vLLM-CPU's oneDNN W8A8 kernel (x86 without AMX) needs the wrap; say it, quietly.
            log.info("vLLM's layerwise reload has no %s.%s to wrap: tensors a oneDNN W8A8 handle points to are not "
                     "kept", _LAYERWISE, _COPY)
        return False
    if getattr(original, "_ckpt_keeps_pointed_tensors", False):
        return True

    @functools.wraps(original)
    def copy_and_restore(layer, info):
        keep_pointed_tensors(layer)
        return original(layer, info)

    setattr(copy_and_restore, "_ckpt_keeps_pointed_tensors", True)   # a mark on vLLM's function: wrapped once
    setattr(layerwise, _COPY, copy_and_restore)
    return True


# Attributes a quant method sets when it first processes a layer and reads on a later call to
# decide that this is "a weight update" of an already processed layer, and then skips steps.
# vLLM 0.32's UnquantizedFusedMoEMethod._setup_kernel does so with ``moe_kernel``: it skips
# ``moe_kernel.fused_experts.process_weights_after_loading(layer)``, where vLLM-CPU's
# CPUUnquantizedExperts repacks w13/w2 (``cpu_prepack_moe_weight``) and pads the intermediate
# dimension. Under layerwise reload the layer is rebuilt in checkpoint format, so those steps
# must run again: the repack was skipped and the kernel read checkpoint-layout bytes as packed
# ones (issue 21, item 0).
FIRST_LOAD_STATE = ("moe_kernel",)


def process_as_cold_load(model: torch.nn.Module) -> list:
    """Make every quant method with first-load state process its layer as a cold load does.

    For the session, ``process_weights_after_loading`` of each such method (an instance
    attribute, removed by :func:`restore_processing`) clears that state before running the
    method's own code, so it takes its first-load path (new kernel tensors, the kernel rebuilt
    from them, the experts' own repack); vLLM then copies the result into the live tensors.
    """
    wrapped = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if (method is None or "process_weights_after_loading" in vars(method)
                or not any(getattr(method, a, None) is not None for a in FIRST_LOAD_STATE)):
            continue
        method.process_weights_after_loading = _cold_processing(method, method.process_weights_after_loading)
        wrapped.append(method)
    return wrapped


def _cold_processing(method, original):
    def process_weights_after_loading(layer: torch.nn.Module) -> None:
        saved = {a: getattr(method, a) for a in FIRST_LOAD_STATE if hasattr(method, a)}
        for a in saved:
            setattr(method, a, None)
        try:
            original(layer)
        except BaseException:
            for a, value in saved.items():   # the layer keeps its old kernel (abort restores its tensors)
                setattr(method, a, value)
            raise
    return process_weights_after_loading


def restore_processing(methods: list) -> None:
    while methods:
        vars(methods.pop()).pop("process_weights_after_loading", None)
