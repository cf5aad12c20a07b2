"""Micro-batches read and planned in data-loader worker processes (``--num-workers N > 0``).

A plan is a pure function of the batch's document lengths and the topology's shape, so a process
without process groups can make it. ``plan_in_workers`` has N forked torch DataLoader workers each read
a micro-batch (``read(i)``), derive its ``cu_seqlens`` and build the plan's rank-independent data
(``plan.build_plan_data``), ``prefetch_factor`` micro-batches per worker ahead; the training process
only stores that data in ``plan.PLAN_CACHE``, so its own ``plan_batch`` (in ``pack_micro_batch``) is a
hit and it never plans. Any rank planning the same micro-batch gets the same plan data, in a worker or
not (same function, same arguments). ``--num-workers 0`` reads in the training process and plans in a
thread there instead (``prefetch.plan_ahead``).

Workers are forked, as Megatron-LM's (the dataset and ``read`` need not pickle). Each one leaves the
rank's process group, so the signals the launcher forwards to that group (with
``--exit-signal-handler`` the rank finishes its iteration, which still needs them) do not stop it, and
is killed by the kernel when the rank dies, however it ends (``PR_SET_PDEATHSIG``); otherwise workers
exit once the last item is received, or with the iterator. An error in a worker (bad token ids, bad ``cu_seqlens``) is sent back as the
result and raised in the training process with its type and message, at the micro-batch that caused it.
"""

from __future__ import annotations

import os
import pickle
from functools import partial
from typing import Any, Callable, Iterator, Optional, Sequence, Tuple, TypeVar, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.sequence.cost_model import CostModel
from megatron_hsap.sequence.plan import PlanKey, build_plan_data, plan_key, store_plan_data
from megatron_hsap.training.rank_helpers import block_preemption_signals, die_with_parent

__all__ = ["plan_in_workers"]

Item = TypeVar("Item")


def plan_in_workers(read: Callable[[int], Item], indices: Sequence[int],
                    cu_seqlens_of: Callable[[Item], torch.Tensor], topology: CPTopology, layout: str, *,
                    num_workers: int, cost_model: Optional[CostModel] = None, prefetch_factor: int = 2
                    ) -> Iterator[Item]:
    """Yield ``read(i)`` for ``i`` in ``indices``, in order, each read and planned in one of ``num_workers``
    worker processes; its plan data is in ``PLAN_CACHE`` when it is yielded, so the caller's own
    ``plan_batch(cu_seqlens_of(item), topology, layout, cost_model=cost_model)`` is a cache hit.

    Items must pickle; a dict item's tensors travel by value (``_by_value``), and its tensors and numpy
    arrays arrive as tensors. The workers start here; they stop once the last item is received, or when
    the iterator is closed or collected. Bad arguments raise ValueError here.
    """
    for name, value in (("num_workers", num_workers), ("prefetch_factor", prefetch_factor)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if not isinstance(topology, CPTopology):
        raise ValueError(f"topology must be a CPTopology, got {type(topology).__name__}")
    for name, function in (("read", read), ("cu_seqlens_of", cu_seqlens_of)):
        if not callable(function):
            raise ValueError(f"{name} must be callable, got {type(function).__name__}")
    planned = _Planned(read, cu_seqlens_of, topology.signature(), layout, cost_model)
    # Own generator: the workers' seeds must not draw from the training RNG (dropout, exact resumes).
    loader = DataLoader(planned, batch_size=None, sampler=indices, num_workers=num_workers,
                        prefetch_factor=prefetch_factor, collate_fn=_unchanged,
                        worker_init_fn=partial(_leave_signals_to_parent, os.getpid()),
                        multiprocessing_context="fork", generator=torch.Generator())
    return _cached(iter(loader), len(indices))


#: A worker's answer: (item, plan key, plan data) or the error.
Result = Union[Tuple[Any, PlanKey, Any], Exception]


class _Planned(Dataset):
    """Item ``i``: ``(read(i), its plan key, its plan data)``, or the exception that stopped it."""

    def __init__(self, read: Callable[[int], Any], cu_seqlens_of: Callable[[Any], torch.Tensor],
                 topology_signature: Tuple[int, int, Tuple[int, ...]], layout: str,
                 cost_model: Optional[CostModel]) -> None:
        self.read, self.cu_seqlens_of = read, cu_seqlens_of
        self.topology_signature, self.layout, self.cost_model = topology_signature, layout, cost_model

    def __getitem__(self, index: int) -> Result:
        try:
            item = self.read(index)
            key = plan_key(self.cu_seqlens_of(item), self.topology_signature, self.layout, self.cost_model)
            return _by_value(item), key, build_plan_data(*key)
        except Exception as error:  # raised by the training process, at this item
            return _picklable(error)


def _by_value(item: Any) -> Any:
    """A dict item's tensors as numpy arrays, pickled by value through the worker's pipe: for micro-batches
    that costs the training process less than torch's shared-memory hand-over, which waits for a round trip
    to the worker per tensor (4-6 ms vs 1.6-2 ms per micro-batch of three [1, 8192] tensors, loaded 2 cores).
    Tensors numpy cannot hold (bf16, requiring grad) keep the shared-memory way."""
    if not isinstance(item, dict):
        return item
    return {key: _numpy_or_tensor(value) if isinstance(value, torch.Tensor) else value for key, value in item.items()}


def _numpy_or_tensor(tensor: torch.Tensor) -> Any:
    try:
        return tensor.numpy()
    except (TypeError, RuntimeError):
        return tensor


def _as_tensors(item: Any) -> Any:
    """``_by_value``'s inverse in the training process: a dict item's numpy arrays as tensors (no copy)."""
    if not isinstance(item, dict):
        return item
    return {key: torch.from_numpy(value) if isinstance(value, np.ndarray) else value for key, value in item.items()}


def _picklable(error: Exception) -> Exception:
    """``error`` when it survives the trip to the training process, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def _unchanged(result: Result) -> Result:
    return result


def _leave_signals_to_parent(parent: int, _worker_id: int) -> None:
    """Worker start: out of the rank's process group (its signals are the rank's), dead with the rank, deaf to
    the preemption signals (the rank handles them)."""
    os.setpgid(0, 0)
    block_preemption_signals()
    die_with_parent(parent)


def _cached(results: Iterator[Result], count: int) -> Iterator[Any]:
    """The items of ``results`` (``count`` of them), their plan data stored in ``PLAN_CACHE`` first."""
    try:
        for number, result in enumerate(results, 1):
            if isinstance(result, Exception):
                raise result
            item, key, data = result
            store_plan_data(key, data)
            # All received: the loader stops its workers now, not when the iterator is collected (the
            # training loop never asks past its last micro-batch and keeps its iterator until it returns).
            if number == count:
                next(results, None)
            yield _as_tensors(item)
    finally:
        # Shut the workers down now (the DataLoader iterator's __del__), even while a raised error's
        # traceback keeps this frame alive.
        del results
