"""Peak live tensor memory of a code region, on CPU as on GPU.

CPU has no allocator statistics, so the CPU tracker watches the dispatcher: a
``TorchDispatchMode`` sees every aten op (factory functions, autograd's backward
ops and collectives included), counts each *new* storage an op returns once (views
and in-place results share their input's storage and add nothing) and subtracts
it when the storage is freed (a weakref finalizer on the storage object; torch
keeps that Python object alive exactly as long as the storage). Memory that does
not come from an op (``torch.from_numpy``, unpickled tensors) and scratch space
inside a single kernel are invisible to it.

On CUDA the allocator's own counters are used (``max_memory_allocated`` minus the
bytes allocated at entry), with nesting handled so an inner region's reset of the
peak statistics does not lose the outer region's peak.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Dict, Iterator, List, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["MemoryTracker", "track_peak_memory"]


class MemoryTracker:
    """Live and peak bytes allocated inside one region, above what was live at entry.

    ``peak_bytes`` and ``current_bytes`` are up to date while the region runs and
    frozen when it exits.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._current = 0
        self._peak = 0

    @property
    def peak_bytes(self) -> int:
        return self._peak

    @property
    def current_bytes(self) -> int:
        return self._current

    def __repr__(self) -> str:
        return f"MemoryTracker(device={self.device}, peak_bytes={self.peak_bytes}, current_bytes={self.current_bytes})"


class _StorageCounter(TorchDispatchMode):
    """Counts storages of ``device_type`` created by ops while active (see the module docstring)."""

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self._tracker = tracker
        self._live: Dict[int, weakref.finalize] = {}  # StorageImpl address -> finalizer that uncounts it
        self._lock = threading.Lock()
        self._active = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {s._cdata for s in self._storages(tree_flatten((args, kwargs))[0])}
        for storage in self._storages(tree_flatten(out)[0]):
            key = storage._cdata
            if key in self._live or key in inputs or storage.nbytes() == 0:
                continue
            with self._lock:
                self._live[key] = weakref.finalize(storage, self._release, key, storage.nbytes())
                self._tracker._current += storage.nbytes()
                self._tracker._peak = max(self._tracker._peak, self._tracker._current)
        return out

    def _storages(self, values: List[object]) -> Iterator[torch.UntypedStorage]:
        for value in values:
            if (isinstance(value, torch.Tensor) and value.layout == torch.strided
                    and value.device.type == self._tracker.device.type):
                yield value.untyped_storage()

    def _release(self, key: int, nbytes: int) -> None:
        with self._lock:
            if self._active and self._live.pop(key, None) is not None:
                self._tracker._current -= nbytes

    def close(self) -> None:
        """Freeze the tracker: later frees no longer change it."""
        with self._lock:
            self._active = False
            for finalizer in self._live.values():
                finalizer.detach()
            self._live.clear()


_cuda_active: List["_CudaTracker"] = []


class _CudaTracker(MemoryTracker):
    """Reads the CUDA caching allocator's counters; values are refreshed on access while the region runs."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._baseline = 0
        self._peak_seen = 0  # allocator peak before an inner region reset the statistics
        self._running = False

    @property
    def peak_bytes(self) -> int:
        if self._running:
            self._refresh()
        return self._peak

    @property
    def current_bytes(self) -> int:
        if self._running:
            self._refresh()
        return self._current

    def _refresh(self) -> None:
        self._peak = max(self._peak_seen, torch.cuda.max_memory_allocated(self.device)) - self._baseline
        self._current = torch.cuda.memory_allocated(self.device) - self._baseline

    def start(self) -> None:
        for outer in _cuda_active:
            if outer.device == self.device:
                outer._peak_seen = max(outer._peak_seen, torch.cuda.max_memory_allocated(self.device))
        torch.cuda.synchronize(self.device)
        self._baseline = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._running = True
        _cuda_active.append(self)

    def stop(self) -> None:
        torch.cuda.synchronize(self.device)
        self._refresh()
        self._running = False
        _cuda_active.remove(self)


def _resolve_device(device: Union[torch.device, str, None]) -> torch.device:
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device} was requested but CUDA is not available; use device='cpu'")
        return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device.type != "cpu":
        raise ValueError(f"device={device} is not supported; allowed: 'cpu', 'cuda[:index]' or None")
    return device


@contextlib.contextmanager
def track_peak_memory(device: Union[torch.device, str, None] = None) -> Iterator[MemoryTracker]:
    """Track the peak of live tensor bytes allocated inside the ``with`` block.

    device: 'cpu' (dispatcher-level counting of CPU storages), 'cuda[:i]' (allocator
    counters), or None for the current CUDA device when available, else CPU.
    Yields a ``MemoryTracker``; regions may be nested.
    """
    resolved = _resolve_device(device)
    if resolved.type == "cuda":
        tracker = _CudaTracker(resolved)
        tracker.start()
        try:
            yield tracker
        finally:
            tracker.stop()
        return
    tracker = MemoryTracker(resolved)
    mode = _StorageCounter(tracker)
    try:
        with mode:
            yield tracker
    finally:
        mode.close()
