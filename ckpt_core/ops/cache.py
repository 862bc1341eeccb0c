"""The one bounded cache of ckpt-engine: a few entries by key, the oldest evicted first.

Plans (transfer plans, validated wire plans, slice plans, recordings) are cached by what they
depend on and kept to a handful, since each can be tens of MB. ``put`` makes a key the newest;
``get(key, touch=True)`` does too (least recently used first out), ``get(key)`` leaves the order as it
is (first in, first out). Not thread-safe: each owner uses its cache from one thread.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

from ckpt_core.errors import ConfigError

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedCache(Generic[K, V]):
    """At most ``size`` entries; putting one more evicts the oldest (insertion or last touch)."""

    def __init__(self, size: int):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"a bounded cache holds at least one entry, got size={size!r}")
        self.size = size
        self._entries: dict[K, V] = {}   # oldest first (dicts keep insertion order)

    def get(self, key: K, *, touch: bool = False) -> V | None:
        """The entry of ``key`` or None; ``touch=True`` makes it the newest."""
        if touch and key in self._entries:
            self._entries[key] = self._entries.pop(key)
        return self._entries.get(key)

    def put(self, key: K, value: V) -> V:
        """Store ``value`` as the newest entry (replacing ``key``'s), evicting the oldest beyond ``size``."""
        self._entries.pop(key, None)
        while len(self._entries) >= self.size:
            self._entries.pop(next(iter(self._entries)))
        self._entries[key] = value
        return value

    def pop(self, key: K) -> V | None:
        return self._entries.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[K]:
        """The keys, oldest first."""
        return iter(list(self._entries))

    def clear(self) -> None:
        self._entries.clear()
