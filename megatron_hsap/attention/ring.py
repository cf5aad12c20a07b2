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

Node-level K/V forwarding (``ContextParallelConfig.kv_forwarding``, ``kv_forwarding.NodeForwarding``): where a node holds
several ring members, a remote member's rows that several of them need cross the node boundary once,
to the lowest-numbered member needing them, which relays them inside the node after the ring
distances. The slot sequence grows by two phases, again in increasing distance:

    forward:   ... KV(R-1), FWD(1), FWD(2), ...
    backward:  ... dKV(R-1), FWD(1), dFWD(1), FWD(2), dFWD(2), ..., then the deferred dKV(1), dKV(2), ...

FWD(d): relayed rows to m+d (same node), those relayed by m-d received; dFWD(d): their gradients back.
The gradients of rows a member relays go back across nodes only with its peers' (deferred dKV), so
each remote row's gradient crosses the node boundary once too.

Head chunks (UPipe) call this once per stage, and a KV head is attended by several stages.
With a ``shared_kv.SharedRemoteKeyValues`` a stage sends only the KV heads it is the first to attend,
keeps the received rows for the later stages, sums their gradients over the stages and
returns them in the stage of last use: a KV head crosses the ring once per layer in each
direction, as without head chunks. Ring peers have the same Ulysses position and so the same
stage plan: both sides skip the same slots.

Code: this module is the plain core and walks the order above; what each message carries and
the phases after the ring distances are one ``ring_exchange.KeyValueExchange`` policy:
``AllHeads`` (plain), ``shared_kv.SharedHeads`` (head chunks), ``kv_forwarding.NodeForwarding``
(wraps either). A policy never posts a KV(d) or dKV(d) slot itself and the core never posts a
FWD/dFWD or deferred dKV slot, so the order above holds whatever the policy.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron_hsap.attention.kv_forwarding import NodeForwarding
from megatron_hsap.attention.ring_exchange import (
    OP_DKV,
    OP_KV,
    OP_KV_BWD,
    AllHeads,
    KeyValueExchange,
    accumulation_dtype,
)
from megatron_hsap.attention.shared_kv import SharedHeads, SharedRemoteKeyValues
from megatron_hsap.collectives import PendingSlot, post_slot
from megatron_hsap.instrumentation.trace import trace_event
from megatron_hsap.kernels.base import AttentionBlocks, AttentionKernel, merge_partial_attention_
from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.sequence.schedule import MemberSchedule, RowRanges

_Posted = Tuple[PendingSlot, Optional[torch.Tensor]]


def key_value_exchange(schedule: MemberSchedule, k: torch.Tensor, v: torch.Tensor, topology: CPTopology,
                       shared: Optional[SharedRemoteKeyValues] = None) -> KeyValueExchange:
    """The exchange policy of one call: all heads or ``shared``'s, wrapped in node-level forwarding when the
    schedule has relays or deferred returns."""
    exchange: KeyValueExchange = AllHeads(k, v) if shared is None else SharedHeads(shared, k, v)
    return NodeForwarding(exchange, schedule, topology) if schedule.forwarding else exchange


class _Ring:
    """The KV(d) and dKV(d) slots of one call: what this member posts at each ring distance."""

    def __init__(self, schedule: MemberSchedule, topology: CPTopology, exchange: KeyValueExchange) -> None:
        self.recv = {r.distance: r for r in schedule.recv_steps}
        self.send = {s.distance: s for s in schedule.send_steps}
        self.topology, self.exchange = topology, exchange

    def post_kv(self, distance: int, op: str) -> _Posted:
        """KV(distance): this member's rows to m + distance, a buffer for those of m - distance (returned)."""
        sends, recvs, buffer = [], [], None
        if distance >= self.topology.ring_size:
            return PendingSlot([], op, distance), None
        send, recv = self.send.get(distance), self.recv.get(distance)
        message = None if send is None else self.exchange.pack(send.rows)
        if message is not None:
            sends.append((send.dst_member, message))
        if recv is not None:
            buffer = self.exchange.receive_buffer(distance, recv.num_rows)
            if buffer is not None:
                recvs.append((recv.src_member, buffer))
        return post_slot(self.topology, sends, recvs, op, distance), buffer

    def received(self, distance: int, buffer: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``[2, rows, h_kv', d]``: the rows of m - distance to attend (after the slot's wait), None if none."""
        recv = self.recv.get(distance)
        return None if recv is None else self.exchange.attended(distance, buffer, recv.num_rows)

    def return_buffer(self, distance: int) -> Optional[torch.Tensor]:
        """The buffer of dKV(distance) for the gradients of this member's rows sent to m + distance, or None."""
        send = self.send.get(distance)
        return None if send is None else self.exchange.return_buffer(distance, send.rows.num_rows)

    def post_dkv(self, distance: int, grads: Optional[torch.Tensor], returned: Optional[torch.Tensor]) -> "_Return":
        """dKV(distance): ``grads`` back to m - distance, ``returned`` (``return_buffer``) filled from m + distance."""
        sends, recvs = [], []
        recv, send = self.recv.get(distance), self.send.get(distance)
        if grads is not None:
            sends.append((recv.src_member, grads))
        if returned is not None:
            recvs.append((send.dst_member, returned))
        rows = None if send is None else send.rows
        return _Return(post_slot(self.topology, sends, recvs, OP_DKV, distance), returned, rows, self.exchange)


class _Return:
    """A posted dKV slot; ``finish`` waits for it and adds what came back to dk/dv."""

    def __init__(self, slot: PendingSlot, returned: Optional[torch.Tensor], rows: Optional[RowRanges],
                 exchange: KeyValueExchange) -> None:
        self.slot, self.returned, self.rows, self.exchange = slot, returned, rows, exchange

    def finish(self, dk: torch.Tensor, dv: torch.Tensor) -> None:
        self.slot.wait()
        if self.returned is not None:
            self.exchange.add_returned(self.rows, self.returned, dk, dv)
        self.returned = None


class _Partial:
    """The forward's running result: out ``[t, h, d]`` and lse ``[h, t]`` in the accumulation dtype, starting
    at 0 and -inf (rows that see no key), each kernel call folded in with the log-sum-exp."""

    def __init__(self, q: torch.Tensor, kernel: AttentionKernel, softmax_scale: float) -> None:
        acc = accumulation_dtype(q.dtype)
        self.q, self.kernel, self.scale = q, kernel, softmax_scale
        self.out = torch.zeros(q.shape, dtype=acc, device=q.device)
        self.lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc, device=q.device)

    def attend(self, k: torch.Tensor, v: torch.Tensor, blocks: AttentionBlocks, distance: int) -> None:
        """Fold in the queries' attention to k/v ``[rows, h_kv', d]`` over ``blocks``."""
        if len(blocks):
            trace_event("kernel", "forward", distance)
            part_out, part_lse = self.kernel.forward(self.q, k, v, blocks, self.scale)
            self.lse = merge_partial_attention_(self.out, self.lse, part_out, part_lse)


def ring_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, schedule: MemberSchedule,
                           topology: CPTopology, kernel: AttentionKernel, softmax_scale: float,
                           shared: Optional[SharedRemoteKeyValues] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """q ``[t_m, h_q', d]``, k/v ``[t_m, h_kv', d]``: this rank's head slice of its member buffer.
    Returns out ``[t_m, h_q', d]`` in q's dtype and lse ``[h_q', t_m]`` (fp32; fp64 for fp64 inputs).
    shared: remote rows kept across calls that attend the same KV heads (see the module doc)."""
    if topology.ring_size == 1 and len(schedule.local_blocks):  # one kernel call: its result is final
        trace_event("kernel", "forward", 0)
        return kernel.forward(q, k, v, schedule.local_blocks, softmax_scale)
    exchange = key_value_exchange(schedule, k, v, topology, shared)
    ring, partial = _Ring(schedule, topology, exchange), _Partial(q, kernel, softmax_scale)
    pending = ring.post_kv(1, OP_KV)
    partial.attend(k, v, schedule.local_blocks, 0)
    for distance in range(1, topology.ring_size):
        slot, arrived = pending
        slot.wait()
        pending = ring.post_kv(distance + 1, OP_KV)
        received = ring.received(distance, arrived)
        if received is not None:
            partial.attend(received[0], received[1], ring.recv[distance].blocks, distance)
        del received, arrived
    exchange.after_ring_forward(partial.attend)
    exchange.finish()
    return partial.out.to(q.dtype), partial.lse


class _Gradients:
    """The backward's accumulators dq/dk/dv (fp32; fp64 for fp64) and its kernel calls."""

    def __init__(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 kernel: AttentionKernel, softmax_scale: float) -> None:
        acc = accumulation_dtype(q.dtype)
        self.dout, self.q, self.out, self.lse, self.kernel, self.scale = dout, q, out, lse, kernel, softmax_scale
        self.dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        self.dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        self.dv = torch.zeros(k.shape, dtype=acc, device=k.device)

    def attend(self, k: torch.Tensor, v: torch.Tensor, blocks: AttentionBlocks,
               distance: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The backward of one kernel call over k/v ``[rows, h_kv', d]``: dq accumulated, (dk, dv) of k/v returned."""
        trace_event("kernel", "backward", distance)
        g_q, g_k, g_v = self.kernel.backward(self.dout, self.q, k, v, self.out, self.lse, blocks, self.scale)
        self.dq += g_q
        return g_k, g_v


def ring_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, schedule: MemberSchedule, topology: CPTopology,
                            kernel: AttentionKernel, softmax_scale: float,
                            shared: Optional[SharedRemoteKeyValues] = None
                            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``ring_attention_forward`` (same layouts), accumulated in fp32/fp64, returned in input dtypes.
    With ``shared`` the gradients of remote rows are summed there and go back to their owners in the call that
    last attends their head; what comes back for this rank's rows is added to that call's dk/dv (the first
    column of the head)."""
    dout = dout.contiguous()
    if topology.ring_size == 1 and len(schedule.local_blocks):  # one kernel call: no accumulators
        trace_event("kernel", "backward", 0)
        return kernel.backward(dout, q, k, v, out, lse, schedule.local_blocks, softmax_scale, grad_dtype=q.dtype)
    exchange = key_value_exchange(schedule, k, v, topology, shared)
    ring, grads = _Ring(schedule, topology, exchange), _Gradients(dout, q, k, out, lse, kernel, softmax_scale)
    pending = ring.post_kv(1, OP_KV_BWD)
    if len(schedule.local_blocks):
        g_k, g_v = grads.attend(k, v, schedule.local_blocks, 0)
        grads.dk += g_k
        grads.dv += g_v
        del g_k, g_v
    returning: Optional[_Return] = None  # at most one return in flight besides the one being posted
    for distance in range(1, topology.ring_size):
        slot, arrived = pending
        slot.wait()
        pending = ring.post_kv(distance + 1, OP_KV_BWD)
        received, outgoing = ring.received(distance, arrived), None
        del arrived
        if received is not None:
            g_k, g_v = grads.attend(received[0], received[1], ring.recv[distance].blocks, distance)
            del received
            outgoing = exchange.grads_out(distance, g_k, g_v)
            del g_k, g_v
        returned = ring.return_buffer(distance)  # allocated before the previous return completes (memory_model)
        if returning is not None:
            returning.finish(grads.dk, grads.dv)
        returning = ring.post_dkv(distance, outgoing, returned)
        del outgoing, returned
    if returning is not None:
        returning.finish(grads.dk, grads.dv)
    exchange.after_ring_backward(grads.attend, grads.dk, grads.dv)
    exchange.finish()
    return grads.dq.to(q.dtype), grads.dk.to(k.dtype), grads.dv.to(v.dtype)
