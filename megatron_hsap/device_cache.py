"""A least-recently-used cache of small device tensors (row indices) bounded by their total bytes.

Plans and kernels turn Python-side row ranges into index tensors on the device once and
reuse them for every layer of a batch. A dict keyed by plan would keep one set per batch
forever; this cache evicts the least recently used entries once ``max_bytes`` is exceeded,
so device memory held by indices never grows with the number of batches.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Hashable

import torch

#: Default budget per cache: far above one batch's indices at 1M tokens, far below the activations.
DEFAULT_MAX_BYTES = 64 * 2**20


class DeviceTensorCache:
    """``get(key, build)`` returns the cached tensor for ``key`` or stores ``build()``; thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} must be >= 0")
        self.max_bytes = max_bytes
        self._entries: "OrderedDict[Hashable, torch.Tensor]" = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit
        value = build()
        size = value.numel() * value.element_size()
        with self._lock:
            if key not in self._entries and size <= self.max_bytes:
                self._entries[key] = value
                self._bytes += size
                while self._bytes > self.max_bytes:
                    _, old = self._entries.popitem(last=False)
                    self._bytes -= old.numel() * old.element_size()
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
