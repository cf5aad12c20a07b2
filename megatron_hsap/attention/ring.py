"""Attention of one ring member over its schedule: local blocks, then one exchange per ring distance.

Forward: the first key/value exchange is posted before the local blocks run, and each
later one while the previous distance's blocks run (two receive buffers at most). Each
received set of rows is attended as it arrives and folded into the output with the
log-sum-exp in fp32 (fp64 stays fp64). Backward: the same exchanges again (keys/values are
re-sent rather than kept), gradients for received rows go back to their owner, which adds
them to its own in fp32; a return is completed before the next one is posted, so the
backward holds a constant number of buffers whatever the ring size.

Message order, which is what makes this correct on NCCL (it ignores tags and matches the
messages between two ranks in posting order). Every rank walks the distances 1..R-1 in
increasing order and posts its *slots* in one global sequence:

    forward:   KV(1), KV(2), ..., KV(R-1)
    backward:  KV(1), KV(2), dKV(1), KV(3), dKV(2), ..., KV(R-1), dKV(R-2), dKV(R-1)

KV(d): this member's needed rows to member m+d, those of m-d received. dKV(d): gradients
of the rows received at distance d back to m-d, those of the rows sent at distance d from
m+d. A rank skips a slot in which it has nothing (its peers derive the same from the
plan), so the messages between any two ranks are posted in the same relative order on
both sides. Every wait is for a slot earlier in the sequence than every post that follows
it, so no rank can wait on a peer that waits on it.
With ring size 1 (pure Ulysses) the schedule has only local blocks.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron_hsap.collectives import PendingSlot, post_slot
from megatron_hsap.instrumentation.trace import trace_event
from megatron_hsap.kernels.base import AttentionKernel, AttentionBlocks, merge_partial_attention_
from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.sequence.schedule import MemberSchedule

#: Operation names in ``instrumentation.comm``.
OP_KV, OP_KV_BWD, OP_DKV = "ring_kv", "ring_kv_bwd", "ring_dkv"

_Posted = Tuple[PendingSlot, Optional[torch.Tensor]]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _KeyValueSlots:
    """Posts the KV(d) slots of one schedule; received rows arrive as ``[2, rows, h_kv, d]`` (k, then v)."""

    def __init__(self, schedule: MemberSchedule, topology: CPTopology, k: torch.Tensor, v: torch.Tensor,
                 op: str) -> None:
        self.recv = {r.distance: r for r in schedule.recv_steps}
        self.send = {s.distance: s for s in schedule.send_steps}
        self.topology, self.k, self.v, self.op = topology, k, v, op

    def post(self, distance: int) -> _Posted:
        k, v = self.k, self.v
        sends, recvs, buffer = [], [], None
        send = self.send.get(distance)
        if send is not None:
            rows = torch.empty((2, send.rows.num_rows) + tuple(k.shape[1:]), dtype=k.dtype, device=k.device)
            send.rows.gather_into(k, rows[0])
            send.rows.gather_into(v, rows[1])
            sends.append((send.dst_member, rows))
        recv = self.recv.get(distance)
        if recv is not None:
            buffer = torch.empty((2, recv.num_rows) + tuple(k.shape[1:]), dtype=k.dtype, device=k.device)
            recvs.append((recv.src_member, buffer))
        return post_slot(self.topology, sends, recvs, self.op, distance), buffer


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
    ring_size = topology.ring_size
    slots = _KeyValueSlots(schedule, topology, k, v, OP_KV)
    pending = slots.post(1) if ring_size > 1 else None
    out, lse = _empty_result(q)

    def attend(k_part: torch.Tensor, v_part: torch.Tensor, blocks: AttentionBlocks, distance: int) -> None:
        nonlocal lse
        if len(blocks):
            trace_event("kernel", "forward", distance)
            part_out, part_lse = kernel.forward(q, k_part, v_part, blocks, softmax_scale)
            lse = merge_partial_attention_(out, lse, part_out, part_lse)

    attend(k, v, schedule.local_blocks, 0)
    for distance in range(1, ring_size):
        slot, received = pending
        slot.wait()
        pending = slots.post(distance + 1) if distance + 1 < ring_size else None
        if received is not None:
            attend(received[0], received[1], slots.recv[distance].blocks, distance)
    return out.to(q.dtype), lse


def ring_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, schedule: MemberSchedule, topology: CPTopology,
                            kernel: AttentionKernel, softmax_scale: float
                            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``ring_attention_forward`` (same layouts), accumulated in fp32/fp64, returned in input dtypes."""
    ring_size = topology.ring_size
    dout = dout.contiguous()
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    slots = _KeyValueSlots(schedule, topology, k, v, OP_KV_BWD)
    pending = slots.post(1) if ring_size > 1 else None
    if len(schedule.local_blocks):
        trace_event("kernel", "backward", 0)
        g_q, g_k, g_v = kernel.backward(dout, q, k, v, out, lse, schedule.local_blocks, softmax_scale)
        dq += g_q
        dk += g_k
        dv += g_v
    returning: Optional[Tuple[PendingSlot, Optional[torch.Tensor], int]] = None

    def finish_return() -> None:
        slot, returned, distance = returning
        slot.wait()
        if returned is not None:
            rows = slots.send[distance].rows
            rows.add_into(dk, returned[0])
            rows.add_into(dv, returned[1])

    for distance in range(1, ring_size):
        slot, received = pending
        slot.wait()
        pending = slots.post(distance + 1) if distance + 1 < ring_size else None
        sends, recvs, returned = [], [], None
        recv = slots.recv.get(distance)
        if recv is not None:
            trace_event("kernel", "backward", distance)
            g_q, g_k, g_v = kernel.backward(dout, q, received[0], received[1], out, lse, recv.blocks, softmax_scale)
            del received
            dq += g_q
            grads = torch.empty((2,) + tuple(g_k.shape), dtype=k.dtype, device=k.device)
            grads[0].copy_(g_k)
            grads[1].copy_(g_v)
            del g_q, g_k, g_v
            sends.append((recv.src_member, grads))
        send = slots.send.get(distance)
        if send is not None:
            returned = torch.empty((2, send.rows.num_rows) + tuple(k.shape[1:]), dtype=k.dtype, device=k.device)
            recvs.append((send.dst_member, returned))
        if returning is not None:  # at most one return in flight besides this one
            finish_return()
        returning = (post_slot(topology, sends, recvs, OP_DKV, distance), returned, distance)
    if returning is not None:
        finish_return()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

