"""What ckpt_vllm needs from vLLM, found by feature rather than by name, for vLLM 0.26 to 0.33.

Layerwise reload (``vllm.model_executor.model_loader.reload``) is where the releases differ:

- is a layer processed only at the end (attention)? 0.26 - 0.2x:
  ``isinstance(layer, (Attention, MLAAttention))``; later: ``layers.attention.is_deferred_attention_layer``.
- tensors no weight loader ever fills: 0.26 - 0.2x: ``reload.meta.SKIP_TENSORS``; later:
  ``reload.meta.SKIP_LOAD_TENSORS``.

Optional: ``layers.quantization.kv_cache.BaseKVCacheMethod`` (the attention layers' q/k/v scale
method of quantized models); without it those scales are left as vLLM's reload leaves them.

Everything else used (``initialize_layerwise_reload``, ``finalize_layerwise_reload``,
``layerwise.LAYERWISE_INFO``, ``layerwise._place_kernel_tensors`` and the fields of
``LayerReloadingInfo``) is present in every supported release; a vLLM without one of them is
refused with a :class:`~ckpt_core.errors.ConfigError` naming what is missing, before any weight
is touched. ``reload_api()`` reads vLLM once per process.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ckpt_core.errors import ConfigError

if TYPE_CHECKING:
    from inspect import BoundArguments

    import torch

__all__ = ["LayerInfo", "ReloadApi", "reload_api", "detect", "SUPPORTED"]

SUPPORTED = "vLLM 0.26 - 0.33"
_RELOAD = "vllm.model_executor.model_loader.reload"
_INFO_FIELDS = ("restore_metadata", "load_numel", "load_numel_total", "loaded_weights", "kernel_tensors")
_INFO_METHODS = ("can_load", "reset")


class LayerInfo(Protocol):
    """vLLM's ``LayerReloadingInfo`` (``reload.types``) of one layer, as ckpt_vllm reads it
    (``_INFO_FIELDS``, ``_INFO_METHODS``: checked present by :func:`detect`).

    ``restore_metadata``, ``kernel_tensors``: (parameters, buffers) by name, in checkpoint format
    and the live (kernel) ones; ``load_numel_total`` is set (not None) once the layer ``can_load()``;
    ``loaded_weights``: the buffered ``(parameter name, weight loader arguments)`` of each tensor
    received.
    """

    restore_metadata: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]
    load_numel: int
    load_numel_total: int | None
    loaded_weights: list[tuple[str, BoundArguments]]
    kernel_tensors: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None

    def can_load(self) -> bool: ...

    def reset(self) -> None: ...


@dataclass(frozen=True)
class ReloadApi:
    """The pieces of vLLM's layerwise reload that :mod:`ckpt_vllm._reload` drives."""

    version: str
    initialize: Callable            # initialize_layerwise_reload(model)
    finalize: Callable              # finalize_layerwise_reload(model, model_config)
    layerwise_info: Any             # WeakKeyDictionary: layer -> LayerReloadingInfo
    place_kernel_tensors: Callable  # (layer, info): put a layer's live tensors back
    is_deferred_attention: Callable  # (layer) -> bool
    skip_load_tensors: frozenset    # tensor names no weight loader fills
    kv_cache_method: type | None = None  # quantization.kv_cache.BaseKVCacheMethod (attention scales)


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def detect(import_module: Callable[[str], Any] = _import) -> ReloadApi:
    """Find the reload API in the vLLM that ``import_module`` sees (tests pass fakes)."""
    vllm = import_module("vllm")
    if vllm is None:
        raise ConfigError(f"vLLM is not importable here; ckpt_vllm's worker side supports {SUPPORTED}")
    version = str(getattr(vllm, "__version__", "unknown"))
    reload, layerwise, meta = (import_module(f"{_RELOAD}{m}") for m in ("", ".layerwise", ".meta"))
    types = import_module(f"{_RELOAD}.types")
    missing = [] if reload is not None else [_RELOAD]
    attrs = {"initialize": (reload, "initialize_layerwise_reload"), "finalize": (reload, "finalize_layerwise_reload"),
             "layerwise_info": (layerwise, "LAYERWISE_INFO"),
             "place_kernel_tensors": (layerwise, "_place_kernel_tensors")}
    found = {}
    for key, (module, name) in attrs.items():
        if module is None or not hasattr(module, name):
            missing.append(f"{_RELOAD}{'.layerwise' if module is layerwise else ''}.{name}")
        else:
            found[key] = getattr(module, name)
    info_cls = getattr(types, "LayerReloadingInfo", None) if types is not None else None
    if info_cls is None:
        missing.append(f"{_RELOAD}.types.LayerReloadingInfo")
    else:
        fields = set(getattr(info_cls, "__dataclass_fields__", {}))
        missing += [f"LayerReloadingInfo.{f}" for f in _INFO_FIELDS if f not in fields]
        missing += [f"LayerReloadingInfo.{m}()" for m in _INFO_METHODS if not callable(getattr(info_cls, m, None))]
    skip = _skip_load_tensors(meta, missing)
    deferred = _deferred_attention(import_module, missing)
    if missing:
        raise ConfigError(f"vLLM {version} lacks what ckpt_vllm's weight updates need: {', '.join(missing)} "
                          f"(supported: {SUPPORTED})")
    kv = import_module("vllm.model_executor.layers.quantization.kv_cache")
    return ReloadApi(version=version, skip_load_tensors=skip, is_deferred_attention=deferred,
                     kv_cache_method=getattr(kv, "BaseKVCacheMethod", None) if kv is not None else None, **found)


def _skip_load_tensors(meta, missing: list[str]) -> frozenset:
    if meta is not None and hasattr(meta, "SKIP_LOAD_TENSORS"):
        return frozenset(meta.SKIP_LOAD_TENSORS)
    if meta is not None and hasattr(meta, "SKIP_TENSORS"):
        # Until SKIP_LOAD_TENSORS was split off, SKIP_TENSORS was that set (bias was not in it).
        return frozenset(meta.SKIP_TENSORS) - {"bias"}
    missing.append(f"{_RELOAD}.meta.SKIP_LOAD_TENSORS (or SKIP_TENSORS)")
    return frozenset()


def _deferred_attention(import_module: Callable[[str], Any], missing: list[str]) -> Callable:
    attention = import_module("vllm.model_executor.layers.attention")
    if attention is not None and callable(getattr(attention, "is_deferred_attention_layer", None)):
        return attention.is_deferred_attention_layer
    classes = tuple(getattr(attention, n) for n in ("Attention", "MLAAttention")
                    if attention is not None and isinstance(getattr(attention, n, None), type))
    if not classes:
        missing.append("vllm.model_executor.layers.attention.is_deferred_attention_layer (or Attention)")
        return lambda layer: False
    return lambda layer: isinstance(layer, classes)   # what 0.26's layerwise reload itself tests


@functools.lru_cache(maxsize=1)
def reload_api() -> ReloadApi:
    """The reload API of the installed vLLM (found once per process); ConfigError if unsupported."""
    return detect()
