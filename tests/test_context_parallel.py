"""Distributed attention (ring, Ulysses, hybrid) against the dense fp64 reference, on gloo ranks.

Every launch runs with point-to-point tags forced to 0 (``tests/distributed.py``), so
messages match in posting order as on NCCL; ring sizes 2, 3, 4, 6 and 8 are covered.
Each launch runs every hard case of packed batches (tests/reference.py) for one CP layout, in
every token layout, cycling head shapes (MHA, GQA, KV heads fewer than the Ulysses
size), head dims (64 and an odd one), dtypes (fp64 and fp32) and causal/full masks
so that every combination appears. Outputs and dq/dk/dv are compared on rank 0; padding
slots must give exactly zero output and gradient; measured bytes must equal the
plan's prediction.
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Optional

import pytest
import torch

from tests.cp_cases import bytes_match_plan, local_attention_case, unshard_all
from tests.distributed import run_distributed
from tests.reference import dense_attention, hard_cases

LAYOUTS = ("zigzag", "contiguous", "sequence-aware")
# (h_q, h_kv) per Ulysses size: MHA, GQA, and KV heads fewer than the Ulysses size (shared by ranks);
# uneven counts are tests/test_uneven_heads.py's.
HEAD_SHAPES = {1: [(4, 4), (8, 2), (8, 1)], 2: [(4, 4), (8, 2), (8, 1)], 3: [(6, 6), (6, 3), (6, 1)],
               4: [(4, 4), (8, 2), (8, 1)], 8: [(8, 8), (16, 4), (8, 1)]}
HEAD_DIMS = (64, 17)
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def _run_cases(mode: str, ulysses_size: Optional[int], ranks_per_node: int, layouts: List[str],
               kv_forwarding: bool = False) -> Dict[str, float]:
    import torch.distributed as dist

    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch

    cp = dist.get_world_size()
    topo = initialize_model_parallel(context_parallel_size=cp, ranks_per_node=ranks_per_node,
                                     cp_config=ContextParallelConfig(mode=mode, ulysses_size=ulysses_size,
                                                                     kernel="cpu_fused", kv_forwarding=kv_forwarding))
    errors: Dict[str, float] = {}
    combos = itertools.cycle(itertools.product(HEAD_SHAPES[topo.ulysses_size], HEAD_DIMS, (True, False),
                                               (torch.float64, torch.float32)))
    cases = itertools.product(sorted(hard_cases(cp).items()), layouts)
    for case_index, ((name, lengths), layout) in enumerate(cases):
        (h_q, h_kv), d, causal, dtype = next(combos)
        cu = cu_seqlens_from_lengths(lengths)
        plan = plan_batch(cu, topo, layout)
        local, (q, k, v, dout), measured = local_attention_case(plan, h_q, h_kv, d, dtype, causal, case_index)
        valid = plan.valid_mask
        padding_nonzero = max([t[~valid].abs().max().item() if (~valid).any() else 0.0 for t in local])
        stats = plan.stats(h_q, h_kv, d, dtype, causal=causal)
        c = topo.cp_rank
        bytes_match = bytes_match_plan(stats, measured, topo, kv_forwarding)
        globals_ = unshard_all(plan, local)
        key = f"{name}/{layout}/h{h_q}:{h_kv}/d{d}/{'causal' if causal else 'full'}/{str(dtype)[6:]}"
        if c == 0:
            ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
            ref = dense_attention(*ref_in, cu, causal=causal)
            ref.backward(dout)
            err = max((g.double() - r).abs().max().item()
                      for g, r in zip(globals_, [ref.detach()] + [x.grad for x in ref_in]))
            errors[key] = err / TOL[dtype]  # <= 1 passes
        errors[key + "/padding"] = padding_nonzero
        errors[key + "/bytes"] = 0.0 if bytes_match else 1e9
    return errors


CONFIGS = [  # (world size, mode, ulysses size, ranks per node)
    (2, "ring", None, 2),
    (2, "ulysses", None, 2),
    (3, "ring", None, 3),      # odd ring: distances 1 and 2 differ in direction
    (4, "ring", None, 4),
    (4, "ulysses", None, 4),
    (4, "hybrid", 2, 4),
    (6, "hybrid", 3, 3),
    (6, "hybrid", 2, 2),   # 3 "nodes" x 2: ring of 3 across nodes
    (6, "ring", None, 3),  # ring of 6 over 2 nodes
    (8, "hybrid", 4, 4),   # 2 "nodes" x 4: all-to-all inside, ring across
    (8, "ring", None, 4),
    (8, "ulysses", None, 4),  # all-to-all spanning the two emulated nodes
]
# Node-level K/V forwarding: several ring members per node (pure ring of 4 per node over 2 nodes; 3 nodes
# of 2 ring members). Ulysses pairs with forwarding: tests/test_upipe.py.
FORWARDING_CONFIGS = [(8, "ring", None, 4), (6, "ring", None, 2)]


@pytest.mark.parametrize("world_size,mode,ulysses_size,ranks_per_node,kv_forwarding",
                         [c + (False,) for c in CONFIGS] + [c + (True,) for c in FORWARDING_CONFIGS],
                         ids=[f"cp{w}-{m}-u{u}-rpn{r}" for w, m, u, r in CONFIGS]
                         + [f"cp{w}-{m}-u{u}-rpn{r}-kv_forwarding" for w, m, u, r in FORWARDING_CONFIGS])
def test_matches_dense_reference(world_size, mode, ulysses_size, ranks_per_node, kv_forwarding):
    results = run_distributed(_run_cases, world_size, mode, ulysses_size, ranks_per_node, list(LAYOUTS),
                              kv_forwarding, timeout=600)
    checked = [k for k in results[0] if not k.endswith(("/padding", "/bytes"))]
    assert len(checked) == len(hard_cases(world_size)) * len(LAYOUTS)
    over_tolerance = {k: v for k, v in results[0].items() if k in checked and not v <= 1.0}
    assert not over_tolerance, f"error / tolerance above 1: {over_tolerance}"
    for rank, rank_errors in enumerate(results):
        broken = {k: v for k, v in rank_errors.items() if k.endswith(("/padding", "/bytes")) and v != 0.0}
        assert not broken, f"rank {rank}: nonzero output/gradient on padding, or measured bytes != plan.stats: {broken}"
