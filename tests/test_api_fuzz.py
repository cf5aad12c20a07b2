"""Fuzzing the public attention API with malformed inputs: every case raises a ValueError on every rank.

Hypothesis draws malformed inputs (wrong dtypes, shapes, head counts, lengths, devices, plans from
an offline or another batch's topology, and non-tensors) and the set of CP ranks that receive
them (one rank, several, or all). Every rank must raise a ValueError, and a barrier after each
case proves that no rank was left inside an attention collective. Malformed ``cu_seqlens``
(non-monotonic, negative, not starting at 0, wrong dtype or shape) are drawn separately: planning
is local, so each one must raise on its own. The number of cases tried is asserted.
"""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.sequence.plan import plan_batch
from tests.distributed import run_distributed

WORLD = 4
MALFORMED = ["dtype_int", "dtype_mixed", "rank_2d", "rank_4d", "length_plus", "length_minus", "heads_odd",
             "kv_not_dividing", "head_dim_mismatch", "kv_shape", "device_meta", "not_a_tensor", "offline_plan",
             "not_a_plan", "other_batch_plan"]
CASES = 40


def _malformed(kind: str, plan, other_plan, t: int):
    """(q, k, v, plan) for one malformed kind on a rank that receives it."""
    from megatron_hsap.parallel_state import CPTopology as Topology
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch as plan_offline

    q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    if kind == "dtype_int":
        return q.long(), k.long(), v.long(), plan
    if kind == "dtype_mixed":
        return q, k.double(), v.double(), plan
    if kind == "rank_2d":
        return q.reshape(t, 32), k, v, plan
    if kind == "rank_4d":
        return q.unsqueeze(1), k, v, plan
    if kind in ("length_plus", "length_minus"):
        n = t + 1 if kind == "length_plus" else t - 1
        return torch.randn(n, 4, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8), plan
    if kind == "heads_odd":
        return torch.randn(t, 5, 8), torch.randn(t, 5, 8), torch.randn(t, 5, 8), plan
    if kind == "kv_not_dividing":
        return q, torch.randn(t, 3, 8), torch.randn(t, 3, 8), plan
    if kind == "head_dim_mismatch":
        return q, torch.randn(t, 2, 4), torch.randn(t, 2, 4), plan
    if kind == "kv_shape":
        return q, k, torch.randn(t, 2, 4), plan
    if kind == "device_meta":
        return q, k.to("meta"), v.to("meta"), plan
    if kind == "not_a_tensor":
        return q.tolist(), k, v, plan
    if kind == "offline_plan":
        return q, k, v, plan_offline(cu_seqlens_from_lengths(list(plan.doc_lengths)), Topology.offline(4, 2, 2),
                                     plan.layout)
    if kind == "not_a_plan":
        return q, k, v, "plan"
    if kind == "other_batch_plan":  # a valid plan of another batch: lengths agree locally, not across ranks
        return (torch.randn(other_plan.tokens_per_rank, 4, 8), torch.randn(other_plan.tokens_per_rank, 2, 8),
                torch.randn(other_plan.tokens_per_rank, 2, 8), other_plan)
    raise AssertionError(kind)


def _fuzz(cases: List[Tuple[str, Tuple[int, ...]]]) -> List[str]:
    import torch.distributed as dist

    from megatron_hsap.attention import context_parallel_attention
    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch as plan_online

    topo = initialize_model_parallel(context_parallel_size=WORLD, ranks_per_node=2,
                                     cp_config=ContextParallelConfig(mode="hybrid", ulysses_size=2,
                                                                     kernel="cpu_fused"))
    outcomes = []
    for kind, bad_ranks in cases:
        plan = plan_online(cu_seqlens_from_lengths([40, 24]), topo, "zigzag")
        other = plan_online(cu_seqlens_from_lengths([30, 3, 31]), topo, "sequence-aware")
        t = plan.tokens_per_rank
        if topo.cp_rank in bad_ranks:
            q, k, v, use = _malformed(kind, plan, other, t)
        else:
            q, k, v, use = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8), plan
        try:
            context_parallel_attention(q, k, v, use)
            outcomes.append(f"{kind} on {bad_ranks}: no error")
        except ValueError as err:
            outcomes.append(f"{kind}: ValueError")
            assert str(err), kind
        dist.barrier()
    return outcomes


@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_malformed_attention_input_raises_on_every_rank(data):
    case = st.tuples(st.sampled_from(MALFORMED),
                     st.sets(st.integers(0, WORLD - 1), min_size=1, max_size=WORLD).map(lambda s: tuple(sorted(s))))
    cases = data.draw(st.lists(case, min_size=CASES, max_size=CASES), label="cases")
    cases += [(kind, (1,)) for kind in MALFORMED]  # every kind at least once, on one rank only
    results = run_distributed(_fuzz, WORLD, cases, timeout=300)
    for rank, outcomes in enumerate(results):
        assert len(outcomes) == len(cases)
        silent = [o for o in outcomes if o.endswith("no error")]
        assert not silent, f"rank {rank} accepted malformed input: {silent}"


_bad_cu_seqlens = st.one_of(
    st.lists(st.integers(-5, 50), min_size=2, max_size=8).filter(
        lambda c: c[0] != 0 or any(b < a for a, b in zip(c, c[1:]))).map(lambda c: torch.tensor(c)),
    st.lists(st.integers(0, 50), min_size=1, max_size=5).map(lambda c: torch.tensor(c, dtype=torch.float32)),
    st.lists(st.integers(0, 50), min_size=2, max_size=6).map(lambda c: torch.tensor(sorted(c)).view(1, -1)),
    st.lists(st.integers(0, 50), min_size=1, max_size=5).map(sorted),
)


@settings(max_examples=60, deadline=None)
@given(cu_seqlens=_bad_cu_seqlens, layout=st.sampled_from(["zigzag", "contiguous", "sequence-aware"]))
def test_malformed_cu_seqlens_raise_a_value_error(cu_seqlens, layout):
    with pytest.raises(ValueError, match="cu_seqlens"):
        plan_batch(cu_seqlens, CPTopology.offline(4, 2, 2), layout)
