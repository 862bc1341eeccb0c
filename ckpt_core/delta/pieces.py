"""Deltas of versions registered in pieces (``TensorShard`` boxes, FSDP2/TP DTensors: ``checkpoint/shards.py``).

A PS rank holds pieces (boxes) of some tensors; the ranks' pieces tile each tensor (``planning/pieces.py``).
Version B registered with ``base=A`` is encoded piece by piece against A's piece of the same box on the same
rank: its payload is ``encode.encode_tensor`` of the piece's contiguous bytes against the base piece's (the
changed elements numbered row-major over the piece, the ``lin64`` digest of the piece's new bytes), named
:func:`piece_name`: ``ckpt.delta.piece:`` + JSON ``[tensor, global shape, box]`` (``box``: ``[[dim, start,
length], ...]`` over every dimension, the form of ``sliced.py``'s boxes). Each payload is a whole uint8 tensor
of its owner rank, so it moves through the unchanged pipeline as any delta payload does.

An engine worker holds the tensor whole (slice plans refuse pieces): ``apply.py`` writes the piece into its
box of the live tensor (or of the tensor rebuilt from the kept copy) and checks the piece's digest there.

Both versions must be pieced alike on each rank (:func:`pieces_mismatch`): the same boxes of the same tensors
(same global shape and dtype). Since each version's pieces tile every tensor, identical boxes on every rank
mean identical tilings. A rank where they differ (the trainer resharded, a tensor went from whole to pieces)
registers the version without a delta and records why; a delta update of it is then refused on every rank
alike, in the delta's agreement (``dispatch._delta_view``), and ``delta="fallback"`` sends it whole.

Pure data: no torch, no I/O.
"""

from __future__ import annotations

import json

from ckpt_core.errors import CheckpointFormatError, DeltaBaseError
from ckpt_core.planning.pieces import meta_key

PIECE = "ckpt.delta.piece:"   # + JSON [tensor, global shape, [[dim, start, length], ...]]


class PiecesMismatch(DeltaBaseError):
    """A version and its base are not pieced alike on this rank: no delta between them (module doc)."""


def piece_name(tensor: str, shape, offsets, extent) -> str:
    """The payload name of the piece at ``offsets`` of extent ``extent`` of ``tensor`` (global ``shape``)."""
    box = [[d, int(o), int(n)] for d, (o, n) in enumerate(zip(offsets, extent))]
    return PIECE + json.dumps([tensor, [int(s) for s in shape], box], separators=(",", ":"))


def piece_name_of(meta) -> str:
    """The payload name of a piece's ``TensorMeta`` (its ``box``: (global shape, offsets); ``shape``: its extent)."""
    shape, offsets = meta.box
    return piece_name(meta.name, shape, offsets, meta.shape)


def parse_piece_name(name: str) -> tuple[str, tuple[int, ...], tuple] | None:
    """``(tensor, global shape, box)`` of a piece payload's name (``box``: ``((dim, start, length), ...)``),
    None for any other name; ``CheckpointFormatError`` when malformed or outside the shape."""
    if not name.startswith(PIECE):
        return None
    try:
        tensor, shape, box = json.loads(name[len(PIECE):])
        ok = (isinstance(tensor, str) and all(isinstance(s, int) and s >= 0 for s in shape)
              and len(box) == len(shape)
              and all(len(b) == 3 and all(isinstance(x, int) for x in b) and b[0] == d and b[1] >= 0
                      and b[2] >= 0 and b[1] + b[2] <= shape[d] for d, b in enumerate(box)))
        if ok:
            return tensor, tuple(shape), tuple((d, s, n) for d, s, n in box)
    except (ValueError, TypeError):
        pass
    raise CheckpointFormatError(f"a delta's piece payload name is malformed: {name[:120]!r}")


def _layout(metas) -> dict[str, dict[str, tuple]]:
    """Per tensor registered in pieces here: piece key -> (dtype, global shape, offsets, extent)."""
    out: dict[str, dict[str, tuple]] = {}
    for m in metas:
        if m.box is not None:
            out.setdefault(m.name, {})[meta_key(m)] = (m.dtype, tuple(m.box[0]), tuple(m.box[1]), tuple(m.shape))
    return out


def pieces_mismatch(version: str, metas, base: str, base_metas, rank: int) -> str | None:
    """Why ``version`` (``metas``, this rank's) cannot be encoded piece by piece against ``base``
    (``base_metas``), or None: every tensor held in pieces by either here must be held in the same pieces
    (boxes, global shape, dtype) by both. Only pieces are compared; whole tensors follow the usual rules."""
    new, old = _layout(metas), _layout(base_metas)
    whole_new = {m.name for m in metas if m.box is None}
    whole_old = {m.name for m in base_metas if m.box is None}
    for name in sorted(set(new) | set(old)):
        a, b = old.get(name), new.get(name)
        if a == b:
            continue
        if a is None or b is None:
            held = "whole" if name in (whole_old if a is None else whole_new) else "not at all"
            was = (f"held {held} in {base!r}, in pieces in {version!r}" if a is None
                   else f"held in pieces in {base!r}, {held} in {version!r}")
        else:
            was = f"pieces {_shown(a)} in {base!r}, {_shown(b)} in {version!r}"
        return (f"{version!r} is not pieced as its base {base!r} on rank {rank}: tensor {name!r} {was}; a delta "
                "is encoded piece by piece against the same pieces: register every version in the same pieces "
                "(the same boxes on the same ranks), or update it whole")
    return None


def _shown(layout: dict[str, tuple]) -> str:
    boxes = sorted((off, ext, dtype, shape) for dtype, shape, off, ext in layout.values())
    text = ", ".join(f"{list(o)}+{list(e)}" for o, e, _, _ in boxes[:4]) + (" ..." if len(boxes) > 4 else "")
    kinds = {(d, s) for _, _, d, s in boxes}
    return f"[{text}] ({', '.join(f'{d}{list(s)}' for d, s in sorted(kinds))})"


__all__ = ["PIECE", "PiecesMismatch", "parse_piece_name", "piece_name", "piece_name_of", "pieces_mismatch"]
