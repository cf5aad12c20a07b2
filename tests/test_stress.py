"""Randomised stress: hypothesis draws packed batches and CP layouts; every case runs forward and
backward on gloo ranks (tags forced to 0) and is compared with the dense fp64 reference.

Each of the 4 draws is a CP configuration (mode, Ulysses size, emulated nodes) plus a list of
cases (document lengths including 0 and 1, sometimes one giant document or many tiny ones; a token
layout; head shape; causal or full), run in one distributed call so that at least 200 cases fit the
suite's time budget. The total number of cases run is asserted, so the test cannot pass on zero.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.cp_cases import attention_case, reference_errors
from tests.distributed import run_distributed

WORLD = 4
CASES_PER_EXAMPLE = 50
EXAMPLES = 4
CONFIGS = [("ring", None, 1), ("ring", None, 2), ("ulysses", None, 4), ("ulysses", None, 2),
           ("hybrid", 2, 2), ("hybrid", 2, 4)]
HEADS = [(4, 4), (4, 2), (4, 1)]
LAYOUTS = ["zigzag", "contiguous", "sequence-aware"]

_lengths = st.one_of(
    st.lists(st.integers(0, 40), min_size=1, max_size=8),                       # mixed, with 0 and 1
    st.integers(1, 160).map(lambda n: [n]),                                       # one document
    st.tuples(st.integers(60, 160), st.lists(st.integers(0, 3), max_size=12)).map(lambda t: [t[0]] + t[1]),
    st.lists(st.integers(0, 2), min_size=4, max_size=30),                         # many tiny ones
).filter(lambda lengths: sum(lengths) > 0)
_case = st.tuples(_lengths, st.sampled_from(LAYOUTS), st.sampled_from(HEADS), st.booleans())


def _run_cases(mode: str, ulysses_size, ranks_per_node: int, cases: List[Tuple]) -> Dict[str, float]:
    import torch.distributed as dist

    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch

    topo = initialize_model_parallel(context_parallel_size=dist.get_world_size(), ranks_per_node=ranks_per_node,
                                     cp_config=ContextParallelConfig(mode=mode, ulysses_size=ulysses_size,
                                                                     kernel="cpu_fused"))
    worst, ran = 0.0, 0
    for index, (lengths, layout, (h_q, h_kv), causal) in enumerate(cases):
        cu = cu_seqlens_from_lengths(lengths)
        got, inputs = attention_case(plan_batch(cu, topo, layout), h_q, h_kv, 8, torch.float64, causal, index)
        ran += 1
        if topo.cp_rank == 0:
            worst = max([worst] + reference_errors(got, inputs, cu, causal))
    return {"worst": worst, "ran": ran}


@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_random_packed_batches_match_dense_reference(data):
    ran = 0
    for _ in range(EXAMPLES):
        mode, ulysses_size, ranks_per_node = config = data.draw(st.sampled_from(CONFIGS), label="config")
        cases = data.draw(st.lists(_case, min_size=CASES_PER_EXAMPLE, max_size=CASES_PER_EXAMPLE), label="cases")
        results = run_distributed(_run_cases, WORLD, mode, ulysses_size, ranks_per_node, cases, timeout=300)
        assert all(r["ran"] == len(cases) for r in results)
        assert results[0]["worst"] < 1e-9, f"{config}: max error {results[0]['worst']:.3e} vs the fp64 reference"
        ran += len(cases)
    assert ran >= 200, ran
