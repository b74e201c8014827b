"""Everything moekit keeps between calls, in one object: :data:`STATE`, emptied by :func:`clear`.

It holds the bounded cache of per-configuration entries (plans, recorded launches, tuned
configs; :mod:`moekit.runtime.cache`), the kernels' per-stream scratch buffers and tile
counters, the compile jobs in flight, the symmetric-memory pools, the tuned configs read from
disk, the one-time warnings already given, and the memos of pure functions
(:func:`memoized`). Importing moekit creates the empty containers and nothing else.

:func:`clear` (also ``moekit.clear_state()``) drops all of it; the next call of an op builds
again what it needs (Triton's own on-disk cache keeps compiled kernels). Call it where no
moekit kernel is in flight (after ``torch.cuda.synchronize()``), and on every rank of a
process group that shares a pool, since the pools are dropped too.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["STATE", "State", "clear", "memoized", "warn_once"]


@dataclasses.dataclass(eq=False)
class State:
    """moekit's process-wide state (see the module docstring)."""

    # key (kind, static facts...) -> entry, least recently used first (moekit.runtime.cache)
    cache: OrderedDict[Hashable, Any] = dataclasses.field(default_factory=OrderedDict)
    # (device, raw stream) -> kernel scratch buffer reused by the launches on that stream
    scratch: dict[tuple[int, int | None], Any] = dataclasses.field(default_factory=dict)
    # (device, raw stream) -> the tile counter of that stream
    tile_counters: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)
    # address -> every live tile counter (launch replay tells counter arguments apart by it)
    counter_ptrs: weakref.WeakValueDictionary = dataclasses.field(
        default_factory=weakref.WeakValueDictionary
    )
    # Triton cache key -> compile job still running (moekit.runtime.replay.compile_ahead)
    compiles: dict[str, Any] = dataclasses.field(default_factory=dict)
    compiles_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    # parameter -> {Fp8Recipe: (the version they were made at, its FP8 copies)}
    # (moekit.ops.fp8_linear); an entry goes with its parameter
    fp8_weights: Any = dataclasses.field(default_factory=lambda: WeakIdKeyDictionary())
    # (group name, use) -> symmetric-memory pool (moekit.distributed.symmetric_pool)
    pools: dict[tuple[str, str], Any] = dataclasses.field(default_factory=dict)
    # bumped whenever a pool may change, so that what is derived from a pool is keyed on it
    pool_generation: int = 0
    # tuning file path -> the configs read from it (moekit.tuning.store)
    tuned: dict[str, dict[str, dict]] = dataclasses.field(default_factory=dict)
    # (kind, ...) -> small lookups that torch.compile must trace through (a plain dict)
    lookups: dict[Hashable, Any] = dataclasses.field(default_factory=dict)
    # keys of the one-time warnings already given
    warned: set[Hashable] = dataclasses.field(default_factory=set)
    # the functools caches of memoized pure functions
    memos: list[Any] = dataclasses.field(default_factory=list)
    # What clear() keeps: registrations and open contexts, not derived state.
    # the fusion rules by name, the rule overrides of open `fusions()` blocks, and a counter
    # bumped by every change of either (plans are keyed on it)
    fusion_rules: dict[str, Any] = dataclasses.field(default_factory=dict)
    fusion_overrides: list[tuple[frozenset, frozenset]] = dataclasses.field(default_factory=list)
    fusion_generation: int = 0
    # inside `moekit.runtime.op.dispatcher_only()`: every op takes the dispatcher
    dispatcher_only: bool = False
    # ids handed to plans that key cache entries: never reused, so never reset (a live plan
    # from before a clear() must not meet a new plan's entries)
    uids: itertools.count = dataclasses.field(default_factory=lambda: itertools.count(1))

    def clear(self) -> None:
        """Drop every entry (see the module docstring); counters keep counting, and the
        registrations and open contexts listed above stay."""
        for store in (self.cache, self.scratch, self.tile_counters, self.counter_ptrs,
                      self.fp8_weights, self.pools, self.tuned, self.lookups,
                      self.warned):  # fmt: skip
            store.clear()
        with self.compiles_lock:
            self.compiles.clear()
        self.pool_generation += 1
        for memo in self.memos:
            memo.cache_clear()


STATE = State()


def clear() -> None:
    """Empty :data:`STATE`: every cache, buffer, pool and memo moekit keeps between calls."""
    STATE.clear()


def memoized(fn: Callable | None = None, *, maxsize: int | None = None):
    """``functools.lru_cache`` (unbounded by default) whose memo :func:`clear` empties."""

    def wrap(f: Callable) -> Callable:
        memo = functools.lru_cache(maxsize=maxsize)(f)
        STATE.memos.append(memo)
        return memo

    return wrap(fn) if fn is not None else wrap


def warn_once(key: Hashable, message: str, category=RuntimeWarning, stacklevel: int = 2) -> None:
    """``warnings.warn(message)`` the first time ``key`` is given (until :func:`clear`)."""
    if key in STATE.warned:
        return
    STATE.warned.add(key)
    warnings.warn(message, category, stacklevel=stacklevel + 1)
