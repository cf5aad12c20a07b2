"""The multi-process harness itself: results, tracebacks, hangs after a failure, timeouts."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests import distributed
from tests.distributed import run_distributed, run_distributed_fresh


def _rank_and_sum(offset: int, *, scale: int = 1) -> tuple:
    t = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), int(t) * scale, os.getpid()


def _raise_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise RuntimeError("boom from rank one")
    return 0


def _raise_on_rank_one_others_in_collective() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one gives up before the all_reduce")
    dist.all_reduce(torch.ones(1))  # never completes: rank 1 is missing


def _sleep(seconds: float) -> int:
    if dist.get_rank() == 0:
        time.sleep(seconds)
    return dist.get_rank()


def _new_group_sum() -> float:
    group = dist.new_group([0, 1])
    t = torch.ones(1)
    if dist.get_rank() in (0, 1):
        dist.all_reduce(t, group=group)
    return float(t)


def test_collects_results_in_rank_order_and_reuses_workers():
    first = run_distributed(_rank_and_sum, 3, 10, scale=2)
    assert [r[:3] for r in first] == [(r, 3, 2 * (0 + 1 + 2 + 30)) for r in range(3)]
    second = run_distributed(_rank_and_sum, 3, 0)
    assert [r[3] for r in second] == [r[3] for r in first], "the pool should be reused between calls"


def test_raising_rank_reports_its_traceback():
    with pytest.raises(AssertionError) as info:
        run_distributed(_raise_on_rank_one, 2)
    message = str(info.value)
    assert "rank 1 raised" in message and "boom from rank one" in message
    assert "_raise_on_rank_one" in message and "Traceback" in message
    assert "rank 0 raised" not in message


def test_rank_stuck_in_collective_does_not_hang(monkeypatch):
    monkeypatch.setattr(distributed, "GRACE_SECONDS", 2.0)
    run_distributed(_rank_and_sum, 3, 0)  # a warm pool: the bound below times the failure, not a pool start
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_distributed(_raise_on_rank_one_others_in_collective, 3, timeout=60)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank one gives up" in message
    assert "ranks [0, 2] did not finish within 2 s" in message
    assert elapsed < 8
    # the pool was killed; the next call gets a working one
    assert [r[:3] for r in run_distributed(_rank_and_sum, 3, 0)] == [(r, 3, 3) for r in range(3)]


def test_timeout_names_unfinished_ranks():
    run_distributed(_rank_and_sum, 2, 0)  # a warm pool: the bound below times the timeout, not a pool start
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 2 s: ranks \[0\] did not finish"):
        run_distributed(_sleep, 2, 30.0, timeout=2)
    assert time.monotonic() - start < 10


def test_new_group_inside_body_and_fresh_run():
    assert run_distributed(_new_group_sum, 3) == [2.0, 2.0, 1.0]
    assert [r[:3] for r in run_distributed_fresh(_rank_and_sum, 2, 1)] == [(0, 2, 3), (1, 2, 3)]


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="module-level function"):
        run_distributed(lambda: None, 2)
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_sleep, 0, 0.0)
