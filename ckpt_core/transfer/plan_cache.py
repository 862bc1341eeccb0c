"""The PS's cache of transfer plans.

A plan depends only on every rank's metas and the bucket size, so it is keyed by
(bucket size, metas digest), not by checkpoint name: successive RL steps with one
layout reuse one plan (and, through the plan's wire digest, the worker's validated
copy of it). A checkpoint's metas digest is computed once per gathered metas, and not even
that when they equal the metas of a checkpoint digested recently (the next RL step of a layout:
comparing them costs a tenth of encoding them, which on thousands of tensors cost ~1.5 us each
on every step's first update).
"""

from __future__ import annotations

import hashlib
import json
from collections import deque

from ckpt_core.errors import CkptError
from ckpt_core.ops.cache import BoundedCache
from ckpt_core.planning.buckets import Plan, TensorMeta, layout_sizes, plan_buckets
from ckpt_core.planning.slice_routes import plan_sliced, rank_placements, sliced_sizes
from ckpt_core.planning.slices import SlicePlan
from ckpt_core.wire.protocol import plan_fragment

PLAN_CACHE = 4      # plans kept; the least recently used goes first


class PlanCache:
    def __init__(self, size: int = PLAN_CACHE):
        self.size = size
        self._plans: BoundedCache[tuple, tuple[Plan, tuple[str, str]]] = BoundedCache(size)   # LRU
        self._digests: dict[str, tuple[list, str]] = {}   # checkpoint -> (the metas it digests, digest)
        self._recent: deque[tuple[list, str]] = deque(maxlen=size)   # (metas, digest), names forgotten or not
        self._sizes: BoundedCache[str, tuple[int, int]] = BoundedCache(size)   # metas digest -> layout_sizes

    def digest(self, name: str, metas: list[list[TensorMeta]]) -> str:
        """Digest of a checkpoint's gathered metas (recomputed only when they were gathered again)."""
        cached = self._digests.get(name)
        if cached is None or cached[0] is not metas:
            digest = next((d for other, d in reversed(self._recent) if other == metas), None)
            if digest is None:
                text = json.dumps([[list(m) for m in ms] for ms in metas])
                digest = hashlib.sha1(text.encode()).hexdigest()
                self._recent.append((metas, digest))
            cached = (metas, digest)
            self._digests[name] = cached
        return cached[1]

    def sizes(self, metas: list[list[TensorMeta]], digest: str, slices: SlicePlan | None = None) -> tuple[int, int]:
        """``layout_sizes`` of these metas, computed once per digest (every update asks). With ``slices``:
        those of the sliced update (``slice_routes.sliced_sizes``: buckets sized by what each owner sends),
        once per (digest, slice plan); a plan that does not fit the metas falls back to the whole layout's,
        and ``get`` then raises plan_sliced's error."""
        key = digest if slices is None else f"{digest}:{slices.digest}"
        sizes = self._sizes.get(key)
        if sizes is not None:
            return sizes
        if slices is None:
            return self._sizes.put(key, layout_sizes(metas))
        try:
            return self._sizes.put(key, sliced_sizes(metas, slices))
        except CkptError:
            return self.sizes(metas, digest)

    def forget(self, name: str) -> None:
        self._digests.pop(name, None)

    def get(self, metas: list[list[TensorMeta]], digest: str, bucket_bytes: int, *,
            slices: SlicePlan | None = None, rank: int = 0) -> tuple[Plan, tuple[str, str]]:
        """The plan of these metas at this bucket size and its wire form (JSON, digest).

        With ``slices`` (``planning/slices.py``) each engine rank gets only its slices: the wire
        form is then PS rank ``rank``'s own (that of engine rank ``rank % T`` of the plan's T), and the
        plan is cached under the slice plan's digest too.
        """
        key = (bucket_bytes, digest) if slices is None else (bucket_bytes, digest, slices.digest, rank)
        entry = self._plans.get(key, touch=True)
        if entry is not None:
            return entry
        if slices is not None:
            plan = plan_sliced(metas, slices, bucket_bytes)
            entry = (plan, plan_fragment(rank_placements(plan, rank)))
        else:
            plan = plan_buckets(metas, bucket_bytes)
            entry = (plan, plan_fragment([[(p.meta.name, p.meta.dtype, p.meta.shape, p.offset) for p in b.placements]
                                          for b in plan.buckets]))
        return self._plans.put(key, entry)   # sliced plans too: one per (slice plan, rank) would pile up
