"""Deltas encoded where the tensors lie: a trainer's versions on its own device (``on_device=True``).

``register_checkpoint("B", named_tensors=..., on_device=True, base="A")`` with ``A`` registered on the
device too (the trainer's previous weights, kept there): the changed elements are found and encoded
on that device, with no host copy of either version, and the payloads stay there (the companion
``B@delta`` is a device-resident checkpoint, copied device-to-device into the IPC buffer by the
update). Each payload is byte for byte what ``encode.encode_tensor`` writes for the same pair (same
header, same sections, same encoding chosen), so the engine worker decodes and checks it unchanged.

A group of tensors is encoded with four host synchronisations, whatever its size: the change counts,
then the gaps' figures (largest gap, runs), then the new tensors' ``lin64`` digests, then the bodies'
checks; groups are bounded (``_GROUP_ELEMENTS``) so that the change masks stay small beside the model.
"""

from __future__ import annotations

import json

import torch

from ckpt_core.checkpoint.safetensors import WIRE_CODES
from ckpt_core.delta.encode import (
    ENCODINGS,
    MAX_GAP16,
    _align8,
    as_words,
    bytes_of,
    changed_mask,
    frame_head,
    index_width,
    measure,
)
from ckpt_core.delta.lin64 import lin64_many, read_ints
from ckpt_core.errors import CheckpointFormatError, ConfigError

_GROUP_ELEMENTS = 1 << 28   # elements compared per group: their masks (1 byte each) live together
_CHECK_WIDTH = "lin64:" + "0" * 16   # a lin64 digest's text is of fixed width: the header's length is known first


class _Job:
    """One tensor's encode: the pair, then what each step finds."""

    __slots__ = ("new", "old", "numel", "size", "header", "mask", "count", "pending", "pos", "gaps", "max_gap",
                 "runs", "enc", "digest", "body", "out", "head_len", "fields")
    new: torch.Tensor
    old: torch.Tensor | None
    mask: torch.Tensor
    pending: list[torch.Tensor]   # device figures not read back yet
    pos: torch.Tensor
    gaps: torch.Tensor
    digest: str | None   # the new tensor's lin64: given by the caller, or computed in step 3
    body: torch.Tensor
    out: torch.Tensor
    head_len: int
    fields: dict

    def __init__(self, new: torch.Tensor, old: torch.Tensor | None):
        if new.dtype not in WIRE_CODES:
            raise CheckpointFormatError(f"dtype {new.dtype} has no wire code")
        if not new.is_contiguous() or (old is not None and not old.is_contiguous()):
            raise ConfigError("the device encode reads contiguous tensors in place (on_device=True requires them)")
        self.new = new.detach()
        same = old is not None and old.dtype == new.dtype and tuple(old.shape) == tuple(new.shape)
        if same and old is not None and old.device != new.device:
            raise ConfigError(f"a delta is encoded on the device of its tensors: the base lies on {old.device}, "
                              f"the new version on {new.device}")
        self.old = old.detach() if same and old is not None else None
        self.numel, self.size = new.numel(), new.element_size()
        self.header = {"dtype": WIRE_CODES[new.dtype], "shape": list(new.shape)}
        self.count = self.numel if self.old is None else 0
        self.max_gap = self.runs = 0
        self.enc = "whole" if self.old is None else ""
        self.digest = None


def encode_on_device(pairs: list[tuple[torch.Tensor, torch.Tensor | None]], *, force: str | None = None,
                     digests: list[str] | None = None) -> list[tuple[torch.Tensor | None, dict]]:
    """``encode.encode_tensor(new, old)`` of each pair, computed on the tensors' device: ``(payload or
    None, info)`` in order, each payload a uint8 tensor on that device, byte-identical to the host
    encoder's. ``old`` None, or of another dtype or shape: ``whole``. Tensors must be contiguous.
    ``force``: one encoding for every changed tensor (tests), as ``encode_tensor``'s. ``digests``: each
    ``new``'s ``lin64`` where the caller has it (a version's record taken at its registration), so that
    the tensors are not read again for it."""
    if force is not None and force not in ENCODINGS:
        raise ValueError(f"unknown encoding {force!r}")
    if digests is not None and len(digests) != len(pairs):
        raise ValueError(f"{len(digests)} digests for {len(pairs)} tensors")
    jobs = [_Job(new, old) for new, old in pairs]
    for job, known in zip(jobs, digests or ()):
        job.digest = known
    out: list[tuple[torch.Tensor | None, dict]] = []
    group: list[_Job] = []
    elements = 0
    for job in jobs:
        if group and elements + job.numel > _GROUP_ELEMENTS:
            out += _encode_group(group, force)
            group, elements = [], 0
        group.append(job)
        elements += job.numel
    return out + (_encode_group(group, force) if group else [])


def _encode_group(jobs: list[_Job], force: str | None) -> list[tuple[torch.Tensor | None, dict]]:
    compared = [j for j in jobs if j.old is not None]
    for j in compared:   # 1. which elements changed: one mask and one count per tensor, read back together
        j.mask = changed_mask(j.new, j.old)
        j.pending = [j.mask.sum()]
    for j, n in zip(compared, read_ints([j.pending[0] for j in compared])):
        j.count = n
    changed = [j for j in compared if j.count]
    for j in changed:   # 2. their positions, gaps and runs, without a size read back (the count is known)
        j.pos = torch.nonzero_static(j.mask, size=j.count).reshape(-1)
        j.gaps = torch.empty_like(j.pos)
        j.gaps[:1] = j.pos[:1]
        torch.sub(j.pos[1:], j.pos[:-1], out=j.gaps[1:])
        j.pending = [j.gaps.max(), (j.gaps[1:] != 1).sum() + 1]
    figures = read_ints([x for j in changed for x in j.pending])
    for k, j in enumerate(changed):
        j.max_gap, j.runs = figures[2 * k], figures[2 * k + 1]
        j.enc = force or measure(j.numel, j.size, j.count, j.runs, j.max_gap).best()
    sent = [j for j in jobs if j.enc]
    unknown = [j for j in sent if j.digest is None]
    if unknown:   # 3. the new tensors' digests the caller did not give, together
        for j, digest in zip(unknown, lin64_many(j.new for j in unknown)):
            j.digest = digest
    for j in sent:   # 4. each payload: the header's length first (fixed-width check), then the body in place
        j.fields = dict(j.header, enc=j.enc, count=j.numel if j.enc == "whole" else j.count,
                        runs=j.runs if j.enc == "runs" else 0, digest=j.digest)
        nbytes = (measure(j.numel, j.size, j.count, j.runs, j.max_gap).whole if j.enc == "whole" else
                  getattr(measure(j.numel, j.size, j.count, j.runs, j.max_gap), j.enc))
        j.head_len = len(_head(dict(j.fields, body=nbytes, check=_CHECK_WIDTH)))
        j.out = torch.zeros(j.head_len + nbytes, dtype=torch.uint8, device=j.new.device)
        j.body = j.out[j.head_len:]
        _fill(j)
        if j.old is not None:   # a changed tensor's mask, positions and gaps: freed before the next body
            del j.mask, j.pos, j.gaps
    for j, check in zip(sent, lin64_many(j.body for j in sent)):
        head = _head(dict(j.fields, body=j.body.numel(), check=check))
        if len(head) != j.head_len:   # our invariant: the check's text has a fixed width
            raise AssertionError(f"payload header of {len(head)} bytes, {j.head_len} planned")
        j.out[: j.head_len].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8), non_blocking=False)
    return [(j.out, {"encoding": j.enc, "count": j.count, "numel": j.numel, "bytes": j.out.numel()}) if j.enc else
            (None, {"encoding": None, "count": 0, "numel": j.numel, "bytes": 0}) for j in jobs]


def _head(fields: dict) -> bytes:
    return frame_head(json.dumps(fields, separators=(",", ":")).encode())


class _Sections:
    def __init__(self, body: torch.Tensor):
        self.body, self.at = body, 0

    def take(self, nbytes: int) -> torch.Tensor:
        view = self.body[self.at: self.at + nbytes]
        self.at += _align8(nbytes)
        return view


def _fill(j: _Job) -> None:
    """Write ``j``'s body sections (the layouts of ``encode._body``) into ``j.body`` on the device."""
    if j.enc == "whole":
        j.body[: j.numel * j.size].copy_(bytes_of(j.new))
        return
    s = _Sections(j.body)
    idx = torch.int32 if index_width(j.numel) == 4 else torch.int64
    w = 4 if idx is torch.int32 else 8
    if j.enc == "idx":
        s.take(j.count * w).view(idx).copy_(j.pos)
    elif j.enc == "gap16":
        if j.max_gap > MAX_GAP16:
            raise ValueError("gap16 needs every gap below 2**16")
        pair = s.take(j.count * 2).view(-1, 2)   # little-endian uint16: low byte, then high byte
        pair[:, 0].copy_(j.gaps & 0xFF)
        pair[:, 1].copy_(j.gaps >> 8)
    elif j.enc == "bitmap":
        bits = torch.zeros(_align8(j.numel), dtype=torch.uint8, device=j.new.device)
        bits[: j.numel] = j.mask
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=j.new.device)
        packed = (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)
        s.take((j.numel + 7) // 8).copy_(packed[: (j.numel + 7) // 8])
    else:   # runs: a run starts at the first position and wherever a gap is not 1
        starts_at = torch.ones(j.count, dtype=torch.bool, device=j.new.device)
        starts_at[1:] = j.gaps[1:] != 1
        first = torch.nonzero_static(starts_at, size=j.runs).reshape(-1)
        ends = torch.empty_like(first)
        ends[:-1] = first[1:]
        ends[-1:] = j.count
        s.take(j.runs * w).view(idx).copy_(j.pos[first])
        s.take(j.runs * w).view(idx).copy_(ends - first)
    words = as_words(j.new)
    item = j.size
    values = s.take(j.count * item).view(words.dtype)
    if words.dim() > 1:
        values = values.view(j.count, -1)
    torch.index_select(words, 0, j.pos, out=values)


__all__ = ["encode_on_device"]
