"""One distributed attention case against the fp64 reference, shared by the CP test files.

``attention_case`` draws fp64 inputs from a seed (the same on every rank), runs this rank's shards
through ``context_parallel_attention`` forward and backward in ``dtype``, and gathers the global
output and gradients on every rank; ``reference_errors`` compares them with the independent dense
reference (``tests/reference.py``), on whichever rank calls it.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from tests.reference import dense_attention


def attention_case(plan, h_q: int, h_kv: int, head_dim: int, dtype: torch.dtype, causal: bool, seed: int
                   ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Returns (global [out, dq, dk, dv] in fp64 on every rank, fp64 inputs [q, k, v, dout])."""
    from megatron_hsap.attention import context_parallel_attention

    gen = torch.Generator().manual_seed(seed)
    total = plan.total_tokens
    q, k, v = (torch.randn(total, h, head_dim, generator=gen, dtype=torch.float64) for h in (h_q, h_kv, h_kv))
    dout = torch.randn(total, h_q, head_dim, generator=gen, dtype=torch.float64)
    local = [plan.shard(x).to(dtype).requires_grad_() for x in (q, k, v)]
    out = context_parallel_attention(*local, plan, causal=causal)
    out.backward(plan.shard(dout).to(dtype))
    got = [plan.unshard(t).double() for t in (out, local[0].grad, local[1].grad, local[2].grad)]
    return got, [q, k, v, dout]


def reference_errors(got: List[torch.Tensor], inputs: List[torch.Tensor], cu_seqlens: torch.Tensor, causal: bool,
                     relative: bool = False, window_size: Optional[Tuple[int, int]] = None) -> List[float]:
    """Max |got - reference| (divided by max |reference| when ``relative``) for out, dq, dk, dv."""
    q, k, v, dout = inputs
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = dense_attention(*ref_in, cu_seqlens, causal=causal, window_size=window_size)
    ref.backward(dout)
    expected = [ref.detach()] + [x.grad for x in ref_in]
    return [((a - b).abs().max() / (b.abs().max() if relative else 1.0)).item() for a, b in zip(got, expected)]
