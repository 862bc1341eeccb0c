"""The PS's cache of transfer plans.

A plan depends only on every rank's metas and the bucket size, so it is keyed by
(bucket size, metas digest), not by checkpoint name: successive RL steps with one
layout reuse one plan (and, through the plan's wire digest, the worker's validated
copy of it). A checkpoint's metas digest is computed once per gathered metas.
"""

from __future__ import annotations

import hashlib
import json

from ckpt_core.planning.buckets import Plan, TensorMeta, layout_sizes, plan_buckets
from ckpt_core.planning.slices import SlicePlan
from ckpt_core.planning.slice_routes import plan_sliced, rank_placements
from ckpt_core.wire.protocol import plan_fragment

PLAN_CACHE = 4      # plans kept; the least recently used goes first


class PlanCache:
    def __init__(self, size: int = PLAN_CACHE):
        self.size = size
        self._plans: dict[tuple, tuple[Plan, tuple[str, str]]] = {}
        self._digests: dict[str, tuple[list, str]] = {}   # checkpoint -> (the metas it digests, digest)
        self._sizes: dict[str, tuple[int, int]] = {}      # metas digest -> layout_sizes

    def digest(self, name: str, metas: list[list[TensorMeta]]) -> str:
        """Digest of a checkpoint's gathered metas (recomputed only when they were gathered again)."""
        cached = self._digests.get(name)
        if cached is None or cached[0] is not metas:
            text = json.dumps([[list(m) for m in ms] for ms in metas])
            cached = (metas, hashlib.sha1(text.encode()).hexdigest())
            self._digests[name] = cached
        return cached[1]

    def sizes(self, metas: list[list[TensorMeta]], digest: str) -> tuple[int, int]:
        """``layout_sizes`` of these metas, computed once per digest (every update asks)."""
        if digest not in self._sizes:
            while len(self._sizes) >= self.size:
                self._sizes.pop(next(iter(self._sizes)))
            self._sizes[digest] = layout_sizes(metas)
        return self._sizes[digest]

    def forget(self, name: str) -> None:
        self._digests.pop(name, None)

    def get(self, metas: list[list[TensorMeta]], digest: str, bucket_bytes: int, *,
            slices: SlicePlan | None = None, rank: int = 0) -> tuple[Plan, tuple[str, str]]:
        """The plan of these metas at this bucket size and its wire form (JSON, digest).

        With ``slices`` (``planning/slices.py``) each engine rank gets only its slices: the wire
        form is then PS rank ``rank``'s own (that of engine rank ``rank % T`` of the plan's T), and the plan is cached under the slice plan's digest too.
        """
        key = (bucket_bytes, digest) if slices is None else (bucket_bytes, digest, slices.digest, rank)
        if key in self._plans:
            entry = self._plans.pop(key)
        elif slices is not None:
            plan = plan_sliced(metas, slices, bucket_bytes)
            entry = (plan, plan_fragment(rank_placements(plan, rank)))
        else:
            plan = plan_buckets(metas, bucket_bytes)
            entry = (plan, plan_fragment([[(p.meta.name, p.meta.dtype, p.meta.shape, p.offset) for p in b.placements]
                                          for b in plan.buckets]))
        while len(self._plans) >= self.size:   # sliced plans too: one per (slice plan, rank) would pile up
            self._plans.pop(next(iter(self._plans)))
        self._plans[key] = entry     # most recently used last
        return entry
