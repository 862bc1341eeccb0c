"""Digests of everything a vLLM model's forward pass reads, to compare an engine with a cold load.

``state_digests(model)`` returns ``{name: [dtype, shape, sha256]}`` for

- every parameter and buffer of every module (tied aliases under each name they have);
- *derived* tensors vLLM keeps outside the parameters: tensors held directly in a module's
  ``__dict__``, in the closure of a callable attribute (vLLM-CPU's ``cpu_linear`` closes over
  the repacked weight and leaves ``weight`` with shape [0]), and in the module's
  ``quant_method`` and its kernel objects (one level down: ``moe_kernel.fused_experts``...);
- (not the attention layers' ``kv_cache``: runtime state, see ``NOT_WEIGHTS``);
- a *probe* per linear-like layer: its ``quant_method.apply`` on a fixed random input. This
  reaches kernel state that is no tensor at all (a oneDNN handle holding a reordered copy of the
  weight): equal bytes out of the same kernel on the same input means equal weights in it.

Two engines started with the same vLLM, flags and checkpoint give equal digests; an update that
leaves anything the forward pass reads different from a cold load shows up under its name.
Runs inside a vLLM worker (``VllmColocateWorkerExtension.ckpt_state_digests``); imports torch only.
"""

from __future__ import annotations

import hashlib
from typing import Iterator

import torch

from ._reload_fixes import KEPT

__all__ = ["state_digests", "tensor_digest"]

_PROBE_ROWS = 3
_PROBE_SEED = 20251201
# Runtime state, not weights: the attention layers' KV cache (it holds what requests computed).
NOT_WEIGHTS = frozenset({"kv_cache"})
# Attributes of kernel objects that are not weights of their own: a oneDNN handle's pointer (vLLM-CPU's
# ``CPUDNNLGEMMHandler.handler_tensor``, an address, different in every process; the layer's probe
# reads what the handle computes with), and the tensors an update keeps alive for that handle
# (``_reload_fixes.KEPT``: the processed scales, whose values are the layer's live ones, digested).
NOT_DERIVED = frozenset({"handler_tensor", KEPT})
_MAX_DEPTH = 3   # quant_method -> moe_kernel -> fused_experts -> its tensors


def tensor_digest(t: torch.Tensor) -> list:
    """[dtype, shape, sha256 of the bytes] of one tensor (meta tensors: sha256 'meta')."""
    if t.is_meta:
        return [str(t.dtype).removeprefix("torch."), list(t.shape), "meta"]
    data = t.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous().reshape(-1)
    raw = data.view(torch.uint8) if data.numel() and data.element_size() else data
    sha = hashlib.sha256(raw.numpy().tobytes() if raw.numel() else b"").hexdigest()
    return [str(t.dtype).removeprefix("torch."), list(t.shape), sha]


def state_digests(model: torch.nn.Module, *, dtype: torch.dtype | None = None) -> dict[str, list]:
    """``{name: [dtype, shape, sha256]}`` of what ``model``'s forward pass reads (see module doc)."""
    out: dict[str, list] = {}
    for qname, module in model.named_modules(remove_duplicate=False):
        prefix = f"{qname}." if qname else ""
        for name, t in list(module._parameters.items()) + list(module._buffers.items()):
            if t is not None:
                out[prefix + name] = tensor_digest(t)
        own = set(module._parameters) | set(module._buffers)
        for name, t in _derived(module, own):
            out.setdefault(f"{prefix}<{name}>", tensor_digest(t))
        probe = _probe(module, dtype)
        if probe is not None:
            out[f"{prefix}<probe>"] = tensor_digest(probe)
    return out


def _derived(module: torch.nn.Module, own: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for attr, value in vars(module).items():
        if attr.startswith("_") and attr in ("_parameters", "_buffers", "_modules"):
            continue
        if attr in own or attr in NOT_WEIGHTS:
            continue
        yield from _tensors_in(attr, value, depth=0, seen=set())


def _tensors_in(path: str, value, *, depth: int, seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    if id(value) in seen or isinstance(value, torch.nn.Module):
        return   # submodules are visited by named_modules
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            if isinstance(v, torch.Tensor):
                yield f"{path}[{i}]", v
    elif callable(value) and getattr(value, "__closure__", None):
        for i, cell in enumerate(value.__closure__):
            try:
                content = cell.cell_contents
            except ValueError:   # an empty cell
                continue
            if isinstance(content, torch.Tensor):
                yield f"{path}.closure[{i}]", content
    elif depth < _MAX_DEPTH and hasattr(value, "__dict__") and not isinstance(value, type) \
            and type(value).__module__.startswith("vllm"):
        for attr, v in vars(value).items():
            if attr not in NOT_DERIVED:
                yield from _tensors_in(f"{path}.{attr}", v, depth=depth + 1, seen=seen)


def _probe(module: torch.nn.Module, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``quant_method.apply(layer, x)`` of a linear-like layer on a fixed input, else None."""
    method = getattr(module, "quant_method", None)
    width = getattr(module, "input_size_per_partition", None) or getattr(module, "input_size", None)
    if width is None and hasattr(module, "org_vocab_size"):
        width = getattr(module, "embedding_dim", None)   # a (tied) lm_head is applied as a linear
    # Weight-only int4 layers (GPTQ, AWQ, compressed-tensors WNA16) have no ``weight``: their
    # repacked ``qweight``/``weight_packed`` is probed the same way.
    if (method is None or not width or not hasattr(method, "apply")
            or not (hasattr(module, "weight") or module._parameters)):
        return None
    param_dtype = getattr(module, "params_dtype", None) or dtype or torch.get_default_dtype()
    gen = torch.Generator().manual_seed(_PROBE_SEED)
    # float32 drawn, then cast: the same input whatever torch's default dtype is at the time.
    x = torch.randn(_PROBE_ROWS, int(width), generator=gen, dtype=torch.float32).to(param_dtype)
    device = _device_of(module)
    if device is not None:
        x = x.to(device)
    bias = getattr(module, "bias", None)
    with torch.no_grad():
        try:
            y = method.apply(module, x, bias) if bias is not None else method.apply(module, x)
        except Exception as exc:   # a layer the probe does not fit: say so under its name
            return torch.tensor(list(f"{type(exc).__name__}".encode()), dtype=torch.uint8)
    return y[0] if isinstance(y, tuple) else y


def _device_of(module: torch.nn.Module) -> torch.device | None:
    for t in list(module._parameters.values()) + list(module._buffers.values()):
        if t is not None and not t.is_meta:
            return t.device
    return None
