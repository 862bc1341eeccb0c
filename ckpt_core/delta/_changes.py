"""Which elements changed between two versions of a tensor, on the host (the PS's encode): the
positions and the figures the encodings are chosen by, vectorized in numpy over cache-sized blocks
(a compare and a nonzero per block: no tensor-sized mask), each computed once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

_BLOCK = 1 << 18   # elements per compare block: the block's mask stays in cache


def changed_positions(new: np.ndarray, old: np.ndarray,
                      after_block: Callable[[int, bool], None] | None = None) -> np.ndarray:
    """int64 positions, increasing, where the rows (``[n]`` words, or ``[n, k]`` for items wider than
    8 bytes) of ``new`` and ``old`` differ, compared as integers (bits: never a tolerance).
    ``after_block(end, changed)``: called after each block, while it is in cache, with the rows
    compared so far and whether any of them changed (the encode digests the new rows then)."""
    n = new.shape[0]
    parts = []
    for s in range(0, n, _BLOCK):
        ne = new[s: s + _BLOCK] != old[s: s + _BLOCK]
        if ne.ndim > 1:
            ne = ne.any(axis=1)
        found = np.flatnonzero(ne)
        if found.size:
            parts.append(found + s)
        if after_block is not None:
            after_block(min(s + _BLOCK, n), bool(parts))
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class Changes:
    """Strictly increasing changed ``positions`` and what the encodings need of them: the ``gaps``
    (the first position, then the distance to each next one), the largest gap, the run count."""
    positions: np.ndarray
    gaps: np.ndarray
    max_gap: int
    runs: int

    @classmethod
    def of(cls, positions: np.ndarray) -> Changes:
        if positions.size == 0:
            return cls(positions, positions, 0, 0)
        gaps = np.empty_like(positions)   # np.diff(positions, prepend=0), without its generic setup
        gaps[0] = positions[0]
        np.subtract(positions[1:], positions[:-1], out=gaps[1:])
        return cls(positions, gaps, int(gaps.max()), 1 + int(np.count_nonzero(gaps[1:] != 1)))

    def run_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """(starts, lengths) of the runs of consecutive positions."""
        breaks = np.flatnonzero(self.gaps[1:] != 1) + 1
        first = np.concatenate([[0], breaks])
        last = np.concatenate([breaks, [self.positions.size]])
        return self.positions[first], last - first


__all__ = ["Changes", "changed_positions"]
