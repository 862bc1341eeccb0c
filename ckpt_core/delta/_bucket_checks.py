"""The checks ``encode.decode_many`` runs for a whole bucket at once on its device, so that a GPU
worker launches a few kernels per bucket rather than several per payload, and reads nothing back
until the bucket's results are read together."""

from __future__ import annotations

import torch

from ckpt_core.delta._kernels import to_device


def peek_heads(raws: list[torch.Tensor], peek: int, aside: bool = False) -> list[bytes]:
    """The first ``peek`` bytes of each uint8 payload (b"" for another dtype or an empty one), read
    back to the host together: one copy per device. ``aside``: on a CUDA device the copy runs on a
    stream of its own and only it is waited for, not the work already queued on the current stream
    (a pipelined delta's previous bucket, ``apply.py``); the payloads must not be written by that work."""
    out = [b""] * len(raws)
    by_device: dict[torch.device, list[int]] = {}
    for i, raw in enumerate(raws):
        if raw.dtype == torch.uint8 and raw.numel():
            by_device.setdefault(raw.device, []).append(i)
    for idx in by_device.values():
        parts = [raws[i][:peek] for i in idx]
        flat = (_read_aside(parts) if aside and parts[0].device.type == "cuda" else torch.cat(parts).cpu()) \
            .numpy().tobytes()
        at = 0
        for i, part in zip(idx, parts):
            out[i] = flat[at: at + part.numel()]
            at += part.numel()
    return out


_ASIDE: dict[torch.device, torch.cuda.Stream] = {}


def _read_aside(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts).cpu()`` on a side stream of the parts' CUDA device, waiting for that stream only: each
    part copied by the copy engine straight into page-locked memory (no kernel, which would wait for the SMs
    the work queued before it holds), on a stream of the highest priority."""
    device = parts[0].device
    stream = _ASIDE.get(device)
    if stream is None:
        stream = _ASIDE[device] = torch.cuda.Stream(device, priority=-1)   # the highest torch maps it to
    host = torch.empty(sum(p.numel() for p in parts), dtype=torch.uint8, pin_memory=True)
    with torch.cuda.stream(stream):
        at = 0
        for part in parts:
            host[at: at + part.numel()].copy_(part, non_blocking=True)
            at += part.numel()
    stream.synchronize()
    return host


def _small(values: list[int], device: torch.device) -> torch.Tensor:
    """A small int64 tensor of host values on ``device``, copied without waiting for the device
    (a blocking host-to-device copy would synchronise the stream)."""
    return to_device(torch.tensor(values, dtype=torch.int64), device)


def positions_bad(spans: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """One flag (0-d int64 on their device) for the position lists of ``spans`` (``(positions,
    numel)``, each non-empty, all on one device): 1 when any list has a position out of ``[0, numel)``
    or is not strictly increasing. Which one is found by ``position_bad`` (on failure only).

    A list that rises strictly lies in ``[0, numel)`` when its first is >= 0 and its last < numel: the
    bounds are read at the lists' ends only (a gather of one per list, not a bound per element)."""
    flat = torch.cat([pos for pos, _ in spans]) if len(spans) > 1 else spans[0][0]
    device, total = flat.device, flat.numel()
    starts, ends, at = [], [], 0
    for pos, _ in spans:
        starts.append(at)
        at += pos.numel()
        ends.append(at - 1)
    bad = (flat.index_select(0, _small(starts, device)) < 0).any()
    bad = bad | (flat.index_select(0, _small(ends, device)) >= _small([n for _, n in spans], device)).any()
    if total > 1:
        rising = flat[1:] > flat[:-1]
        if len(starts) > 1:   # where a list starts, the comparison with the previous list's last does not count
            rising = rising.index_fill(0, _small([s - 1 for s in starts[1:]], device), True)
        bad = bad | ~rising.all()
    return bad.to(torch.int64)


def position_bad(pos: torch.Tensor, numel: int) -> bool:
    """``positions_bad`` of one list, read back (a refused bucket's slow path: which payload)."""
    bad = (pos[0] < 0) | (pos[-1] >= numel)
    if pos.numel() > 1:
        bad = bad | (pos[1:] <= pos[:-1]).any()
    return bool(bad)


__all__ = ["peek_heads", "positions_bad", "position_bad"]


def gap_positions(gaps: list[torch.Tensor]) -> list[torch.Tensor]:
    """The positions of each ``gap16`` list (the running sum of its gaps: ``gaps[i]`` the bytes of ``n_i``
    uint16 gaps, all on one device), every list of the bucket in one pass, not two kernels per list: the
    lists' bytes joined, widened to int64 once, one running sum; each list after the first then has the
    previous lists' total taken off at its first gap and a second running sum gives every
    list's own. Each result is a view of one int64 tensor (the positions outlive the bucket's buffer: the
    undo log keeps them). Temporary device memory: two int64 copies of the bucket's gaps."""
    counts = [g.numel() // 2 for g in gaps]
    if len(gaps) == 1 or sum(counts) == 0:
        return [torch.cumsum(_uint16(g).to(torch.int64), 0) for g in gaps]
    device = gaps[0].device
    wide = _uint16(torch.cat(gaps)).to(torch.int64)
    sums = torch.cumsum(wide, 0)
    ends: list[int] = []
    starts: list[int] = []
    at = 0
    for n in counts:
        if n:
            if ends:
                starts.append(at)
            ends.append(at + n - 1)
        at += n
    if starts:
        totals = sums[_small(ends[:-1], device)]   # the running sum at each non-empty list's end but the last
        own = torch.diff(totals, prepend=totals.new_zeros(1))   # each such list's own total
        at_starts = _small(starts, device)
        wide[at_starts] = wide[at_starts] - own   # distinct starts: a plain index put
        torch.cumsum(wide, 0, out=sums)
    return list(sums.split(counts))


def _uint16(raw: torch.Tensor) -> torch.Tensor:
    """uint8 bytes (an even count) as uint16: a view where aligned, else an aligned copy."""
    if raw.storage_offset() % 2:
        raw = raw.clone()
    return raw.view(torch.uint16)
