"""PlanPrefetcher / plan_ahead: plans made ahead in a thread equal plan_batch's (and an uncached plan), in order,
and are cache hits when the loop asks for them; errors surface at their batch.

Fast (no processes): ``.venv/bin/python -m pytest tests/test_prefetch.py -q``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths, sample_doc_lengths
from megatron_hsap.sequence.plan import PLAN_CACHE, build_plan_data, plan_batch
from megatron_hsap.sequence.prefetch import PlanPrefetcher, plan_ahead
from megatron_hsap.training.packing import document_cu_seqlens


@pytest.mark.parametrize("layout", ["sequence-aware", "zigzag"])
def test_prefetched_plans_equal_direct_plans_in_order(layout: str) -> None:
    topo = CPTopology.offline(8, 2, 4)
    stream = [cu_seqlens_from_lengths(sample_doc_lengths(1 << 14, seed=s)) for s in range(6)]
    got = list(PlanPrefetcher(iter(stream), topo, layout, depth=2))
    assert len(got) == len(stream)
    for cu, (seen, plan) in zip(stream, got):
        assert seen is cu
        # The same lengths planned from scratch, bypassing the cache the prefetcher just filled (plan_batch
        # would return that very entry): the same placement.
        lengths = tuple(int(n) for n in (cu[1:] - cu[:-1]).tolist())
        fresh = build_plan_data(lengths, topo.signature(), layout, None)
        assert fresh is not plan._data
        assert plan.rank_segments == fresh.rank_segments and plan.layout == layout


def test_errors_surface_at_the_batch_that_caused_them() -> None:
    topo = CPTopology.offline(2, 1, 2)
    stream = [cu_seqlens_from_lengths([3, 5]), torch.tensor([0, 4, 2]), cu_seqlens_from_lengths([1])]
    prefetcher = PlanPrefetcher(stream, topo, "contiguous")
    cu, plan = next(prefetcher)
    assert plan.doc_lengths == (3, 5)
    with pytest.raises(ValueError, match="non-decreasing"):
        next(prefetcher)
    with pytest.raises(StopIteration):
        next(prefetcher)


def test_bad_arguments_raise_value_error() -> None:
    topo = CPTopology.offline(2, 1, 2)
    with pytest.raises(ValueError, match="depth"):
        PlanPrefetcher([], topo, depth=0)
    with pytest.raises(ValueError, match="topology"):
        PlanPrefetcher([], "2x1")


def test_close_stops_an_endless_stream() -> None:
    topo = CPTopology.offline(2, 1, 2)

    def endless():
        while True:
            yield cu_seqlens_from_lengths([4, 4])

    prefetcher = PlanPrefetcher(endless(), topo, "zigzag", depth=1)
    next(prefetcher)
    prefetcher.close()
    assert not prefetcher._thread.is_alive()
    with pytest.raises(StopIteration):
        next(prefetcher)


def _micro_batch(lengths) -> dict:
    """A stand-in for a training micro-batch: the loop derives cu_seqlens from its tokens."""
    return {"cu_seqlens": cu_seqlens_from_lengths(lengths), "lengths": tuple(lengths)}


def test_plan_ahead_passes_batches_through_and_leaves_their_plans_cached() -> None:
    """The loop's form: micro-batches of tokens ``[b, s]``, documents split at EOD (id 0) as the training
    code derives them; each plan the loop then asks for is already cached."""
    topo = CPTopology.offline(4, 2, 2)
    generator = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(5):  # random EOD positions: lengths no other test plans, so a hit means plan_ahead planned it
        tokens = torch.randint(1, 100, (2, 4096), generator=generator)
        tokens[0, torch.randint(0, 4096, (3,), generator=generator)] = 0
        batches.append({"tokens": tokens})

    def cu_of(batch: dict) -> torch.Tensor:
        return document_cu_seqlens(batch["tokens"], 0, True)

    seen = []
    for batch in plan_ahead(iter(batches), cu_of, topo, "sequence-aware", depth=2):
        seen.append(batch)
        hits = PLAN_CACHE.hits
        plan = plan_batch(cu_of(batch), topo, "sequence-aware")
        assert PLAN_CACHE.hits == hits + 1
        # What another rank computes from scratch, without any cache, is the same plan.
        fresh = build_plan_data(plan.doc_lengths, topo.signature(), "sequence-aware", None)
        assert np.array_equal(plan._data.table, fresh.table)
        assert all(np.array_equal(a, b) for a, b in zip(plan._data.tables, fresh.tables))
    assert seen == batches


def test_plan_ahead_errors_surface_at_their_batch_and_bad_arguments_at_the_call() -> None:
    topo = CPTopology.offline(2, 1, 2)

    def cu_of(batch: dict) -> torch.Tensor:
        if batch["lengths"] == (5,):
            raise ValueError("tokens of batch 1 are not [b, s]")
        return batch["cu_seqlens"]

    batches = plan_ahead([_micro_batch([2, 2]), _micro_batch([5]), _micro_batch([1])], cu_of, topo, "zigzag")
    assert next(batches)["lengths"] == (2, 2)
    with pytest.raises(ValueError, match="batch 1"):
        next(batches)
    with pytest.raises(StopIteration):
        next(batches)
    with pytest.raises(ValueError, match="depth"):
        plan_ahead([], cu_of, topo, "zigzag", depth=0)
    with pytest.raises(ValueError, match="cu_seqlens_of"):
        plan_ahead([], "cu_seqlens", topo, "zigzag")
