"""PlanPrefetcher: plans made ahead in a thread equal plan_batch's, in order; errors surface at their batch.

Fast (no processes): ``.venv/bin/python -m pytest tests/test_prefetch.py -q``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths, sample_doc_lengths
from megatron_hsap.sequence.plan import plan_batch
from megatron_hsap.sequence.prefetch import PlanPrefetcher


@pytest.mark.parametrize("layout", ["sequence-aware", "zigzag"])
def test_prefetched_plans_equal_direct_plans_in_order(layout: str) -> None:
    topo = CPTopology.offline(8, 2, 4)
    stream = [cu_seqlens_from_lengths(sample_doc_lengths(1 << 14, seed=s)) for s in range(6)]
    got = list(PlanPrefetcher(iter(stream), topo, layout, depth=2))
    assert len(got) == len(stream)
    for cu, (seen, plan) in zip(stream, got):
        assert seen is cu
        # Another "rank" planning the same lengths from scratch (fresh tensor) gets the same placement.
        again = plan_batch(cu.clone().to(torch.int64), topo, layout)
        assert plan.rank_segments == again.rank_segments and plan.layout == layout


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
