"""The worker's views of a bucket's tensors in the mapped buffer, made in batches.

A bucket of a model of many experts holds, per layer, dozens of tensors of one dtype and shape
at one step from each other (every expert's gate, every expert's up, ...). Viewing each with its
own ``as_strided`` call costs a Python call and a tensor per tensor on every update; here, once per
validated plan (``protocol.parse_hello``, cached with the plan), each bucket's tensors are grouped
into such progressions (:func:`plan_views`), and on each update a group is one ``as_strided`` of
``(count, *shape)`` and one ``unbind``: the tensors are made in C++, and handed to ``run`` in
the plan's order (one ``itemgetter`` call), each exactly the view the per-tensor route makes
(same dtype, shape, strides and storage offset).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from ckpt_core.checkpoint.safetensors import WIRE_DTYPES

LOOKAHEAD = 4   # members of a (dtype, shape) tried as the second of a progression (gate and up alternate)


class Group(NamedTuple):
    """``n`` tensors of dtype ``code`` and ``shape`` (row-major ``strides``), the first at element
    ``element`` of the slot, each ``step`` elements after the one before."""
    code: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    element: int
    n: int
    step: int


@dataclass(frozen=True)
class BucketViews:
    """How to view one bucket's tensors: the groups in order, the dtypes they use, the names in the
    plan's order, and ``order`` (the groups' views, flattened, -> the plan's order; None: already)."""
    groups: tuple[Group, ...]
    codes: tuple[str, ...]
    names: tuple[str, ...]
    order: Callable[[list], Any] | None


def plan_views(tensors) -> BucketViews:
    """Group a bucket's tensors (``protocol.WireTensor``, in the plan's order) into progressions of
    one dtype and shape at one element step (the longest from each tensor not yet taken, through one
    of the next few of its kind). Pure; once per validated plan."""
    kinds: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for i, t in enumerate(tensors):
        kinds.setdefault((t.dtype, t.shape), []).append(i)
    runs: list[list[int]] = []
    for members in kinds.values():
        at = {tensors[i].element: i for i in members}
        used: set[int] = set()
        for pos, i in enumerate(members):
            if i in used:
                continue
            used.add(i)
            best: list[int] = []
            for j in [j for j in members[pos + 1:] if j not in used][:LOOKAHEAD]:
                chain = _chain(tensors, i, tensors[j].element - tensors[i].element, at, used)
                if len(chain) > len(best):
                    best = chain
            used.update(best)
            runs.append([i] + best)
    runs.sort(key=lambda r: r[0])   # the groups in the order of their first tensor
    groups = []
    for r in runs:
        t = tensors[r[0]]
        step = tensors[r[1]].element - t.element if len(r) > 1 else 0
        groups.append(Group(t.dtype, t.shape, t.strides, t.element, len(r), step))
    flat = [i for r in runs for i in r]   # position in the groups' views -> index in the plan
    where = [0] * len(flat)
    for pos, i in enumerate(flat):
        where[i] = pos
    order = None if flat == sorted(flat) or len(flat) < 2 else operator.itemgetter(*where)
    return BucketViews(tuple(groups), tuple(dict.fromkeys(t.dtype for t in tensors)),
                       tuple(t.name for t in tensors), order)


def _chain(tensors, i: int, step: int, at: dict[int, int], used: set[int]) -> list[int]:
    """The tensors after ``tensors[i]`` at ``step`` elements each, while they exist and are free."""
    if step <= 0:
        return []
    out: list[int] = []
    k = 1
    while True:
        j = at.get(tensors[i].element + k * step)
        if j is None or j in used:
            return out
        out.append(j)
        k += 1


class Views:
    """Each bucket's tensors as views of the mapped buffer ``buf`` (uint8), in batches (see the module).

    The buffer is viewed as each dtype once per update. A bucket whose slot or buffer is not
    aligned to one of its dtypes' item size takes the per-byte route: each tensor's bytes, viewed
    as dtype and shape."""

    def __init__(self, buf: torch.Tensor):
        self.buf = buf
        self._typed: dict[str, torch.Tensor | None] = {}

    def _as(self, code: str) -> torch.Tensor | None:
        """The whole buffer as dtype ``code`` (None if its start is not aligned to the item size)."""
        if code not in self._typed:
            dtype = WIRE_DTYPES[code]
            k = dtype.itemsize
            ok = self.buf.storage_offset() % k == 0
            self._typed[code] = self.buf[: self.buf.numel() // k * k].view(dtype) if ok else None
        return self._typed[code]

    def bucket(self, base: int, tensors, how: BucketViews) -> list[tuple[str, torch.Tensor]]:
        """``(name, view)`` of every tensor of a bucket whose slot starts at byte ``base``, in the plan's order."""
        make, first = {}, {}   # dtype -> the typed buffer's as_strided, the element where the slot starts
        for code in how.codes:
            typed = self._as(code)
            if typed is None or base % WIRE_DTYPES[code].itemsize:
                return self._by_bytes(base, tensors)
            make[code], first[code] = typed.as_strided, typed.storage_offset() + base // WIRE_DTYPES[code].itemsize
        flat: list[torch.Tensor] = []
        for code, shape, strides, element, n, step in how.groups:
            if n == 1:
                flat.append(make[code](shape, strides, first[code] + element))
            else:
                flat.extend(make[code]((n, *shape), (step, *strides), first[code] + element).unbind(0))
        return list(zip(how.names, flat if how.order is None else how.order(flat)))

    def _by_bytes(self, base: int, tensors) -> list[tuple[str, torch.Tensor]]:
        """A slot not aligned to some dtype's item size: each tensor's bytes, viewed as dtype and shape."""
        return [(t.name, self.buf[base + t.offset: base + t.offset + t.nbytes].view(WIRE_DTYPES[t.dtype]).view(t.shape))
                for t in tensors]
