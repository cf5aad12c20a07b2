"""``context_parallel_attention``: the public entry point for one attention call under CP.

Flow on each rank (see docs/architecture.md):
1. Ulysses all-to-all (if ulysses_size > 1): this rank's tokens of all heads ->
   its member's tokens of 1/ulysses_size of the heads. q, k and v are copied once, into
   one destination-major send buffer, and travel in one all-to-all; the received member
   buffer is attended in place (k/v as views of it). KV heads are replicated first
   when there are fewer than ulysses_size of them; their gradients sum back.
2. Ring attention over the plan's member schedule (local blocks, then ring exchanges).
3. The inverse all-to-all back to this rank's tokens of all heads.
The backward mirrors it: one all-to-all for the output gradient, the ring backward writes
dq/dk/dv straight into one send buffer, one all-to-all back.
Inputs are validated on every rank, and agreed on across the CP group, before the first collective.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron_hsap.attention.agreement import agree_across_cp_ranks
from megatron_hsap.attention.ring import ring_attention_backward, ring_attention_forward
from megatron_hsap.collectives import all_to_all_member, heads_to_sequence, sequence_to_heads
from megatron_hsap.kernels import AttentionKernel, get_kernel
from megatron_hsap.parallel_state import CPTopology, cp_topology_is_initialized, get_cp_topology
from megatron_hsap.sequence.plan import BatchPlan, validate_head_counts
from megatron_hsap.sequence.schedule import MemberSchedule, normalize_window

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


def _to_member(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topology: CPTopology,
               kv_heads: int) -> torch.Tensor:
    """q ``[t, h_q, d]``, k/v ``[t, h_kv, d]`` (this rank's tokens) -> the member buffer
    ``[U * t, h_q/U + 2 * kv_heads/U, d]`` (the member's tokens; this rank's query heads, then keys, then values)."""
    u = topology.ulysses_size
    t, h_q, d = q.shape
    if kv_heads != k.shape[1]:
        k, v = (x.repeat_interleave(kv_heads // x.shape[1], dim=1) for x in (k, v))
    hq_u, hkv_u = h_q // u, kv_heads // u
    send = q.new_empty((u, t, hq_u + 2 * hkv_u, d))
    send[:, :, :hq_u].copy_(q.view(t, u, hq_u, d).transpose(0, 1))
    send[:, :, hq_u:hq_u + hkv_u].copy_(k.reshape(t, u, hkv_u, d).transpose(0, 1))
    send[:, :, hq_u + hkv_u:].copy_(v.reshape(t, u, hkv_u, d).transpose(0, 1))
    return all_to_all_member(send, topology, "ulysses_a2a").view(u * t, hq_u + 2 * hkv_u, d)


class _ContextParallelAttention(torch.autograd.Function):
    """Ulysses all-to-all + ring attention + inverse all-to-all as one autograd node (layouts as in
    ``context_parallel_attention``); saves the member buffer, the member output and the LSE."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, schedule: MemberSchedule,
                topology: CPTopology, kernel: AttentionKernel, scale: float, kv_heads: int) -> torch.Tensor:
        ctx.args = (schedule, topology, kernel, scale)
        ctx.kv_shape = tuple(k.shape)
        if topology.ulysses_size == 1:
            out, lse = ring_attention_forward(q, k, v, schedule, topology, kernel, scale)
            ctx.save_for_backward(q, k, v, out, lse)
            return out
        t, h_q, d = q.shape
        member = _to_member(q, k, v, topology, kv_heads)
        q_m, k_m, v_m = _split_member(member, h_q // topology.ulysses_size)
        out_m, lse = ring_attention_forward(q_m, k_m, v_m, schedule, topology, kernel, scale)
        ctx.save_for_backward(member, out_m, lse)
        return heads_to_sequence(out_m, topology).reshape(t, h_q, d)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        schedule, topology, kernel, scale = ctx.args
        if topology.ulysses_size == 1:
            q, k, v, out, lse = ctx.saved_tensors
            return (*ring_attention_backward(dout, q, k, v, out, lse, schedule, topology, kernel, scale),
                    None, None, None, None, None)
        member, out_m, lse = ctx.saved_tensors
        u = topology.ulysses_size
        t, h_kv, d = ctx.kv_shape
        hq_u = out_m.shape[1]
        dout_m = sequence_to_heads(dout.reshape(t, u, hq_u, d), topology, "ulysses_a2a_bwd")
        q_m, k_m, v_m = _split_member(member, hq_u)
        grads = ring_attention_backward(dout_m, q_m, k_m, v_m, out_m, lse, schedule, topology, kernel, scale)
        send = member.new_empty(member.shape)
        for part, grad in zip(_split_member(send, hq_u), grads):
            part.copy_(grad)
        del grads, dout_m
        back = all_to_all_member(send.view(u, t, -1, d), topology, "ulysses_a2a_bwd")  # [U, t, heads, d]
        dq_b, dk_b, dv_b = _split_member(back.transpose(0, 1), hq_u, dim=2)
        dq = dq_b.reshape(t, u * hq_u, d)
        dk, dv = (x.reshape(t, -1, d) for x in (dk_b, dv_b))
        if dk.shape[1] != h_kv:  # replicated KV heads: each original head's gradient is the sum of its copies
            dk, dv = (x.view(t, h_kv, -1, d).sum(dim=2) for x in (dk, dv))
        return dq, dk, dv, None, None, None, None, None


def _split_member(member: torch.Tensor, hq_u: int, dim: int = 1) -> Tuple[torch.Tensor, ...]:
    """Views of a member-layout buffer: (queries, keys, values) along the heads dimension ``dim``."""
    hkv_u = (member.shape[dim] - hq_u) // 2
    return member.split((hq_u, hkv_u, hkv_u), dim=dim)


def _fail_with_peers(error: ValueError) -> None:
    """Raise ``error`` on a rank whose plan cannot name its CP group: it first joins the agreement of the
    initialised topology (if any), where its peers are about to compare inputs, so they raise too."""
    if cp_topology_is_initialized():
        agree_across_cp_ranks(get_cp_topology(), {}, error, None)
    raise error


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BatchPlan, *,
                               causal: bool = True, softmax_scale: Optional[float] = None,
                               window_size: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """Exact attention of a packed batch spread over the CP group.

    q ``[t_local, h_q, d]``, k/v ``[t_local, h_kv, d]``: this rank's tokens (as laid out by
    ``plan``; ``t_local = plan.tokens_per_rank``) of all heads this TP rank owns.
    Attention is causal (or full, ``causal=False``) inside each document and never
    crosses documents; padding slots produce zero output and zero gradient.
    window_size ``(left, right)``: sliding-window attention in flash-attn's convention (a query at
    in-document position i sees keys in ``[i - left, i + right]``; -1 = unlimited; None or (-1, -1) =
    no window; with causal=True right is 0 or -1); ring exchanges carry only the rows in the window.
    Returns ``[t_local, h_q, d]`` in q's dtype.
    Bad or mismatched input raises the same ValueError on every CP rank before any collective.
    """
    if not isinstance(plan, BatchPlan):
        _fail_with_peers(ValueError(f"plan must be a BatchPlan from plan_batch(...), got {type(plan).__name__}"))
    topo = plan.topology
    error, kv_heads, window = None, 0, None
    try:
        window = normalize_window(window_size, bool(causal))
        kv_heads = check_attention_inputs(q, k, v, plan)
    except ValueError as err:
        error = err
    if topo.is_offline:
        _fail_with_peers(error)
    fields = {"cu_seqlens": plan.doc_lengths, "layout": plan.layout, "topology": topo.signature(),
              "causal": bool(causal), "softmax_scale": softmax_scale, "kernel": topo.config.kernel,
              "window_size": window}
    if error is None:
        fields.update(q_shape=tuple(q.shape[1:]), kv_shape=tuple(k.shape[1:]), dtype=str(q.dtype),
                      tokens_per_rank=q.shape[0])
    device = q.device if isinstance(q, torch.Tensor) and error is None else None
    agree_across_cp_ranks(topo, fields, error, device, plan.verified_signatures)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    kernel = get_kernel(topo.config.kernel)
    schedule = plan.member_schedule(causal, window_size=window)
    return _ContextParallelAttention.apply(q, k, v, schedule, topo, kernel, scale, kv_heads)
