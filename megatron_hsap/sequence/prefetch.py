"""Plans off the critical path: plan the next batches in a background thread while the current one trains.

A plan is a pure function of the batch's document lengths, the topology's shape, the
layout and the cost model (``plan_batch``), so every rank that plans the same stream of
``cu_seqlens`` gets identical plans without communicating; the rank-independent part is
shared through ``plan_batch``'s bounded LRU cache. ``PlanPrefetcher`` only moves that work
ahead in time: it keeps at most ``depth`` planned batches waiting.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator, Optional, Tuple

import torch

from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.sequence.cost_model import CostModel
from megatron_hsap.sequence.plan import BatchPlan, plan_batch

__all__ = ["PlanPrefetcher"]

_END = object()


class PlanPrefetcher:
    """Iterate ``(cu_seqlens, plan)`` over a stream of ``cu_seqlens`` (int ``[num_docs + 1]``, the global
    packed batch), planning up to ``depth`` batches ahead in a daemon thread. Errors of the stream or of
    ``plan_batch`` (bad ``cu_seqlens``) are raised by ``next`` at the batch that caused them."""

    def __init__(self, cu_seqlens_stream: Iterable[torch.Tensor], topology: CPTopology, layout: str = "zigzag", *,
                 cost_model: Optional[CostModel] = None, depth: int = 2) -> None:
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"depth={depth!r} must be a positive int")
        if not isinstance(topology, CPTopology):
            raise ValueError(f"topology must be a CPTopology, got {type(topology).__name__}")
        self._queue: "queue.Queue" = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(iter(cu_seqlens_stream), topology, layout, cost_model),
                                        name="plan-prefetch", daemon=True)
        self._thread.start()

    def _work(self, stream: Iterator[torch.Tensor], topology: CPTopology, layout: str,
              cost_model: Optional[CostModel]) -> None:
        while not self._stop.is_set():
            try:
                cu_seqlens = next(stream)
            except StopIteration:
                self._put(_END)
                return
            except BaseException as error:  # handed to the consumer, then the stream ends
                self._put(error)
                return
            try:
                self._put((cu_seqlens, plan_batch(cu_seqlens, topology, layout, cost_model=cost_model)))
            except BaseException as error:
                self._put(error)
                return

    def _put(self, item: object) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> "PlanPrefetcher":
        return self

    def __next__(self) -> Tuple[torch.Tensor, BatchPlan]:
        if self._stop.is_set():
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    def close(self) -> None:
        """Stop planning ahead (the thread ends at its next batch boundary)."""
        self._stop.set()
        self._thread.join(timeout=5.0)
