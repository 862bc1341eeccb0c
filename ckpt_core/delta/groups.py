"""Disjoint sets of names (union-find): the engine adapters' delta maps group checkpoint tensors with the
layers or modules they load into (``ckpt_vllm/_delta_map.py``, ``ckpt_sglang/_delta.py``)."""

from __future__ import annotations


class Groups:
    """Names joined into groups; ``find`` gives a group's representative (path halving)."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        parent = self.parent
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: str, b: str) -> None:
        self.parent[self.find(a)] = self.find(b)

    def __iter__(self):
        return iter(list(self.parent))


__all__ = ["Groups"]
