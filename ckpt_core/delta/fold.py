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

from dataclasses import dataclass

import numpy as np
import torch

from ckpt_core.checkpoint.safetensors import WIRE_DTYPES
from ckpt_core.delta.encode import ENCODINGS, _align8, encode_changes, index_width, measure, read_header
from ckpt_core.delta.lin64 import is_lin64, lin64_host
from ckpt_core.errors import CheckpointFormatError


def fold_tensor(new: torch.Tensor, steps: list[torch.Tensor | None],
                name: str = "?") -> tuple[torch.Tensor | None, dict]:
    """The payload that turns the oldest version of a chain into ``new`` (the newest version's tensor),
    from ``steps``: each step's payload of this tensor, oldest first (None: the step did not change it).
    None when no step changed it. Each payload is decoded with its checks (a corrupted one raises
    ``CheckpointFormatError`` naming ``name``), on the host in numpy (``host_positions``). See the module
    docstring for why the union is lossless."""
    new = new.detach().contiguous()
    parts: list[np.ndarray] = []
    whole = False
    digest = None   # the last step's: the later steps left this tensor's bytes as they were
    for payload in steps:
        if payload is None:
            continue
        d = host_positions(payload, name)
        digest = d.digest
        if d.positions is None or d.dtype != new.dtype or d.shape != tuple(new.shape):
            whole = True   # new, reshaped or retyped somewhere in the chain, or sent whole: D's tensor whole
            continue
        parts.append(d.positions)
    if digest is None:
        return None, {"encoding": None, "count": 0, "numel": new.numel(), "bytes": 0}
    if whole:
        return encode_changes(new, None, digest=digest)
    # each list is strictly increasing and in range of new's shape (decode checked both)
    return encode_changes(new, _union(parts, new.numel()), digest=digest)


@dataclass
class Step:
    """One step's payload of a tensor as the fold reads it: its changed positions (None: whole)."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    digest: str
    positions: np.ndarray | None


def host_positions(payload: torch.Tensor, name: str = "?") -> Step:
    """A payload's changed positions, decoded on the host in numpy with ``encode.decode``'s checks (its header,
    the body's ``lin64`` check, the sizes, positions strictly increasing and in range); values are not read
    (the fold takes them from the newest version). ``CheckpointFormatError`` naming ``name`` otherwise.
    (``decode`` runs the engine's torch path: on a host CPU its ``nonzero`` and checks cost ~50x this.)"""
    raw = payload.reshape(-1).cpu()
    header, start = read_header(raw, name)

    def bad(why: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"delta payload refused: {why}", tensor=name)
    try:
        enc, code, shape = header["enc"], header["dtype"], tuple(int(d) for d in header["shape"])
        count, runs, digest = int(header["count"]), int(header["runs"]), str(header["digest"])
        body_len, check = int(header["body"]), str(header["check"])
    except (KeyError, TypeError, ValueError) as exc:
        raise bad(f"header field missing or malformed ({exc!r})") from exc
    if enc not in ENCODINGS or code not in WIRE_DTYPES or any(d < 0 for d in shape) or not is_lin64(digest):
        raise bad(f"unknown encoding {enc!r}, dtype {code!r}, shape {list(shape)} or digest {digest[:40]!r}")
    body = raw[start:].numpy()
    if body.size != body_len:
        raise bad(f"body of {body.size} bytes, header says {body_len}")
    if lin64_host(body) != check:
        raise bad("the body's check (lin64) does not match: corrupted in transit or in memory")
    dtype = WIRE_DTYPES[code]
    numel = int(np.prod(shape, dtype=np.int64))
    if (not 0 <= count <= numel or (enc == "whole" and count != numel)
            or getattr(measure(numel, dtype.itemsize, count, runs), enc) != body_len):
        raise bad(f"count {count} or {enc} body of {body_len} bytes out of range for {numel} elements")
    if enc == "whole":
        return Step(dtype, shape, digest, None)
    idx = np.int32 if index_width(numel) == 4 else np.int64
    if enc == "idx":
        pos = body[: count * np.dtype(idx).itemsize].view(idx).astype(np.int64)
    elif enc == "gap16":
        pos = np.cumsum(body[: count * 2].view(np.uint16), dtype=np.int64)
    elif enc == "bitmap":
        pos = np.flatnonzero(np.unpackbits(body[: (numel + 7) // 8], count=numel, bitorder="little"))
    else:   # runs
        w = np.dtype(idx).itemsize
        starts = body[: runs * w].view(idx).astype(np.int64)
        lengths = body[_align8(runs * w): _align8(runs * w) + runs * w].view(idx).astype(np.int64)
        if (lengths <= 0).any() or int(lengths.sum()) != count:
            raise bad("run lengths do not add up to the count")
        pos = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths) + np.arange(count)
    if pos.size != count:
        raise bad(f"{pos.size} positions, header says {count}")
    if count and (pos[0] < 0 or pos[-1] >= numel or bool((pos[1:] <= pos[:-1]).any())):
        raise bad("positions out of range or not strictly increasing")
    return Step(dtype, shape, digest, pos)


def _union(parts: list[np.ndarray], numel: int) -> np.ndarray:
    """The sorted union of strictly increasing position lists (each in range): a sort of their concatenation
    when they are sparse, a mask of the tensor's elements otherwise (numpy's ``unique`` hashes: ~10x slower)."""
    if len(parts) == 1:
        return parts[0]
    total = sum(p.size for p in parts)
    if total * 16 < numel:
        cat = np.concatenate(parts)
        cat.sort()
        return cat[np.concatenate(([True], cat[1:] != cat[:-1]))] if cat.size else cat
    mask = np.zeros(numel, dtype=np.bool_)
    for p in parts:
        mask[p] = True
    return np.flatnonzero(mask)


__all__ = ["Step", "fold_tensor", "host_positions"]
