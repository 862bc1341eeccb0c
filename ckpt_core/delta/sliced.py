"""Sliced deltas: each engine rank receives only the changed elements of its own boxes.

With a slice plan (``planning/slices.py``) each engine rank reads one box of each checkpoint tensor.
A version's delta (``versions.py``: ``name@delta``, one payload per changed tensor) is cut per
(tensor, box) here: the changed positions of the whole tensor's payload that fall inside the box,
renumbered in the box's own flat coordinates (row-major over the box as a C-contiguous tensor of its
extent), with the box's new values, encoded with ``encode.py``'s encodings (smallest wins) and the
``lin64`` digest of the box's new bytes (the box as a contiguous tensor): what the engine rank checks
after the apply. A box with no changed element sends nothing.

The payloads are built on each PS rank from what it holds (the registered whole version, whose
tensors this rank owns, and its ``name@delta`` payloads: the positions are filtered in numpy, nothing
is compared again), once per (delta, plan digest): they form one more companion checkpoint,
``sliced_name(name@delta, plan)`` (or of a fold, ``versions.fold_companion``), of uint8 tensors
named ``box_name(tensor, box)`` plus the delta's manifests, released with the version (``dispatch.Updates.remove``).

They are routed by :func:`routes_of`: a slice plan over the companion's tensors in which engine rank
t needs, whole, the payloads of its own boxes and every manifest. ``plan_sliced`` then packs them as
it packs any sliced update (a payload every rank reads is broadcast, the others go only to the PS
ranks of their engine rank), and the hello names the *engine's* plan (``route_digest``), which the
worker checks against its own as for a full sliced update.

No I/O; torch and numpy on the host.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch

from ckpt_core.delta.encode import decode, encode_changes
from ckpt_core.delta.versions import MANIFEST, PAYLOAD
from ckpt_core.errors import CheckpointFormatError, ConfigError
from ckpt_core.planning.slices import (
    Box,
    RankSlices,
    SliceKey,
    SlicePlan,
    box_extent,
    box_offsets,
    contiguous_strides,
)

BOX = "ckpt.delta.box:"   # + JSON [tensor, box] (box: [[dim, start, length], ...], or null: the whole tensor)


def sliced_name(comp: str, plan: SlicePlan) -> str:
    """The companion checkpoint of delta companion ``comp`` (``name@delta``, or a fold ``name@delta:<base>``)
    cut by ``plan``."""
    return f"{comp}[{plan.digest[:16]}]"


def norm_box(box) -> Box | None:
    """A box in its canonical form: None for the whole tensor (an empty chain reads every element too)."""
    if box is None:
        return None
    return tuple((int(b[0]), int(b[1]), int(b[2])) for b in box) or None


def box_name(tensor: str, box: Box | None) -> str:
    box = norm_box(box)
    return BOX + json.dumps([tensor, None if box is None else [list(b) for b in box]], separators=(",", ":"))


def parse_box_name(name: str) -> tuple[str, Box | None] | None:
    """``(tensor, box)`` of a box payload's name, None for any other name; CheckpointFormatError if malformed."""
    if not name.startswith(BOX):
        return None
    try:
        tensor, box = json.loads(name[len(BOX):])
        if isinstance(tensor, str) and (box is None or all(len(b) == 3 and all(isinstance(x, int) for x in b)
                                                            for b in box)):
            return tensor, norm_box(box)
    except (ValueError, TypeError):
        pass
    raise CheckpointFormatError(f"a sliced delta payload's name is malformed: {name[:120]!r}")


def box_positions(positions: np.ndarray, shape, box: Box | None) -> np.ndarray:
    """The flat positions (row-major in ``shape``, increasing) that lie inside ``box``, renumbered in the
    box's own row-major coordinates (still increasing: the box is a row-major sub-block)."""
    if not box:
        return positions
    off, ext = box_offsets(shape, box), box_extent(shape, box)
    strides, inner = contiguous_strides(shape), contiguous_strides(ext)
    keep = np.ones(positions.shape, dtype=np.bool_)
    rel = np.zeros(positions.shape, dtype=np.int64)
    for d, n in enumerate(shape):
        c = positions // strides[d] if d == 0 else (positions // strides[d]) % n
        if ext[d] != n:
            keep &= (c >= off[d]) & (c < off[d] + ext[d])
            c = c - off[d]
        rel += c * inner[d]
    return rel[keep]


def region_of(t: torch.Tensor, box: Box | None) -> torch.Tensor:
    """The view of ``t`` that box ``box`` reads."""
    for d, s, n in box or ():
        t = t.narrow(d, s, n)
    return t


def encode_box(new: torch.Tensor, positions: np.ndarray | None, box: Box | None) -> tuple[torch.Tensor | None, dict]:
    """The payload of box ``box`` of the whole new tensor ``new`` (CPU) whose changed positions are
    ``positions`` (flat, increasing; None: every element, the whole payload's case), or None when no
    changed element lies in the box. ``(payload or None, info)`` as ``encode.encode_tensor``."""
    region = region_of(new.detach(), box).contiguous()
    if positions is None:
        return encode_changes(region, None)
    rel = box_positions(positions, tuple(new.shape), box)
    if rel.size == 0:
        return None, {"encoding": None, "count": 0, "numel": region.numel(), "bytes": 0}
    return encode_changes(region, rel)


def boxes_read(plan: SlicePlan, tensor: str) -> list[Box | None]:
    """The distinct boxes of ``tensor`` the plan's engine ranks read, in rank order of first reader."""
    out: dict[Box | None, None] = {}
    for rs in plan.ranks:
        if tensor in rs.needs:
            out.setdefault(norm_box(rs.needs[tensor]))
    return list(out)


def build_box_payloads(version, delta, plan: SlicePlan) -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's sliced delta: the box payloads of every tensor it owns of ``version`` (a registered
    checkpoint, whole tensors) from its delta companion ``delta``, and the delta's manifests (copied:
    they tell the worker the update is a delta, of which base). Returns (named tensors, figures).
    ConfigError for a tensor the plan does not know, or knows with another dtype or shape."""
    payloads = {m.name: delta.host_tensor(m) for m in delta.metas}
    out: dict[str, torch.Tensor] = {n: p.clone() for n, p in payloads.items() if n.startswith(MANIFEST)}
    counts = {"boxes": 0, "changed_boxes": 0, "payload_bytes": 0}
    encodings: dict[str, int] = {}
    for m in version.metas:
        spec = plan.tensors.get(m.name)
        if spec is None or (spec[0], tuple(spec[1])) != (m.dtype, tuple(m.shape)):
            raise ConfigError(f"tensor {m.name!r} is {m.dtype}{list(m.shape)} in the version, "
                              f"{'absent' if spec is None else f'{spec[0]}{list(spec[1])}'} in the slice plan: "
                              "record the plan for this checkpoint")
        boxes = boxes_read(plan, m.name)
        counts["boxes"] += len(boxes)
        whole = payloads.get(PAYLOAD + m.name)
        if whole is None or not boxes:
            continue   # unchanged, or read by no engine rank
        d = decode(whole, m.name)   # checked whole (its body's lin64, positions) before it is cut
        positions = None if d.positions is None else d.positions.numpy()
        new = version.host_tensor(m)
        for box in boxes:
            payload, info = encode_box(new, positions, box)
            if payload is None:
                continue
            out[box_name(m.name, box)] = payload
            counts["changed_boxes"] += 1
            counts["payload_bytes"] += info["bytes"]
            encodings[info["encoding"]] = encodings.get(info["encoding"], 0) + 1
    return out, {**counts, "encodings": encodings}


@dataclass(frozen=True)
class DeltaRoutes(SlicePlan):
    """The routing of a sliced delta's companion (:func:`routes_of`); ``route``: the digest of the engine's
    plan it was cut by, which the hello names (the worker checks it against the plan it loads by)."""
    route: str = ""

    @property
    def route_digest(self) -> str:
        return self.route


def routes_of(plan: SlicePlan, metas_per_rank) -> DeltaRoutes:
    """A slice plan over the sliced delta's payloads (every rank's metas of the companion): engine rank t
    needs, whole, each payload of a box it reads and every manifest; nothing else reaches it."""
    tensors = {m.name: (m.dtype, tuple(m.shape), m.itemsize) for ms in metas_per_rank for m in ms}
    ranks = []
    for rs in plan.ranks:
        mine = {(n, norm_box(b)) for n, b in rs.needs.items()}
        needs: dict[str, Box | None] = {}
        for name in tensors:
            parsed = parse_box_name(name)
            if parsed is None and not name.startswith(MANIFEST):
                raise CheckpointFormatError("a sliced delta carries a tensor that is neither a box payload nor a "
                                            "manifest", tensor=name)
            if parsed is None or parsed in mine:
                needs[name] = None
        ranks.append(RankSlices(rs.rank, needs, {}, ()))
    key = SliceKey(plan.key.model, plan.key.layout, plan.key.engine + "+delta")
    return DeltaRoutes(key, tensors, tuple(ranks), route=plan.route_digest)


__all__ = ["BOX", "DeltaRoutes", "box_name", "box_positions", "build_box_payloads", "encode_box", "norm_box",
           "parse_box_name", "region_of", "routes_of", "sliced_name"]
