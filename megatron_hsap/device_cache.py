"""Index tensors built on the host and kept on a device, in one least-recently-used cache bounded in bytes.

Plans and kernels turn Python-side row ranges into small index tensors (``cu_seqlens``,
gathered row indices, the ring's multi-range send rows) and reuse them for every layer
of a batch. A cache bounded by *entries* grows with the batch (a packed 1M-token batch
split into many passes holds tens of MiB); this one holds at most ``max_bytes`` of tensor
storage: inserting evicts the least recently used entries until the total fits, and a
tensor larger than the bound is returned without being kept. A tensor still used by a
running kernel stays alive through its own reference; eviction only drops the cache's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Hashable

import torch

__all__ = ["DeviceTensorCache", "DEVICE_INDEX_CACHE", "cached_device_index", "host_to_device"]


class DeviceTensorCache:
    """``get(key, build)`` returns the tensor cached under ``key`` or caches ``build()``'s result; thread-safe
    (plans may be built in data-loader threads)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} must be >= 0")
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: "OrderedDict[Hashable, torch.Tensor]" = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The tensor cached under ``key`` (now most recently used), or ``build()``'s result, cached if it fits."""
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
                self.bytes += size
                while self.bytes > self.max_bytes:
                    _, evicted = self._entries.popitem(last=False)
                    self.bytes -= evicted.numel() * evicted.element_size()
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0


#: The process's index tensors (kernels' cu_seqlens / row indices / TE stats positions, the ring's send rows).
#: 64 MiB holds the row indices of ~8M gathered rows; assign ``DEVICE_INDEX_CACHE.max_bytes`` to change it.
DEVICE_INDEX_CACHE = DeviceTensorCache(max_bytes=64 * 2 ** 20)


def host_to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host-built index data to ``device`` without blocking the host (pinned staging on CUDA)."""
    if device.type == "cuda":
        x = x.pin_memory()
    return x.to(device, non_blocking=True)


def cached_device_index(key: Hashable, device: torch.device, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``build()`` (a host tensor) on ``device``, cached in ``DEVICE_INDEX_CACHE`` under ``(key, device)``."""
    return DEVICE_INDEX_CACHE.get((key, device), lambda: host_to_device(build(), device))
