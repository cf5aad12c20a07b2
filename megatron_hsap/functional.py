"""Context-parallel attention from tensors and ``cu_seqlens``, for training loops without Megatron models.

``context_parallel_varlen_attention`` has flash-attn's varlen contract (packed ``[tokens, heads, d]``
tensors and the documents' ``cu_seqlens``) under context parallelism: it looks up the batch's plan
itself (``plan_for``: ``plan_batch`` over the topology ``initialize_model_parallel`` recorded, with
that config's layout; plans are cached by the document lengths). The same ``plan_for(cu_seqlens)``
shards the loop's global tensors (``plan.shard``), gives the in-document positions and the padding
mask. examples/plain_pytorch_training.py is a whole loop; docs/usage.md walks through it.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron_hsap.attention.context_parallel import context_parallel_attention, fail_with_peers
from megatron_hsap.parallel_state import get_cp_topology
from megatron_hsap.sequence.plan import BatchPlan, plan_batch

__all__ = ["context_parallel_varlen_attention", "plan_for"]


def plan_for(cu_seqlens: torch.Tensor, layout: Optional[str] = None) -> BatchPlan:
    """The plan of the packed batch ``cu_seqlens`` (int ``[num_docs + 1]``, the *global* boundaries, the same on
    every CP rank) over this rank's CP topology; ``layout`` None = the ``ContextParallelConfig``'s."""
    topology = get_cp_topology()
    return plan_batch(cu_seqlens, topology, topology.config.resolved_layout if layout is None else layout)


def context_parallel_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                                      *, causal: bool = True, softmax_scale: Optional[float] = None,
                                      window_size: Optional[Tuple[int, int]] = None,
                                      layout: Optional[str] = None) -> torch.Tensor:
    """Exact attention of a packed batch spread over the CP group, given its ``cu_seqlens``.

    q ``[t_local, h_q, d]``, k/v ``[t_local, h_kv, d]``: this rank's tokens as ``plan_for(cu_seqlens, layout)``
    lays them out (``plan.shard`` of the global ``[T, heads, d]``; ``t_local = plan.tokens_per_rank``).
    causal, softmax_scale, window_size: as in ``context_parallel_attention``. Returns ``[t_local, h_q, d]``
    in q's dtype. A bad ``cu_seqlens`` or ``layout`` on any rank raises the same ValueError on every CP rank
    before any attention collective.
    """
    try:
        plan = plan_for(cu_seqlens, layout)
    except ValueError as error:
        fail_with_peers(error)
    return context_parallel_attention(q, k, v, plan, causal=causal, softmax_scale=softmax_scale,
                                      window_size=window_size)
