"""What one trainer rank registers, each round, from the trainer's weights.

The trainer hands :class:`ckpt_vllm.trainer.CkptTrainerWeightTransferEngine` either vLLM's
``WeightSource`` (``ModuleSource(model)``, or any object with ``metadata()``, ``__iter__`` and
optionally ``held_names()``), or named tensors (a mapping or a list of ``(name, tensor)`` pairs;
the values may be plain tensors, ``DTensor`` shards or :class:`ckpt_core.TensorShard` boxes).
Each tensor must be registered by exactly one rank (or, in pieces, tile its tensor), so:

- a ``WeightSource`` is iterated on every rank, in lockstep (materializing an FSDP parameter is a
  collective); with ``held_names()`` None every rank holds every tensor and tensor ``i`` of
  ``metadata()`` is registered by rank ``i % world``, which spreads the host copies over the
  ranks; otherwise a rank registers the tensors it holds (the holders must not overlap);
- named tensors: ``DTensor`` and ``TensorShard`` values are registered as they are (each rank its
  pieces; nothing is gathered), plain tensors round-robin over the sorted names when
  ``replicated`` (every rank holds the same ones: one process, DDP) or every one a rank holds when
  not (a pipeline stage's layers).

The round's *layout* (every name the model has, in order) goes into the checkpoint's name, which
``gather_metas`` agrees on: ranks whose sources disagree fail alike there, before any update.
Pure but for torch; no vLLM import.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckpt_core import TensorShard
from ckpt_core.checkpoint.device import in_place_problem
from ckpt_core.errors import ConfigError

__all__ = ["RoundTensors", "round_tensors", "is_weight_source", "device_resident"]


@dataclass
class RoundTensors:
    """This rank's share of one round: ``tensors`` to register; ``expected``: every name of the
    model in order (None where the ranks' names legitimately differ); ``layout``: its short digest."""

    tensors: dict[str, Any]
    expected: list[str] | None

    @property
    def layout(self) -> str:
        if self.expected is None:
            return "own"
        return hashlib.sha256("\n".join(self.expected).encode()).hexdigest()[:12]


def is_weight_source(obj: Any) -> bool:
    """vLLM's ``WeightSource`` by shape (the class exists only in vLLM >= 0.28)."""
    return callable(getattr(obj, "metadata", None)) and callable(getattr(obj, "__iter__", None))


def round_tensors(source: Any, rank: int, world: int, *, replicated: bool = True) -> RoundTensors:
    """This rank's tensors of one round of ``source`` (see the module's docstring)."""
    if source is None:
        raise ConfigError("no weights to send: pass source= to trainer_init or weights to send_weights()")
    if is_weight_source(source):
        return _from_weight_source(source, rank, world)
    if isinstance(source, Mapping):
        items = list(source.items())
    elif isinstance(source, (list, tuple)):
        items = list(source)
        if not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in items):
            raise ConfigError("named tensors must be (name, tensor) pairs")
    else:
        raise ConfigError(f"weights must be a vLLM WeightSource (e.g. ModuleSource(model)), a mapping of names to "
                          f"tensors or a list of (name, tensor) pairs; got {type(source).__name__} (a generator is "
                          "consumed once and cannot be sent again: pass a list, or the weights to each send_weights)")
    return _from_named(items, rank, world, replicated)


def _from_weight_source(source: Any, rank: int, world: int) -> RoundTensors:
    names = [_name(m.name) for m in source.metadata()]
    if len(set(names)) != len(names):
        raise ConfigError("the WeightSource's metadata() names a tensor twice")
    held_fn = getattr(source, "held_names", None)
    held = held_fn() if callable(held_fn) else None
    held = None if held is None else set(held)
    owned: dict[str, Any] = {}
    count = 0
    # Every rank iterates the whole source in metadata order: materializing a tensor may be a
    # collective among the ranks that share it (FSDP's full_tensor()).
    for count, (name, tensor) in enumerate(source, start=1):
        i = count - 1
        if i >= len(names) or name != names[i]:
            want = names[i] if i < len(names) else "nothing (metadata() has no more)"
            raise ConfigError(f"the WeightSource yielded {name!r} at position {i}; metadata() has {want}")
        mine = (name in held and tensor is not None) if held is not None else i % world == rank
        if mine:
            owned[name] = _tensor(name, tensor)
    if count != len(names):
        raise ConfigError(f"the WeightSource yielded {count} tensors; metadata() lists {len(names)}")
    return RoundTensors(owned, names)


def _from_named(items: list, rank: int, world: int, replicated: bool) -> RoundTensors:
    names = [_name(n) for n, _ in items]
    if len(set(names)) != len(names):
        raise ConfigError("the named tensors name a tensor twice")
    owned: dict[str, Any] = {}
    for i, (name, value) in enumerate(sorted(items, key=lambda p: p[0])):
        if isinstance(value, TensorShard) or _is_dtensor(value):
            owned[name] = value   # pieces: every rank registers its own (the core tiles them)
        elif not replicated or i % world == rank:
            owned[name] = _tensor(name, value)
    return RoundTensors(owned, sorted(names) if replicated else None)


def _name(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a tensor name must be a non-empty string, got {name!r}")
    return name


def _tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ConfigError(f"{name!r} is a {type(value).__name__}, not a tensor")
    return value.detach()


def _is_dtensor(value: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:   # torch without DTensor: nothing can be one
        return False
    return isinstance(value, DTensor)


def device_resident(tensors: Mapping[str, Any], device: torch.device) -> bool:
    """Whether every tensor of a share (each piece's local tensor) is a contiguous tensor on ``device``,
    a device other than the CPU: what ``CkptTrainerInitInfo(on_device=None)`` registers in place. An
    empty share: False."""
    if device.type == "cpu" or not tensors:
        return False
    for value in tensors.values():
        local = value.local if isinstance(value, TensorShard) else value.to_local() if _is_dtensor(value) else value
        if not isinstance(local, torch.Tensor) or in_place_problem("", local, device) is not None:
            return False
    return True
