"""``context_parallel_attention``: the public entry point for one attention call under CP.

Flow on each rank (see docs/architecture.md):
1. Ulysses all-to-all (if ulysses_size > 1): this rank's tokens of all heads ->
   its member's tokens of 1/ulysses_size of the heads (KV heads replicated first
   when there are fewer than ulysses_size of them; their gradients sum back).
2. ``RingAttention`` over the plan's member schedule (local blocks, then ring exchanges).
3. The inverse all-to-all back to this rank's tokens of all heads.
Everything is validated on every rank before the first collective.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from megatron_hsap.attention.ring import RingAttention
from megatron_hsap.collectives import UlyssesAllToAll
from megatron_hsap.kernels import get_kernel
from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.sequence.plan import BatchPlan, validate_head_counts

__all__ = ["context_parallel_attention", "check_attention_inputs", "check_device_matches_backend"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_device_matches_backend(name: str, tensor: torch.Tensor, topology: CPTopology) -> None:
    """CUDA tensors need NCCL, CPU tensors gloo: a mismatch would fail (or hang) inside the first collective."""
    if topology.cp_size > 1:
        backend = dist.get_backend(topology.cp_group)
        if tensor.is_cuda == (backend == "gloo"):
            raise ValueError(f"{name} is on {tensor.device} but the CP process group uses {backend}; "
                             "use NCCL with CUDA tensors, gloo with CPU tensors")


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BatchPlan) -> int:
    """Validate local q/k/v against the plan and topology; returns the KV head count after replication."""
    if not isinstance(plan, BatchPlan):
        raise ValueError(f"plan must be a BatchPlan from plan_batch(...), got {type(plan).__name__}")
    topo = plan.topology
    if topo.is_offline:
        raise ValueError("plan was built on an offline CPTopology; attention needs get_cp_topology()")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a tensor of layout [t_local, heads, head_dim], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.shape[0] != plan.tokens_per_rank:
            raise ValueError(f"{name}.shape[0]={t.shape[0]} must equal plan.tokens_per_rank={plan.tokens_per_rank} "
                             "(this rank's tokens as laid out by the plan, padding included)")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name}.dtype={t.dtype} is not supported; allowed: {', '.join(map(str, _DTYPES))}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[2]} and {k.shape[2]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    check_device_matches_backend("q", q, topo)
    return validate_head_counts(q.shape[1], k.shape[1], topo.ulysses_size)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BatchPlan, *,
                               causal: bool = True, softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Exact attention of a packed batch spread over the CP group.

    q ``[t_local, h_q, d]``, k/v ``[t_local, h_kv, d]``: this rank's tokens (as laid out by
    ``plan``; ``t_local = plan.tokens_per_rank``) of all heads this TP rank owns.
    Attention is causal (or full, ``causal=False``) inside each document and never
    crosses documents; padding slots produce zero output and zero gradient.
    Returns ``[t_local, h_q, d]`` in q's dtype.
    """
    kv_heads = check_attention_inputs(q, k, v, plan)
    topo = plan.topology
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    kernel = get_kernel(topo.config.kernel)
    schedule = plan.member_schedule(causal)
    ulysses = topo.ulysses_size
    if ulysses == 1:
        return RingAttention.apply(q, k, v, schedule, topo, kernel, scale)
    if kv_heads != k.shape[1]:
        k = k.repeat_interleave(kv_heads // k.shape[1], dim=1)
        v = v.repeat_interleave(kv_heads // v.shape[1], dim=1)
    t, h_q, d = q.shape
    hq_u, hkv_u = h_q // ulysses, kv_heads // ulysses
    # One all-to-all for q, k and v: each destination's head slices side by side.
    packed = torch.cat((q.view(t, ulysses, hq_u, d), k.reshape(t, ulysses, hkv_u, d),
                        v.reshape(t, ulysses, hkv_u, d)), dim=2)
    member = UlyssesAllToAll.apply(packed, topo, True)
    q_m, k_m, v_m = member.split((hq_u, hkv_u, hkv_u), dim=1)
    out_m = RingAttention.apply(q_m.contiguous(), k_m.contiguous(), v_m.contiguous(), schedule, topo, kernel, scale)
    return UlyssesAllToAll.apply(out_m, topo, False).reshape(t, h_q, d)
