"""Plans off the critical path, in a thread: plan the next batches in the background while the current one trains.

A plan is a pure function of the batch's document lengths, the topology's shape, the
layout and the cost model (``plan_batch``), so every rank that plans the same stream of
``cu_seqlens`` gets identical plans without communicating; the rank-independent part is
shared through ``plan_batch``'s bounded cache (``plan.PLAN_CACHE``). ``PlanPrefetcher`` only moves
that work ahead in time: it keeps at most ``depth`` planned batches waiting.

``plan_ahead`` is the form the training loop uses with ``--num-workers 0`` (with workers, the data-loader
worker processes plan instead: ``training.plan_workers``): it passes the micro-batches through unchanged while
the next ``depth`` of them are planned in the background, so the loop's own ``plan_batch`` call (inside
``pack_micro_batch``) finds the plan in the cache. The planning thread holds the GIL only between
torch calls of the training step (which release it), and ``plan_batch``'s cache (64 entries) is far
deeper than ``depth``, so a plan made ahead is still cached when its batch is used.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterable, Iterator, Optional, Tuple, TypeVar

import torch

from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.sequence.cost_model import CostModel
from megatron_hsap.sequence.plan import BatchPlan, plan_batch
from megatron_hsap.sequence.placement_config import PlacementConfig

__all__ = ["PlanPrefetcher", "plan_ahead"]

_END = object()
Item = TypeVar("Item")


class PlanPrefetcher:
    """Iterate ``(item, plan)`` over a stream, planning up to ``depth`` items ahead in a daemon thread.

    Items are ``cu_seqlens`` (int ``[num_docs + 1]``, the global packed batch) unless ``cu_seqlens_of``
    derives them from an item (a micro-batch dict, say). Errors of the stream, of ``cu_seqlens_of`` or of
    ``plan_batch`` (bad ``cu_seqlens``) are raised by ``next`` at the item that caused them."""

    def __init__(self, stream: Iterable[Any], topology: CPTopology, layout: str = "zigzag", *,
                 cost_model: Optional[CostModel] = None, placement: Optional[PlacementConfig] = None,
                 depth: int = 2, cu_seqlens_of: Optional[Callable[[Any], torch.Tensor]] = None) -> None:
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"depth={depth!r} must be a positive int")
        if not isinstance(topology, CPTopology):
            raise ValueError(f"topology must be a CPTopology, got {type(topology).__name__}")
        if cu_seqlens_of is not None and not callable(cu_seqlens_of):
            raise ValueError(f"cu_seqlens_of must be callable or None, got {type(cu_seqlens_of).__name__}")
        self._queue: "queue.Queue" = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work,
                                        args=(iter(stream), topology, layout, cost_model, placement, cu_seqlens_of),
                                        name="plan-prefetch", daemon=True)
        self._thread.start()

    def _work(self, stream: Iterator[Any], topology: CPTopology, layout: str, cost_model: Optional[CostModel],
              placement: Optional[PlacementConfig], cu_seqlens_of: Optional[Callable[[Any], torch.Tensor]]) -> None:
        while not self._stop.is_set():
            try:
                item = next(stream)
            except StopIteration:
                self._put(_END)
                return
            except BaseException as error:  # handed to the consumer, then the stream ends
                self._put(error)
                return
            try:
                cu_seqlens = item if cu_seqlens_of is None else cu_seqlens_of(item)
                self._put((item, plan_batch(cu_seqlens, topology, layout, cost_model=cost_model, placement=placement)))
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

    def __next__(self) -> Tuple[Any, BatchPlan]:
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


def plan_ahead(batches: Iterable[Item], cu_seqlens_of: Callable[[Item], torch.Tensor], topology: CPTopology,
               layout: str, *, cost_model: Optional[CostModel] = None, placement: Optional[PlacementConfig] = None,
               depth: int = 2) -> Iterator[Item]:
    """Yield ``batches`` unchanged, in order, while the next ``depth`` are planned in a background thread
    (``cu_seqlens_of(batch)``: the batch's global document boundaries, the same on every rank): the caller's
    own ``plan_batch(cu_seqlens_of(batch), topology, layout)`` is then a cache hit. Identical plans on every
    rank, since plans are pure functions of the lengths and the topology's shape. Errors surface at the
    batch that caused them; the thread stops when the iterator is exhausted, closed or collected. Bad
    arguments raise ValueError here, before the first batch."""
    return _batches_of(PlanPrefetcher(batches, topology, layout, cost_model=cost_model, placement=placement,
                                      depth=depth, cu_seqlens_of=cu_seqlens_of))


def _batches_of(prefetcher: PlanPrefetcher) -> Iterator[Any]:
    try:
        for batch, _ in prefetcher:
            yield batch
    finally:
        prefetcher.close()
