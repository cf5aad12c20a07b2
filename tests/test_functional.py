"""``megatron_hsap.context_parallel_varlen_attention`` / ``plan_for``: the plan they build is ``plan_batch``'s with
the CP config's layout, the result is ``context_parallel_attention``'s, and bad input raises on every rank."""

from __future__ import annotations

from typing import List

import torch

from tests.distributed import run_distributed


def _same_as_with_the_plan() -> float:
    from megatron_hsap import context_parallel_varlen_attention, plan_for
    from megatron_hsap.attention import context_parallel_attention
    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.sequence.plan import plan_batch

    topo = initialize_model_parallel(context_parallel_size=2, cp_config=ContextParallelConfig(mode="ring",
                                                                                            layout="contiguous"))
    cu = torch.tensor([0, 30, 31, 70], dtype=torch.int32)
    plan = plan_for(cu)
    assert plan.layout == "contiguous" and plan_for(cu, "zigzag").layout == "zigzag"
    assert plan.rank_segments == plan_batch(cu, topo, "contiguous").rank_segments
    gen = torch.Generator().manual_seed(1)
    q, k, v = (plan.shard(torch.randn(70, h, 8, generator=gen, dtype=torch.float64)) for h in (4, 2, 2))
    got = context_parallel_varlen_attention(q, k, v, cu, window_size=(5, 0))
    want = context_parallel_attention(q, k, v, plan, window_size=(5, 0))
    return (got - want).abs().max().item()


def test_varlen_attention_is_context_parallel_attention_over_plan_for():
    assert run_distributed(_same_as_with_the_plan, 2, timeout=120) == [0.0, 0.0]


def _bad_cu_seqlens_on_one_rank() -> List[str]:
    import pytest
    import torch.distributed as dist

    from megatron_hsap import context_parallel_varlen_attention, plan_for
    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.parallel_state import initialize_model_parallel

    initialize_model_parallel(context_parallel_size=2, cp_config=ContextParallelConfig(mode="ring"))
    good = torch.tensor([0, 30, 70], dtype=torch.int32)
    cu = torch.tensor([0, 40, 30], dtype=torch.int32) if dist.get_rank() == 1 else good
    q = torch.randn(plan_for(good).tokens_per_rank, 2, 8)
    messages = []
    with pytest.raises(ValueError) as info:
        context_parallel_varlen_attention(q, q, q, cu)
    messages.append(str(info.value))
    with pytest.raises(ValueError) as info:
        context_parallel_varlen_attention(q, q, q, good, layout="diagonal")
    messages.append(str(info.value))
    dist.barrier()  # nobody is stuck in an attention collective
    return messages


def test_bad_cu_seqlens_or_layout_raise_on_every_rank():
    results = run_distributed(_bad_cu_seqlens_on_one_rank, 2, timeout=120)
    assert "cu_seqlens" in results[1][0] and "CP rank(s) [1]" in results[0][0], results
    assert all("layout" in r[1] for r in results), results
