"""Tensors registered in pieces: ``TensorShard`` boxes and torch DTensors (FSDP2, tensor parallel).

Each rank registers only what it holds. A DTensor's box is computed locally from its mesh
coordinate and placements, the way torch lays out its shards (``Shard``: ``torch.chunk``
sizes, the last chunks smaller or empty, which is FSDP2's rule too; ``_StridedShard``, which
FSDP2 uses on the data-parallel dimension when tensor parallelism shards the same dimension).
No collective, no ``full_tensor``/``redistribute``. A ``Replicate``d dimension is kept by
the rank at coordinate 0 of it only, so a replicated tensor is stored and sent once.
``Partial`` (a pending reduction) is refused. Whether the ranks' pieces tile each tensor is
checked at ``gather_metas`` (``planning/pieces.py``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from ckpt_core.errors import ConfigError


@dataclass(frozen=True, init=False)
class TensorShard:
    """A box of a global tensor, held by this rank: ``local`` holds the elements
    ``[offsets[d], offsets[d] + local.shape[d])`` of every dimension ``d`` of a tensor of
    ``global_shape``. May stand in ``named_tensors`` wherever a tensor may (trainers without
    DTensor: Megatron TP/EP/PP, DeepSpeed, custom layouts)::

        # rank r of a 2-way row-parallel layer: columns [r * 512, (r + 1) * 512) of a [1024, 1024] weight
        named["layers.0.mlp.down_proj.weight"] = TensorShard(local_w, (1024, 1024), (0, r * 512))

    The ranks' boxes of one name must tile the tensor exactly (checked by ``gather_metas``);
    engines receive the whole tensor.
    """
    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __init__(self, local, global_shape, offsets):
        if not isinstance(local, torch.Tensor) or _is_dtensor(local):
            raise ConfigError(f"TensorShard.local must be a plain torch.Tensor, got {type(local).__name__}")
        gs, off = _ints(global_shape, "global_shape"), _ints(offsets, "offsets")
        if not (len(gs) == len(off) == local.dim()):
            raise ConfigError(f"TensorShard: local has {local.dim()} dimensions, global_shape {len(gs)}, "
                              f"offsets {len(off)}; they must agree")
        bad = [d for d in range(len(gs)) if off[d] + local.shape[d] > gs[d]]
        if bad:
            raise ConfigError(f"TensorShard: the box at offsets {list(off)} of extent {list(local.shape)} lies "
                              f"outside the global shape {list(gs)} (dimension {bad[0]})")
        object.__setattr__(self, "local", local)
        object.__setattr__(self, "global_shape", gs)
        object.__setattr__(self, "offsets", off)

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype


def _ints(v, what: str) -> tuple[int, ...]:
    if isinstance(v, torch.Size):
        v = tuple(v)
    if not isinstance(v, (list, tuple)) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in v):
        raise ConfigError(f"TensorShard.{what} must be a sequence of non-negative ints, got {v!r}")
    return tuple(int(x) for x in v)


@dataclass(frozen=True)
class Box:
    """One piece to register: a view of the local tensor and where it sits in the global one."""
    name: str
    view: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:   # a torch without distributed
        return False
    return isinstance(t, DTensor)


def is_pieced(t) -> bool:
    return isinstance(t, TensorShard) or _is_dtensor(t)


def boxes_of(name: str, t) -> list[Box]:
    """The pieces this rank registers for ``t`` (a ``TensorShard`` or a DTensor); may be empty (a
    replica kept by another rank, an empty shard)."""
    if isinstance(t, TensorShard):
        return [Box(name, t.local, t.global_shape, t.offsets)] if t.local.numel() or not math.prod(t.global_shape) \
            else []
    return _dtensor_boxes(name, t)


def _dtensor_boxes(name: str, t) -> list[Box]:
    from torch.distributed.tensor import Replicate
    mesh, placements = t.device_mesh, tuple(t.placements)
    coord = mesh.get_coordinate()
    if coord is None:   # this rank is outside the tensor's mesh: it holds nothing of it
        return []
    gshape = tuple(int(d) for d in t.shape)
    for p in placements:
        if p.is_partial():
            raise ConfigError(f"named_tensors[{name!r}] is a DTensor with a Partial placement ({p}): its local "
                              "values are pending a reduction; reduce first (e.g. redistribute to Shard/Replicate) "
                              "and register the result")
        if not (_is_shard_like(p) or isinstance(p, Replicate)):
            raise ConfigError(f"named_tensors[{name!r}] has the DTensor placement {p!r}, which cannot be registered "
                              "(Shard, Replicate and FSDP2's strided shard can)")
    if any(isinstance(p, Replicate) and coord[m] != 0 for m, p in enumerate(placements)) or _copy_elsewhere(mesh):
        return []   # a replica: the rank at coordinate 0 of every replicated mesh dimension keeps it
    local = t.to_local()
    indices = dim_indices(gshape, tuple(mesh.shape), tuple(coord), placements)
    _check_against_torch(name, t, local, indices, coord)
    if math.prod(gshape) == 0:
        return [Box(name, local, gshape, (0,) * len(gshape))] if not any(coord) else []
    if local.numel() == 0:
        return []
    return [Box(name, view, gshape, offsets) for view, offsets in _runs_to_boxes(local, indices)]


def _copy_elsewhere(mesh) -> bool:
    """Whether another rank keeps this rank's copy of a DTensor on a sub-mesh: FSDP2 beside tensor
    parallelism puts the tensors TP leaves alone on the ``dp`` sub-mesh, and every TP rank then
    holds the same shard. The rank at coordinate 0 of the root mesh's other (named) dimensions
    keeps it. Without names to match, every copy is registered (and ``gather_metas`` reports the
    overlap)."""
    try:
        root = mesh._get_root_mesh()
    except Exception:   # a torch without sub-mesh bookkeeping
        return False
    if root is None or root is mesh:
        return False
    names, rnames, coord = mesh.mesh_dim_names, root.mesh_dim_names, root.get_coordinate()
    if not names or not rnames or coord is None or not all(n in rnames for n in names):
        return False
    return any(coord[i] != 0 for i, n in enumerate(rnames) if n not in names)


def dim_indices(global_shape, mesh_shape, coord, placements) -> list[list[int]]:
    """Per tensor dimension, the global indices this mesh coordinate holds, in local order.

    Mesh dimensions are applied left to right, as torch does. ``Shard``: the current index list
    is cut in ``torch.chunk`` pieces (ceil size, trailing chunks short or empty) and the
    coordinate's piece is kept. ``_StridedShard(split_factor=f)``: the list is first cut in
    ``f`` ``torch.chunk`` pieces, each of those is cut as by ``Shard``, and the coordinate's
    parts are concatenated (FSDP2 on a dimension that tensor parallelism shards further right).
    """
    idx = [list(range(d)) for d in global_shape]
    for m, p in enumerate(placements):
        if not _is_shard_like(p):
            continue
        n, c = mesh_shape[m], coord[m]
        factor = int(getattr(p, "split_factor", 1))
        groups = _chunks(idx[p.dim], factor) if factor > 1 else [idx[p.dim]]
        idx[p.dim] = [i for g in groups for i in _nth_chunk(g, n, c)]
    return idx


def _is_shard_like(p) -> bool:
    """``Shard``, or FSDP2's ``_StridedShard`` (no subclass of ``Shard`` in torch 2.13)."""
    from torch.distributed.tensor import Shard
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        _StridedShard = Shard
    return isinstance(p, (Shard, _StridedShard))


def _chunks(seq: list, n: int) -> list[list]:
    size = -(-len(seq) // n) if seq else 0
    return [seq[i * size: (i + 1) * size] for i in range(n)] if size else [[] for _ in range(n)]


def _nth_chunk(seq: list, n: int, c: int) -> list:
    return _chunks(seq, n)[c]


def _check_against_torch(name: str, t, local, indices, coord) -> None:
    """Our box must be torch's: same local shape, and the same first offsets as torch computes."""
    shape = tuple(len(i) for i in indices)
    if tuple(local.shape) != shape:
        raise ConfigError(f"named_tensors[{name!r}]: its local shard has shape {list(local.shape)}, but its "
                          f"placements {list(t.placements)} on mesh {list(t.device_mesh.shape)} at coordinate "
                          f"{list(coord)} give {list(shape)}; this layout cannot be registered as is")
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:   # a torch without the helper: the shape check above stands alone
        return
    tshape, toff = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    ours = tuple(i[0] if i else None for i in indices)
    if tuple(tshape) != shape or any(o is not None and o != to for o, to in zip(ours, toff)):
        raise ConfigError(f"named_tensors[{name!r}]: torch places this shard at {list(toff)} (shape {list(tshape)}), "
                          f"ckpt-engine at {list(ours)} (shape {list(shape)}); this torch's layout is not supported")


def _runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of each maximal run of consecutive global indices."""
    out: list[tuple[int, int, int]] = []
    for li, gi in enumerate(indices):
        if out and out[-1][1] + out[-1][2] == gi:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((li, gi, 1))
    return out


def _runs_to_boxes(local: torch.Tensor, indices: list[list[int]]):
    """The local tensor as boxes of the global one: one box when every dimension's indices are one
    run (every layout FSDP2 and TP produce from even splits), more when a strided shard is not."""
    for combo in itertools.product(*(_runs(i) for i in indices)):
        view = local
        for d, (ls, _, n) in enumerate(combo):
            if n != local.shape[d]:
                view = view.narrow(d, ls, n)
        yield view, tuple(gs for _, gs, _ in combo)
