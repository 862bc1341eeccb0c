"""What a layer in vLLM's layerwise reload must receive, and what it still lacks, in checkpoint names.

vLLM's reload state (``LayerReloadingInfo``) counts elements and records each loaded weight with
its loader's arguments; these helpers turn that into the checkpoint names a layer reads (a fused
``qkv_proj`` is three checkpoint tensors, by the model's ``packed_modules_mapping``) and the names
of what is missing, for :class:`ckpt_vllm._reload.ReloadSession`'s completeness checks.
"""

from __future__ import annotations

import torch

from ckpt_core.errors import ConfigError

from ._compat import LayerInfo, reload_api

__all__ = ["checkpoint_names", "loadable_params", "missing_in_layer", "numel_total", "required_names"]

_QKV_SHARDS = ("q", "k", "v")


def numel_total(info: LayerInfo) -> int:
    """The elements a pending layer (``can_load()``) receives in all; vLLM sets it before that."""
    if info.load_numel_total is None:
        raise ConfigError("vLLM's reload lists a layer as loadable whose load_numel_total is not set")
    return info.load_numel_total


def missing_in_layer(model: torch.nn.Module, qname: str, layer: torch.nn.Module, info: LayerInfo) -> list[str]:
    """Names of what a pending layer lacks; checkpoint names where vLLM's mapping tells them."""
    received: dict[str, set] = {}
    for pname, args in info.loaded_weights:
        sid = args.arguments.get("loaded_shard_id")
        received.setdefault(pname, set()).add(tuple(sid) if isinstance(sid, list) else sid)
    missing = []
    for pname in loadable_params(layer, info):
        shards = received.get(pname)
        if not shards:
            missing.append(checkpoint_names(model, qname, pname, None))
            continue
        n_parts = len(getattr(layer, "output_sizes", ()) or ())
        if None in shards or n_parts <= 1:
            continue
        got: set = set()
        for s in shards:  # "q"/"k"/"v", an int, or a tuple of ints (several parts at once)
            got.update(s if isinstance(s, (tuple, list)) else [_QKV_SHARDS.index(s) if s in _QKV_SHARDS else s])
        missing += [checkpoint_names(model, qname, pname, i) for i in range(n_parts) if i not in got]
    fused = len(getattr(layer, "output_sizes", ()) or ()) > 1
    if not missing and (fused or any(hasattr(p, "weight_loader_numel") for p in layer.parameters(recurse=False))):
        # Fused linear layers have no padding, and fused MoE excludes its padding from the count:
        # any shortfall is a missing part (an expert, a bias shard, a slice) that named no parameter.
        if info.load_numel < numel_total(info):
            missing.append(f"{qname} ({info.load_numel} of {info.load_numel_total} elements)")
    return missing


def required_names(model: torch.nn.Module, qname: str, layer: torch.nn.Module,
                    info: LayerInfo) -> dict[str, list[str]]:
    """Checkpoint names a layer reads, per parameter: ``{fused name: [one name per part]}``
    (``qkv_proj.weight_scale`` -> q/k/v_proj.weight_scale; an unfused parameter is its own part)."""
    n_parts = len(getattr(layer, "output_sizes", ()) or ())
    out = {}
    for pname in loadable_params(layer, info):
        fused = checkpoint_names(model, qname, pname, None)
        out[fused] = [checkpoint_names(model, qname, pname, i) for i in range(n_parts)] if n_parts > 1 else [fused]
    return out


def loadable_params(layer: torch.nn.Module, info: LayerInfo) -> list[str]:
    """Every parameter the layer must receive: the restore metadata lists only what vLLM put back
    on the meta device, and leaves out parameters it keeps live through the reload (``bias``)."""
    SKIP_LOAD_TENSORS = reload_api().skip_load_tensors
    names = list(info.restore_metadata[0])
    names += [n for n, p in layer._parameters.items()
              if p is not None and n not in names and n not in SKIP_LOAD_TENSORS]
    return names


def checkpoint_names(model: torch.nn.Module, qname: str, pname: str, part: int | None) -> str:
    """``model.layers.0.self_attn.qkv_proj`` + part 1 -> ``model.layers.0.self_attn.k_proj.weight``."""
    prefix, _, leaf = qname.rpartition(".")
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    if part is not None and leaf in packed and part < len(packed[leaf]):
        leaf = packed[leaf][part]
    elif part is not None:
        leaf = f"{leaf}[part {part}]"
    return ".".join(x for x in (prefix, leaf, pname) if x)
