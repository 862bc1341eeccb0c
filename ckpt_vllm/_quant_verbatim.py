"""Which quantized vLLM layers keep their weights as loaded, so that a delta or a direct update may write
into them in place (issue 38: an FP8 MoE reloaded through vLLM's per-expert loader costs 66x the
transfer floor; issue 39: the same for deltas).

A layer with a quantization method is reloaded by default (``_delta_map.verbatim_layer``): its method's
``process_weights_after_loading`` may repack, requantize or transpose what was loaded, or build a kernel
that holds a processed copy. Two proofs together let such a layer through, and both must hold:

- **its method is one whose processing keeps the checkpoint's tensors as loaded**, decided by the method
  and the kernel vLLM picked for it, as read in vLLM 0.26's sources (``KEEPS_LOADED``): FP8 block
  quantization (``weight_scale_inv``, 128x128 blocks) served by the CUTLASS or Triton block-scaled linear
  kernel (their processing leaves weight and scale alone unless the platform is FNUZ or the weight is
  padded, which changes the bytes or the shape: the map's own checks catch both), and the FP8 block MoE
  on the Triton backends (no layout change for those backends). Marlin, DeepGEMM, FlashInfer, AITER,
  per-tensor FP8 (requantized to one scale per shard) and every other method are not listed: reloaded.
  A method of another vLLM version that lacks the attributes read here is not listed either.
- **every tensor reachable from the method is one of the layer's live parameters**, viewed the same way
  (same storage, offset, shape, strides, dtype): its kernel objects, quantization configs, closures,
  dicts and lists are walked a few levels deep (:func:`foreign_tensors`). A tensor that is not a live
  parameter may be a processed copy an in-place write would leave stale: the layer is reloaded and the
  map says which tensor held it back.

The map still checks each region's bytes after the load against the checkpoint's (``lin64``), and a
direct update or delta still reports the engine's state; this module only lifts the blanket refusal.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Iterator

import torch

__all__ = ["KEEPS_LOADED", "aliases_own", "foreign_tensors", "quantized_as_loaded"]

_VLLM = "vllm"
_MAX_DEPTH = 5   # method -> moe_kernel -> fused_experts -> quant_config -> desc -> scale


def _name(obj: Any) -> str | None:
    return None if obj is None else type(obj).__name__


def _fp8_linear(method: Any) -> str | None:
    if getattr(method, "block_quant", None) is not True:
        return "not block-quantized (per-tensor FP8 is requantized to one scale per fused shard)"
    if getattr(method, "use_marlin", None) is not False:
        return "served by Marlin (repacked) or of a vLLM version this check does not know"
    kernel = _name(getattr(method, "fp8_linear", None))
    if kernel not in ("CutlassFp8BlockScaledMMKernel", "TritonFp8BlockScaledMMKernel"):
        return f"its kernel {kernel} may process the weights (only the CUTLASS and Triton block kernels keep them)"
    return None


def _fp8_moe(method: Any) -> str | None:
    if getattr(method, "block_quant", None) is not True:
        return "not block-quantized (per-tensor FP8 MoE is requantized to one w13 scale per expert)"
    backend = getattr(getattr(method, "fp8_backend", None), "name", None)
    if backend not in ("TRITON", "BATCHED_TRITON"):
        return f"its backend {backend} may convert the experts' layout (only the Triton backends keep it)"
    return None


# Method class name -> why its processing may change what was loaded (None: it keeps it).
KEEPS_LOADED = {"Fp8LinearMethod": _fp8_linear, "Fp8MoEMethod": _fp8_moe}


def quantized_as_loaded(layer: torch.nn.Module, method: Any) -> str | None:
    """None when ``layer``'s quantization ``method`` provably reads the layer's parameters as loaded (see
    the module doc), else why not."""
    name = type(method).__name__
    rule = KEEPS_LOADED.get(name)
    if rule is None:
        return f"quantization method {name}"
    why = rule(method)
    if why is not None:
        return f"quantization method {name}: {why}"
    if getattr(getattr(layer, "w13_weight", None), "is_shuffled", False):
        return f"quantization method {name}: its experts are marked shuffled"
    try:
        foreign = next(foreign_tensors(layer, method), None)
    except Exception as exc:   # noqa: BLE001 - an object that cannot be walked proves nothing: reloaded
        return f"quantization method {name}: its objects could not be walked ({type(exc).__name__}: {exc})"
    if foreign is not None:
        path, t = foreign
        return (f"quantization method {name} holds {path} ({list(t.shape)} {t.dtype}), which is not one of "
                f"the layer's live parameters (maybe a processed copy)")
    return None


def _view_key(t: torch.Tensor) -> tuple:
    return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), tuple(t.stride()))


def _own_views(layer: torch.nn.Module) -> set[tuple]:
    return {_view_key(t) for t in [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]
            if t is not None and t.device.type != "meta"}


def aliases_own(layer: torch.nn.Module, t: torch.Tensor) -> bool:
    """Whether ``t`` is, view for view, one of ``layer``'s own parameters or buffers (a reference a kernel
    or config keeps to it, which an in-place write updates with it): not a derived copy."""
    return t.device.type != "meta" and _view_key(t) in _own_views(layer)


def foreign_tensors(layer: torch.nn.Module, root: Any,
                    path: str = "quant_method") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``root`` that is not a view-for-view alias of one of ``layer``'s own
    parameters or buffers, with the attribute path it was found at. Walks vLLM's own objects, dicts,
    lists, tuples, sets and function closures, ``_MAX_DEPTH`` levels deep; a module other than ``layer``
    counts by its parameters and buffers (a kernel's own module holding a weight copy is foreign)."""
    own = _own_views(layer)
    seen: set[int] = {id(layer)}

    def walk(value: Any, where: str, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
        if value is None or isinstance(value, (str, bytes, int, float, bool, type, types.ModuleType)):
            return
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if value.device.type != "meta" and _view_key(value) not in own:
                yield where, value
            return
        if isinstance(value, torch.nn.Module):
            for n, t in [*value.named_parameters(), *value.named_buffers()]:
                yield from walk(t, f"{where}.{n}", depth)
            return
        if depth >= _MAX_DEPTH:
            return
        if isinstance(value, dict):
            for k, v in value.items():
                yield from walk(v, f"{where}[{k!r}]", depth + 1)
        elif isinstance(value, (list, tuple, set, frozenset)):
            for i, v in enumerate(value):
                yield from walk(v, f"{where}[{i}]", depth + 1)
        elif isinstance(value, (types.FunctionType, types.MethodType)) or (
                callable(value) and getattr(value, "__closure__", None)):
            func = getattr(value, "__func__", value)
            for i, cell in enumerate(getattr(func, "__closure__", None) or ()):
                try:
                    content = cell.cell_contents
                except ValueError:   # an empty cell
                    continue
                yield from walk(content, f"{where}.closure[{i}]", depth + 1)
            bound = getattr(value, "__self__", None)
            if bound is not None:
                yield from walk(bound, f"{where}.__self__", depth + 1)
        elif isinstance(value, functools.partial):
            for i, v in enumerate((value.func, *value.args, *value.keywords.values())):
                yield from walk(v, f"{where}.partial[{i}]", depth + 1)
        elif type(value).__module__.startswith(_VLLM):
            for k, v in _fields(value):
                yield from walk(v, f"{where}.{k}", depth + 1)

    yield from walk(root, path, 0)


def _fields(obj: Any) -> list[tuple[str, Any]]:
    """An object's attributes: its ``__dict__``, its slots, a dataclass's fields."""
    out = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()) or ():
            if isinstance(slot, str) and slot not in out and hasattr(obj, slot):
                out[slot] = getattr(obj, slot)
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            out.setdefault(f.name, getattr(obj, f.name, None))
    return list(out.items())
