"""A bounded, thread-safe least-recently-used cache that also takes values built elsewhere.

``plan_batch`` keeps the rank-independent part of its plans here, keyed by what a plan depends on
(``plan.plan_key``). Unlike ``functools.lru_cache`` the cache is open to insertion (``put``):
data-loader worker processes plan batches ahead and the training process stores their plan data,
so its own ``plan_batch`` finds it. A lock guards it, since the planning thread
(``prefetch.plan_ahead``) and the training loop use it at the same time.

The bound is in bytes (``max_bytes``, as ``device_cache``'s), optionally also in entries: a plan of a
batch of many short documents holds tens of MB, so a count of entries bounds nothing. Each value is
measured when it is stored (``approximate_bytes``: its arrays and tensors, and its other containers'
items at 8 bytes each); a value larger than the whole budget is not kept.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from typing import Any, Callable, Dict, Generic, Hashable, Optional, TypeVar

import numpy as np
import torch

__all__ = ["PlanCache", "approximate_bytes"]

Value = TypeVar("Value")


def approximate_bytes(value: Any) -> int:
    """Bytes ``value`` holds: numpy arrays and tensors by their data, the items of tuples, lists, dicts and
    dataclasses walked into, any other item 8 bytes (a pointer; small ints are shared)."""
    total, todo, seen = 0, [value], set()
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, np.ndarray):
            total += item.nbytes
        elif isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, (tuple, list, set, frozenset)):
            total += 8 * len(item)
            todo.extend(x for x in item if not isinstance(x, (int, float, str)))
        elif isinstance(item, dict):
            total += 16 * len(item)
            todo.extend(item.keys())
            todo.extend(item.values())
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            todo.extend(vars(item).values())
        else:
            total += 8
    return total


class PlanCache(Generic[Value]):
    """At most ``max_bytes`` of values (``size_of`` each) and, if given, ``maxsize`` entries; ``put`` beyond
    either evicts the least recently used (read or written) entries.

    ``hits`` / ``misses`` count ``get`` calls, ``evictions`` the entries dropped for the bounds (the training
    script's closing line reports them)."""

    def __init__(self, maxsize: Optional[int] = None, max_bytes: Optional[int] = None,
                 size_of: Callable[[Any], int] = approximate_bytes) -> None:
        if maxsize is not None and (not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize < 1):
            raise ValueError(f"maxsize={maxsize!r} must be a positive int or None")
        if maxsize is None and max_bytes is None:
            raise ValueError("PlanCache needs a bound: maxsize (entries) or max_bytes")
        self.maxsize = maxsize
        self.max_bytes: Optional[int] = None
        self.set_max_bytes(max_bytes)
        self.size_of = size_of
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._entries: "OrderedDict[Hashable, Value]" = OrderedDict()
        self._sizes: Dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def set_max_bytes(self, max_bytes: Optional[int]) -> None:
        """Change the byte budget (None: no byte bound); entries beyond it are evicted at the next ``put``."""
        if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0):
            raise ValueError(f"max_bytes={max_bytes!r} must be a non-negative int or None")
        self.max_bytes = max_bytes

    def get(self, key: Hashable) -> Optional[Value]:
        """The value stored under ``key`` (now the most recently used), or None."""
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.misses += 1
            else:
                self.hits += 1
                self._entries.move_to_end(key)
            return value

    def put(self, key: Hashable, value: Value) -> None:
        """Store ``value`` under ``key`` (replacing any), evicting the least recently used beyond the bounds;
        a value larger than ``max_bytes`` is not stored."""
        if value is None:
            raise ValueError("PlanCache cannot store None (get returns None for a missing key)")
        size = self.size_of(value) if self.max_bytes is not None else 0
        with self._lock:
            self._drop(key)
            if self.max_bytes is not None and size > self.max_bytes:
                return
            self._entries[key] = value
            self._sizes[key] = size
            self.bytes += size
            self._evict()

    def add_bytes(self, key: Hashable, extra: int) -> None:
        """The value under ``key`` grew by ``extra`` bytes since ``put`` (what it built on use, e.g. a plan's
        schedules): count them, evicting the least recently used beyond the bounds (this entry too, when it
        alone is over ``max_bytes``). A key no longer stored is ignored."""
        with self._lock:
            if key in self._entries and self.max_bytes is not None:
                self._sizes[key] += extra
                self.bytes += extra
                self._evict()

    def _evict(self) -> None:
        while (self.maxsize is not None and len(self._entries) > self.maxsize) or \
                (self.max_bytes is not None and self.bytes > self.max_bytes):
            self._drop(next(iter(self._entries)))
            self.evictions += 1

    def _drop(self, key: Hashable) -> None:
        if key in self._entries:
            del self._entries[key]
            self.bytes -= self._sizes.pop(key)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def clear(self) -> None:
        """Drop every entry and reset the counters."""
        with self._lock:
            self._entries.clear()
            self._sizes.clear()
            self.bytes = 0
            self.hits = self.misses = self.evictions = 0
