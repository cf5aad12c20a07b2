"""One distributed attention case against the fp64 reference, shared by the CP test files.

``attention_case`` draws inputs (held in fp64) from a seed (the same on every rank), runs this rank's shards
through ``context_parallel_attention`` forward and backward in ``dtype`` (``local_attention_case``,
which also counts the forward's bytes), and gathers the global output and gradients on every rank; ``reference_errors`` compares them with the independent dense
reference (``tests/reference.py``), on whichever rank calls it.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from tests.reference import dense_attention


def local_attention_case(plan, h_q: int, h_kv: int, head_dim: int, dtype: torch.dtype, causal: bool, seed: int):
    """This rank's side of ``attention_case``: returns (local [out, dq, dk, dv] in ``dtype``, fp64 inputs
    [q, k, v, dout], the forward's ``CommStats``)."""
    from megatron_hsap.attention import context_parallel_attention
    from megatron_hsap.instrumentation import count_comm

    gen = torch.Generator().manual_seed(seed)
    total = plan.total_tokens
    # drawn in fp32 (4x cheaper than fp64 draws, and every rank draws the whole batch) and held in fp64:
    # the reference still computes in fp64 on exactly these values
    q, k, v = (torch.randn(total, h, head_dim, generator=gen, dtype=torch.float32).double()
               for h in (h_q, h_kv, h_kv))
    dout = torch.randn(total, h_q, head_dim, generator=gen, dtype=torch.float32).double()
    local = [plan.shard(x).to(dtype).requires_grad_() for x in (q, k, v)]
    with count_comm() as measured:
        out = context_parallel_attention(*local, plan, causal=causal)
    out.backward(plan.shard(dout).to(dtype))
    return [out.detach()] + [x.grad for x in local], [q, k, v, dout], measured


def unshard_all(plan, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """``[plan.unshard(t) for t in tensors]`` for ``[t_local, heads, d]`` tensors of one dtype and head dim, with
    one all-gather instead of one per tensor (concatenated along the head dimension, split again after)."""
    heads = [t.shape[1] for t in tensors]
    return list(plan.unshard(torch.cat([t.detach() for t in tensors], dim=1)).split(heads, dim=1))


def attention_case(plan, h_q: int, h_kv: int, head_dim: int, dtype: torch.dtype, causal: bool, seed: int
                   ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Returns (global [out, dq, dk, dv] in fp64 on every rank, fp64 inputs [q, k, v, dout])."""
    local, inputs, _ = local_attention_case(plan, h_q, h_kv, head_dim, dtype, causal, seed)
    return [t.double() for t in unshard_all(plan, local)], inputs


def reference_errors(got: List[torch.Tensor], inputs: List[torch.Tensor], cu_seqlens: torch.Tensor, causal: bool,
                     relative: bool = False, window_size: Optional[Tuple[int, int]] = None) -> List[float]:
    """Max |got - reference| (divided by max |reference| when ``relative``) for out, dq, dk, dv."""
    q, k, v, dout = inputs
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = dense_attention(*ref_in, cu_seqlens, causal=causal, window_size=window_size)
    ref.backward(dout)
    expected = [ref.detach()] + [x.grad for x in ref_in]
    return [((a - b).abs().max() / (b.abs().max() if relative else 1.0)).item() for a, b in zip(got, expected)]


def bytes_match_plan(stats, measured, topology, kv_forwarding: bool) -> bool:
    """Whether one forward's measured bytes (``CommStats``) are ``BatchPlan.stats``' prediction: this rank's
    sent/received bytes intra and inter node; with node-level K/V forwarding, the inter-node bytes received
    by all CP ranks (an all-reduce: call it on every rank) against ``recv_bytes_inter_forwarded``."""
    import torch.distributed as dist

    if kv_forwarding:
        inter = torch.tensor([measured.recv_bytes_inter], dtype=torch.int64)
        dist.all_reduce(inter, group=topology.cp_group)
        return int(inter) == sum(stats.recv_bytes_inter_forwarded)
    c = topology.cp_rank
    return (stats.send_bytes_intra[c], stats.send_bytes_inter[c], stats.recv_bytes_intra[c],
            stats.recv_bytes_inter[c]) == (measured.send_bytes_intra, measured.send_bytes_inter,
                                           measured.recv_bytes_intra, measured.recv_bytes_inter)
