"""Folding a chain of deltas into one: version D's delta from an older version A, for engines that hold A.

The PS keeps every registered version whole, so a fold is exact and built from what is registered on
this rank (``ParameterServer.fold_delta``, ``dispatch.Updates.fold``):

- **A still registered**: each tensor of D is encoded against A's (``encode.encode_tensor``): the
  fold is byte for byte the delta D would have had if it had been registered with ``base="A"``.
- **A unregistered** (RL loops drop old versions), the chain A -> B -> C -> D registered as deltas
  (B, C, D and their companions on this rank): per tensor, the union of the positions each step
  changed (``fold_tensor``: the payloads of ``B@delta``, ``C@delta``, ``D@delta`` decoded on the host,
  with their checks), written with D's values. An element outside the union is the same in A and D
  (no step changed it); one inside it may have come back to its A value in a later version, and
  sending D's value for it writes the value the engine already holds: harmless. Dropping such
  elements would need A's bytes, which are gone, so they are kept: the fold is lossless and at most
  the size of the chain's union. A tensor some step sent whole (new in the chain, reshaped, retyped,
  or changed almost everywhere) goes whole.

Either way the payloads use ``encode.py``'s encodings and format, in the smallest encoding as
``encode_tensor`` picks it, and carry D's ``lin64`` digest: an engine worker decodes a fold like any
delta and checks the full result against D after the apply, so the fold is checked end to end.
"""

from __future__ import annotations

import numpy as np
import torch

from ckpt_core.delta.encode import decode, encode_changes
from ckpt_core.errors import CheckpointFormatError


def fold_tensor(new: torch.Tensor, steps: list[torch.Tensor | None],
                name: str = "?") -> tuple[torch.Tensor | None, dict]:
    """The payload that turns the oldest version of a chain into ``new`` (the newest version's tensor),
    from ``steps``: each step's payload of this tensor, oldest first (None: the step did not change it).
    None when no step changed it. Each payload is decoded with its checks (a corrupted one raises
    ``CheckpointFormatError`` naming ``name``). See the module docstring for why the union is lossless."""
    new = new.detach().contiguous()
    parts: list[np.ndarray] = []
    whole = False
    digest = None   # the last step's: the later steps left this tensor's bytes as they were
    for payload in steps:
        if payload is None:
            continue
        d = decode(payload.reshape(-1).cpu(), name)
        digest = d.digest
        if d.positions is None or d.dtype != new.dtype or d.shape != tuple(new.shape):
            whole = True   # new, reshaped or retyped somewhere in the chain, or sent whole: D's tensor whole
            continue
        parts.append(d.positions.numpy())
    if digest is None:
        return None, {"encoding": None, "count": 0, "numel": new.numel(), "bytes": 0}
    if whole:
        return encode_changes(new, None, digest=digest)
    union = np.unique(np.concatenate(parts)) if len(parts) > 1 else parts[0]
    if union.size and union[-1] >= new.numel():
        raise CheckpointFormatError("a step of the chain changes a position beyond the tensor", tensor=name)
    return encode_changes(new, union, digest=digest)


__all__ = ["fold_tensor"]
