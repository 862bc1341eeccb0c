"""ckpt_core.ops.cache.BoundedCache: the one bounded cache the plan caches share."""

import pytest

from ckpt_core.errors import ConfigError
from ckpt_core.ops.cache import BoundedCache


def test_the_oldest_entry_goes_first_and_a_plain_get_does_not_reorder():
    cache = BoundedCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1
    cache.put("c", 3)                      # a was put first: it goes, the get did not save it
    assert list(cache) == ["b", "c"] and cache.get("a") is None and len(cache) == 2


def test_a_touching_get_and_a_put_make_an_entry_the_newest():
    cache = BoundedCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a", touch=True) == 1
    cache.put("c", 3)                      # b is now the least recently used
    assert list(cache) == ["a", "c"]
    cache.put("a", 10)                     # replacing a value renews it and evicts nothing
    assert list(cache) == ["c", "a"] and cache.get("a") == 10
    assert cache.get("missing", touch=True) is None and "missing" not in cache


def test_pop_clear_and_bad_sizes():
    cache = BoundedCache(3)
    assert cache.put("a", 1) == 1 and cache.pop("a") == 1 and cache.pop("a") is None
    cache.put("b", 2)
    cache.clear()
    assert not cache
    for size in (0, -1, 1.5, True, "4"):
        with pytest.raises(ConfigError, match="at least one entry"):
            BoundedCache(size)
