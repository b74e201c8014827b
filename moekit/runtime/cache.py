"""The one cache of moekit: static per-configuration state, bounded, least recently used out.

Everything moekit remembers between calls lives here, keyed by a tuple whose first element
names the kind of entry: an op's validated plan, its recorded kernel launches, an autotuned
config. Keys hold only static facts (shapes, strides, dtypes, devices, flags), never a ragged
size or a tensor, so a training loop reuses a handful of entries; the bound keeps a caller
that cycles through endless shapes from growing it without limit.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from moekit.runtime.state import STATE

__all__ = ["MAX_ENTRIES", "cache_clear", "cache_entries", "cache_get", "cached", "first_time"]

MAX_ENTRIES = 2048

_entries = STATE.cache  # the same OrderedDict for the life of the process (cleared in place)


def cached(key: Hashable, build: Callable[[], Any]) -> Any:
    """The entry of ``key``, built by ``build()`` on a miss (and the oldest entry evicted when
    the cache is full)."""
    try:
        value = _entries[key]
    except KeyError:
        value = build()
        if len(_entries) >= MAX_ENTRIES:
            _entries.popitem(last=False)
        _entries[key] = value
        return value
    _entries.move_to_end(key)
    return value


def cache_get(key: Hashable) -> Any:
    """The entry of ``key``, or None; builds nothing."""
    return _entries.get(key)


def first_time(key: Hashable) -> bool:
    """True the first time ``key`` is asked about (it is remembered from then on)."""
    if key in _entries:
        _entries.move_to_end(key)
        return False
    cached(key, lambda: True)
    return True


def cache_entries(kind: str) -> dict[Hashable, Any]:
    """The live entries whose key starts with ``kind`` (for inspection and tests)."""
    return {k: v for k, v in _entries.items() if isinstance(k, tuple) and k and k[0] == kind}


def cache_clear(kind: str | None = None) -> None:
    """Drop every entry, or those whose key starts with ``kind``."""
    if kind is None:
        _entries.clear()
        return
    for key in list(cache_entries(kind)):
        del _entries[key]
