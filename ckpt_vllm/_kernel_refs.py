"""Kernels that point into their layer's tensors stay right through vLLM's layerwise reload.

Two things vLLM-CPU's oneDNN W8A8 layers lose in vLLM's layerwise reload, which this module keeps:
the tensors their kernel's handle points to (:func:`install`), and the empty ``weight`` slot of a
layer put back unprocessed (:func:`empty_slots`, :func:`restore_empty_slots`).

vLLM-CPU's int8 W8A8 linear kernel on x86 without AMX (``CPUInt8ScaledMMLinearKernel``'s oneDNN
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
from importlib import import_module

import torch

log = logging.getLogger("ckpt_vllm")
KEPT = "_ckpt_pointed_tensors"   # on the oneDNN handle: the tensors its raw pointers read
_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
_COPY = "_copy_and_restore_kernel_tensors"
_MAX_DEPTH = 3   # layer -> quant_method -> scheme -> kernel
_warned: list[str] = []


def pointer_kernels(layer: torch.nn.Module):
    """The kernel objects under ``layer`` (its quant method, scheme, ...) that hold a oneDNN handle
    and name the layer tensors they were built from (``layer_param_names``)."""
    seen, todo = set(), [(layer, 0)]
    while todo:
        obj, depth = todo.pop()
        for value in vars(obj).values():
            if id(value) in seen or isinstance(value, (torch.nn.Module, torch.Tensor)) or not hasattr(value, "__dict__"):
                continue
            seen.add(id(value))
            if getattr(value, "dnnl_handler", None) is not None and getattr(value, "layer_param_names", None):
                yield value
            elif depth + 1 < _MAX_DEPTH:
                todo.append((value, depth + 1))


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


def install(module=None) -> bool:
    """Wrap vLLM's copy of processed tensors into a layer's live ones (once per process); False when
    this vLLM has no such step (nothing to wrap: logged once)."""
    try:
        layerwise = module if module is not None else import_module(_LAYERWISE)
    except ImportError:
        layerwise = None
    original = getattr(layerwise, _COPY, None)
    if original is None:
        if not _warned:
            _warned.append(_COPY)
            log.warning("vLLM's layerwise reload has no %s.%s: oneDNN W8A8 kernels are not re-checked", _LAYERWISE,
                        _COPY)
        return False
    if getattr(original, "_ckpt_keeps_pointed_tensors", False):
        return True

    @functools.wraps(original)
    def copy_and_restore(layer, info):
        keep_pointed_tensors(layer)
        return original(layer, info)

    copy_and_restore._ckpt_keeps_pointed_tensors = True
    setattr(layerwise, _COPY, copy_and_restore)
    return True
