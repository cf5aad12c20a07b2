"""A bounded, thread-safe least-recently-used cache that also takes values built elsewhere.

``plan_batch`` keeps the rank-independent part of its plans here, keyed by what a plan depends on
(``plan.plan_key``). Unlike ``functools.lru_cache`` the cache is open to insertion (``put``):
data-loader worker processes plan batches ahead and the training process stores their plan data,
so its own ``plan_batch`` finds it. A lock guards it, since the planning thread
(``prefetch.plan_ahead``) and the training loop use it at the same time.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, Hashable, Optional, TypeVar

__all__ = ["PlanCache"]

Value = TypeVar("Value")


class PlanCache(Generic[Value]):
    """At most ``maxsize`` entries; ``put`` beyond that evicts the least recently used (read or written) one.

    ``hits`` / ``misses`` count ``get`` calls (tests and benchmarks read them)."""

    def __init__(self, maxsize: int) -> None:
        if not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize < 1:
            raise ValueError(f"maxsize={maxsize!r} must be a positive int")
        self.maxsize = maxsize
        self.hits = 0
        self.misses = 0
        self._entries: "OrderedDict[Hashable, Value]" = OrderedDict()
        self._lock = threading.Lock()

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
        """Store ``value`` under ``key`` (replacing any), evicting the least recently used beyond ``maxsize``."""
        if value is None:
            raise ValueError("PlanCache cannot store None (get returns None for a missing key)")
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def clear(self) -> None:
        """Drop every entry and reset the counters."""
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0
