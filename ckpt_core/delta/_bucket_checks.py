"""The checks ``encode.decode_many`` runs for a whole bucket at once on its device, so that a GPU
worker launches a few kernels per bucket rather than several per payload, and reads nothing back
until the bucket's results are read together."""

from __future__ import annotations

import torch


def peek_heads(raws: list[torch.Tensor], peek: int) -> list[bytes]:
    """The first ``peek`` bytes of each uint8 payload (b"" for another dtype or an empty one), read
    back to the host together: one copy per device."""
    out = [b""] * len(raws)
    by_device: dict[torch.device, list[int]] = {}
    for i, raw in enumerate(raws):
        if raw.dtype == torch.uint8 and raw.numel():
            by_device.setdefault(raw.device, []).append(i)
    for idx in by_device.values():
        parts = [raws[i][:peek] for i in idx]
        flat = torch.cat(parts).cpu().numpy().tobytes()
        at = 0
        for i, part in zip(idx, parts):
            out[i] = flat[at: at + part.numel()]
            at += part.numel()
    return out


def _small(values: list[int], device: torch.device) -> torch.Tensor:
    """A small int64 tensor of host values on ``device``, copied without waiting for the device
    (a blocking host-to-device copy would synchronise the stream)."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


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
