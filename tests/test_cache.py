"""moekit.runtime.cache helpers."""

from __future__ import annotations

from moekit.runtime.cache import cache_clear, cache_get, first_time


def test_first_time_is_true_once_per_key():
    cache_clear("test_first_time")
    assert first_time(("test_first_time", 1))
    assert not first_time(("test_first_time", 1))
    assert first_time(("test_first_time", 2))
    assert cache_get(("test_first_time", 1)) is not None
    cache_clear("test_first_time")
    assert first_time(("test_first_time", 1))  # forgotten with the cache
