"""``context_parallel_attention``: the public entry point for one attention call under CP.

Flow on each rank (see docs/architecture.md):
1. Ulysses all-to-all (if ulysses_size > 1): this rank's tokens of all heads ->
   its member's tokens of a contiguous range of query heads (floor or ceil of H/ulysses_size)
   and exactly the KV heads they use (``megatron_hsap.head_split``; a KV head used by two
   ranks goes to both, its gradients sum back once). q, k and v are copied once, into one
   destination-major send buffer, and travel in one all-to-all (uneven split sizes when the
   counts differ); the received member buffer is attended in place (k/v as views of it).
2. Ring attention over the plan's member schedule (local blocks, then ring exchanges), one
   call per GQA run of the rank's heads (one call unless a KV head's query heads straddle
   this rank's range unevenly, e.g. 1 + 2).
3. The inverse all-to-all back to this rank's tokens of all heads.
The backward mirrors it: one all-to-all for the output gradient, the ring backward writes
dq/dk/dv straight into one send buffer, one all-to-all back.
Inputs are validated on every rank, and agreed on across the CP group, before the first collective.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_hsap.attention.agreement import agree_across_cp_ranks
from megatron_hsap.attention.ring import ring_attention_backward, ring_attention_forward
from megatron_hsap.attention.shared_kv import SharedRemoteKeyValues
from megatron_hsap.collectives import all_to_all_member, heads_to_sequence, sequence_to_heads
from megatron_hsap.head_split import HeadSplit, Run, split_heads
from megatron_hsap.kernels import AttentionKernel, get_kernel
from megatron_hsap.parallel_state import CPTopology, cp_topology_is_initialized, get_cp_topology
from megatron_hsap.sequence.plan import BatchPlan
from megatron_hsap.sequence.schedule import MemberSchedule, normalize_window

__all__ = ["context_parallel_attention", "check_attention_inputs", "check_device_matches_backend", "fail_with_peers"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_device_matches_backend(name: str, tensor: torch.Tensor, topology: CPTopology) -> None:
    """CUDA tensors need NCCL, CPU tensors gloo: a mismatch would fail (or hang) inside the first collective."""
    if topology.cp_size > 1:
        backend = dist.get_backend(topology.cp_group)
        if tensor.is_cuda == (backend == "gloo"):
            raise ValueError(f"{name} is on {tensor.device} but the CP process group uses {backend}; "
                             "use NCCL with CUDA tensors, gloo with CPU tensors")


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BatchPlan) -> HeadSplit:
    """Validate local q/k/v against the plan and topology; returns how the Ulysses group splits the heads."""
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
    try:
        return split_heads(q.shape[1], k.shape[1], topo.ulysses_size)
    except ValueError as err:
        raise ValueError(f"q.shape[1] (num_heads_q) and k.shape[1] (num_heads_kv): {err}") from None


def attend_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: Tuple[Run, ...], schedule: MemberSchedule,
                topology: CPTopology, kernel: AttentionKernel, scale: float,
                shared: Optional[SharedRemoteKeyValues] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ring attention of one rank's member heads, one call per GQA run (``head_split.gqa_runs``).

    q ``[t_m, h, d]``, k/v ``[t_m, h_kv, d]``: the member's tokens of this rank's heads. Returns out
    ``[t_m, h, d]`` and lse ``[h, t_m]`` (no heads: empty, nothing posted, as on every ring peer).
    shared: remote K/V rows kept across UPipe stages (``shared_kv.SharedRemoteKeyValues``, its stage begun).
    """
    parts = []
    for q0, q1, k0, k1 in runs:
        if shared is not None:
            shared.select(k0, k1)
        parts.append(ring_attention_forward(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], schedule, topology, kernel,
                                            scale, shared))
    if len(parts) == 1:
        return parts[0]
    if not parts:
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        return q.new_empty(q.shape), q.new_empty((0, q.shape[0]), dtype=acc)
    return torch.cat([o for o, _ in parts], dim=1), torch.cat([lse for _, lse in parts])


def attend_runs_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, runs: Tuple[Run, ...], schedule: MemberSchedule, topology: CPTopology,
                         kernel: AttentionKernel, scale: float, shared: Optional[SharedRemoteKeyValues] = None
                         ) -> Iterator[Tuple[Run, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Gradients of ``attend_runs`` (same layouts), yielded per run as ``(run, dq, dk, dv)``."""
    for run in runs:
        q0, q1, k0, k1 = run
        if shared is not None:
            shared.select(k0, k1)
        yield (run, *ring_attention_backward(dout[:, q0:q1], q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], out[:, q0:q1],
                                             lse[q0:q1], schedule, topology, kernel, scale, shared))


def _member_width(heads: HeadSplit, rank: int) -> int:
    """Head slices of rank ``rank``'s member buffer: its query heads, keys, values."""
    return heads.query_counts[rank] + 2 * heads.kv_counts[rank]


def _to_member(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topology: CPTopology,
               heads: HeadSplit) -> torch.Tensor:
    """q ``[t, h_q, d]``, k/v ``[t, h_kv, d]`` (this rank's tokens) -> the member buffer ``[U * t, m + 2 n, d]``
    (the member's tokens; this rank's m query heads, then its n keys, then its n values). One copy of q, k
    and v into a destination-major send buffer; each destination gets exactly its heads."""
    t, _, d = q.shape
    u = topology.ulysses_size
    sizes = [t * _member_width(heads, r) * d for r in range(u)]
    send = q.new_empty(sum(sizes))
    at = 0
    for r, size in enumerate(sizes):
        qr, kr = heads.query_range(r), heads.kv_range(r)
        block = send[at:at + size].view(t, len(qr) + 2 * len(kr), d)
        for part, src in zip(block.split((len(qr), len(kr), len(kr)), dim=1),
                             (q[:, qr.start:qr.stop], k[:, kr.start:kr.stop], v[:, kr.start:kr.stop])):
            part.copy_(src)
        at += size
    me = topology.ulysses_rank
    member = all_to_all_member(send, topology, "ulysses_a2a", send_rows=sizes, recv_rows=[sizes[me]] * u)
    return member.view(u * t, _member_width(heads, me), d)


class _ContextParallelAttention(torch.autograd.Function):
    """Ulysses all-to-all + ring attention + inverse all-to-all as one autograd node (layouts as in
    ``context_parallel_attention``); saves the member buffer, the member output and the LSE."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, schedule: MemberSchedule,
                topology: CPTopology, kernel: AttentionKernel, scale: float, heads: HeadSplit) -> torch.Tensor:
        ctx.args = (schedule, topology, kernel, scale, heads)
        if topology.ulysses_size == 1:  # all heads on this rank: one GQA run
            out, lse = ring_attention_forward(q, k, v, schedule, topology, kernel, scale)
            ctx.save_for_backward(q, k, v, out, lse)
            return out
        me = topology.ulysses_rank
        member = _to_member(q, k, v, topology, heads)
        q_m, k_m, v_m = _split_member(member, heads.query_counts[me])
        out_m, lse = attend_runs(q_m, k_m, v_m, heads.runs(me), schedule, topology, kernel, scale)
        ctx.save_for_backward(member, out_m, lse)
        return heads_to_sequence(out_m, topology, heads.query_counts)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        schedule, topology, kernel, scale, heads = ctx.args
        me, u = topology.ulysses_rank, topology.ulysses_size
        if u == 1:
            q, k, v, out, lse = ctx.saved_tensors
            return (*ring_attention_backward(dout, q, k, v, out, lse, schedule, topology, kernel, scale),
                    None, None, None, None, None)
        member, out_m, lse = ctx.saved_tensors
        t, d = dout.shape[0], dout.shape[2]
        m = heads.query_counts[me]
        dout_m = sequence_to_heads(dout, topology, heads.query_counts, "ulysses_a2a_bwd")
        send = member.new_empty(member.shape)
        _write_run_grads(_split_member(send, m), attend_runs_backward(dout_m, *_split_member(member, m), out_m, lse,
                                                                      heads.runs(me), schedule, topology, kernel,
                                                                      scale))
        del dout_m
        sizes = [t * _member_width(heads, r) * d for r in range(u)]
        back = all_to_all_member(send.view(-1), topology, "ulysses_a2a_bwd", send_rows=[sizes[me]] * u,
                                 recv_rows=sizes)
        dq = dout.new_empty(t, heads.num_heads_q, d)
        acc = torch.float64 if dout.dtype == torch.float64 else torch.float32
        dk, dv = (torch.zeros(t, heads.num_heads_kv, d, dtype=acc, device=dout.device) for _ in range(2))
        at = 0
        for r, size in enumerate(sizes):
            qr, kr = heads.query_range(r), heads.kv_range(r)
            block = back[at:at + size].view(t, _member_width(heads, r), d)
            g_q, g_k, g_v = block.split((len(qr), len(kr), len(kr)), dim=1)
            dq[:, qr.start:qr.stop] = g_q
            dk[:, kr.start:kr.stop] += g_k  # a KV head used by two ranks: its gradients sum here, once
            dv[:, kr.start:kr.stop] += g_v
            at += size
        return dq, dk.to(dout.dtype), dv.to(dout.dtype), None, None, None, None, None


def _write_run_grads(targets: Tuple[torch.Tensor, ...],
                     run_grads: Iterator[Tuple[Run, torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """Copy ``attend_runs_backward``'s per-run gradients into ``targets`` (dq, dk, dv buffers in member layout)."""
    for (q0, q1, k0, k1), *grads in run_grads:
        for target, grad, (a, b) in zip(targets, grads, ((q0, q1), (k0, k1), (k0, k1))):
            target[:, a:b].copy_(grad)


def _split_member(member: torch.Tensor, m: int) -> Tuple[torch.Tensor, ...]:
    """Views of a member-layout buffer ``[t, m + 2 n, d]``: (queries, keys, values)."""
    n = (member.shape[1] - m) // 2
    return member.split((m, n, n), dim=1)


def fail_with_peers(error: ValueError) -> None:
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
        fail_with_peers(ValueError(f"plan must be a BatchPlan from plan_batch(...), got {type(plan).__name__}"))
    topo = plan.topology
    error, heads, window = None, None, None
    try:
        window = normalize_window(window_size, bool(causal))
        heads = check_attention_inputs(q, k, v, plan)
    except ValueError as err:
        error = err
    if topo.is_offline:
        fail_with_peers(error)
    fields = {"cu_seqlens": plan.doc_lengths, "layout": plan.layout, "topology": topo.signature(),
              "causal": bool(causal), "softmax_scale": softmax_scale, "kernel": topo.config.kernel,
              "window_size": window, "kv_forwarding": topo.config.kv_forwarding}
    if error is None:
        fields.update(q_shape=tuple(q.shape[1:]), kv_shape=tuple(k.shape[1:]), dtype=str(q.dtype),
                      tokens_per_rank=q.shape[0])
    device = q.device if isinstance(q, torch.Tensor) and error is None else None
    agree_across_cp_ranks(topo, fields, error, device, plan.verified_signatures)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    kernel = get_kernel(topo.config.kernel)
    schedule = plan.member_schedule(causal, window_size=window, kv_forwarding=topo.config.kv_forwarding)
    return _ContextParallelAttention.apply(q, k, v, schedule, topo, kernel, scale, heads)
