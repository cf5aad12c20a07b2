"""Attention of one ring member over its schedule: local blocks, then one exchange per ring distance.

Forward: the member's own key/value rows are attended first while the first
exchange is in flight; each received set of rows is attended as it arrives and
merged with the log-sum-exp in fp32 (fp64 stays fp64). Backward: the same
exchanges again (keys/values are re-sent rather than kept, so memory stays at
two receive buffers), gradients for received rows are sent back to their owner,
which adds them to its own in fp32.
With ring size 1 (pure Ulysses) the schedule has only local blocks.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron_hsap.collectives import PendingExchange, start_exchange
from megatron_hsap.kernels.base import AttentionKernel, merge_partial_attention
from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.sequence.schedule import MemberSchedule


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Exchanges:
    """Iterates a schedule's ring distances, keeping the next exchange in flight during compute."""

    def __init__(self, schedule: MemberSchedule, topology: CPTopology, kv: torch.Tensor, op: str) -> None:
        self.steps = schedule.steps()
        self.topology, self.kv, self.op = topology, kv, op

    def _start(self, index: int) -> PendingExchange:
        distance, recv, send = self.steps[index]
        kv = self.kv
        return start_exchange(self.topology,
                              None if send is None else send.rows.gather(kv),
                              None if send is None else send.dst_member,
                              None if recv is None else (recv.num_rows,) + tuple(kv.shape[1:]),
                              None if recv is None else recv.src_member, kv.dtype, kv.device, self.op, tag=2 * distance)

    def __iter__(self):
        pending = self._start(0) if self.steps else None
        for i, (distance, recv, send) in enumerate(self.steps):
            received = pending.wait()
            pending = self._start(i + 1) if i + 1 < len(self.steps) else None
            yield distance, recv, send, received


def _empty_result(q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Out ``[t, h, d]`` = 0 and lse ``[h, t]`` = -inf in the accumulation dtype: rows that see no key."""
    acc = _acc_dtype(q.dtype)
    return (torch.zeros(q.shape, dtype=acc, device=q.device),
            torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc, device=q.device))


def ring_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, schedule: MemberSchedule,
                           topology: CPTopology, kernel: AttentionKernel,
                           softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """q ``[t_m, h_q', d]``, k/v ``[t_m, h_kv', d]``: this rank's head slice of its member buffer.
    Returns out ``[t_m, h_q', d]`` in q's dtype and lse ``[h_q', t_m]`` (fp32; fp64 for fp64 inputs)."""
    out, lse = _empty_result(q)
    if len(schedule.local_blocks):
        part_out, part_lse = kernel.forward(q, k, v, schedule.local_blocks, softmax_scale)
        out, lse = merge_partial_attention(out, lse, part_out, part_lse)
    kv = torch.stack((k, v), dim=1)  # [t_m, 2, h_kv', d]: one message per exchange
    for _, recv, _, received in _Exchanges(schedule, topology, kv, "ring_kv"):
        if recv is not None:
            part_out, part_lse = kernel.forward(q, received[:, 0], received[:, 1], recv.blocks, softmax_scale)
            out, lse = merge_partial_attention(out, lse, part_out, part_lse)
    return out.to(q.dtype), lse


def ring_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, schedule: MemberSchedule, topology: CPTopology,
                            kernel: AttentionKernel, softmax_scale: float
                            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``ring_attention_forward`` (same layouts), accumulated in fp32/fp64, returned in input dtypes."""
    dout = dout.contiguous()
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros((k.shape[0], 2) + tuple(k.shape[1:]), dtype=acc, device=k.device)
    if len(schedule.local_blocks):
        g_q, g_k, g_v = kernel.backward(dout, q, k, v, out, lse, schedule.local_blocks, softmax_scale)
        dq += g_q
        dkv[:, 0] += g_k
        dkv[:, 1] += g_v
    kv = torch.stack((k, v), dim=1)
    grads_in_flight = []
    for distance, recv, send, received in _Exchanges(schedule, topology, kv, "ring_kv_bwd"):
        grad_rows: Optional[torch.Tensor] = None
        if recv is not None:
            g_q, g_k, g_v = kernel.backward(dout, q, received[:, 0], received[:, 1], out, lse, recv.blocks,
                                            softmax_scale)
            dq += g_q
            grad_rows = torch.stack((g_k, g_v), dim=1).to(k.dtype)
        pending = start_exchange(topology, grad_rows, None if recv is None else recv.src_member,
                                 None if send is None else (send.rows.num_rows,) + tuple(kv.shape[1:]),
                                 None if send is None else send.dst_member, k.dtype, k.device, "ring_dkv",
                                 tag=2 * distance + 1)
        grads_in_flight.append((send, pending))
    for send, pending in grads_in_flight:
        returned = pending.wait()
        if send is not None:
            send.rows.scatter_add_(dkv, returned.to(acc))
    return dq.to(q.dtype), dkv[:, 0].to(k.dtype), dkv[:, 1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Differentiable ``ring_attention_forward`` (layouts as there)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, schedule: MemberSchedule,
                topology: CPTopology, kernel: AttentionKernel, softmax_scale: float) -> torch.Tensor:
        out, lse = ring_attention_forward(q, k, v, schedule, topology, kernel, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (schedule, topology, kernel, softmax_scale)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None
