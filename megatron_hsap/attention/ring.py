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

Node-level K/V forwarding (``ContextParallelConfig.kv_forwarding``, ``_Relays``): where a node holds
several ring members, a remote member's rows that several of them need cross the node boundary once,
to the lowest-numbered member needing them, which relays them inside the node after the ring
distances. The slot sequence grows by two phases, again in increasing distance:

    forward:   ... KV(R-1), FWD(1), FWD(2), ...
    backward:  ... dKV(R-1), FWD(1), dFWD(1), FWD(2), dFWD(2), ..., then the deferred dKV(1), dKV(2), ...

FWD(d): relayed rows to m+d (same node), those relayed by m-d received; dFWD(d): their gradients back.
The gradients of rows a member relays go back across nodes only with its peers' (deferred dKV), so
each remote row's gradient crosses the node boundary once too.

Head chunks (UPipe) call this once per stage, and a KV head is attended by several stages.
With a ``SharedRemoteKeyValues`` a stage sends only the KV heads it is the first to attend,
keeps the received rows for the later stages, sums their gradients over the stages and
returns them in the stage of last use: a KV head crosses the ring once per layer in each
direction, as without head chunks. Ring peers have the same Ulysses position and so the same
stage plan: both sides skip the same slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterator, Optional, Tuple

import torch

from megatron_hsap.collectives import PendingSlot, post_slot
from megatron_hsap.instrumentation.trace import trace_event
from megatron_hsap.kernels.base import AttentionKernel, AttentionBlocks, merge_partial_attention_
from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.sequence.schedule import MemberSchedule, RecvStep, RelaySend, RowRanges

#: Operation names in ``instrumentation.comm``.
OP_KV, OP_KV_BWD, OP_DKV = "ring_kv", "ring_kv_bwd", "ring_dkv"
#: Node-level K/V forwarding inside a node (``_Relays``).
OP_KV_RELAY, OP_KV_RELAY_BWD, OP_DKV_RELAY = "ring_kv_relay", "ring_kv_relay_bwd", "ring_dkv_relay"

_Posted = Tuple[PendingSlot, Optional[torch.Tensor]]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class SharedRemoteKeyValues:
    """Remote K/V rows of the KV heads a sequence of calls (UPipe stages) attends, kept from a head's first
    call to its last. Before each call the caller sets, identically on every ring peer: ``heads``, the KV
    head of each k/v column of the call (in order, repeats allowed); ``new``, the heads first attended in
    this call; ``done``, the heads last attended in it.

    received: distance -> head -> ``[2, rows, d]`` (k, v) from member m - distance;
    grads: distance -> head -> their gradient summed over the calls so far (fp32; fp64 for fp64).
    """

    heads: Tuple[int, ...] = ()
    new: Tuple[int, ...] = ()
    done: Tuple[int, ...] = ()
    received: Dict[int, Dict[int, torch.Tensor]] = field(default_factory=dict)
    grads: Dict[int, Dict[int, torch.Tensor]] = field(default_factory=dict)
    stage: Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]] = ((), (), ())

    def begin_stage(self, heads: Tuple[int, ...], new: Tuple[int, ...], done: Tuple[int, ...]) -> None:
        """A stage attending KV heads ``heads`` (its k/v columns), ``new`` first and ``done`` last, in
        one or more calls, each over a column range (``select``)."""
        self.stage = (heads, new, done)

    def select(self, k0: int, k1: int) -> None:
        """The next call takes the stage's k/v columns ``k0:k1``."""
        heads, new, done = self.stage
        self.heads = heads[k0:k1]
        self.new = tuple(j for j in self.heads if j in new)
        self.done = tuple(j for j in self.heads if j in done)

    def columns(self, heads: Tuple[int, ...]) -> Tuple[int, ...]:
        """The (first) k/v column of each of ``heads`` in this call."""
        return tuple(self.heads.index(j) for j in heads)

    def forget_done(self) -> None:
        """Drop the rows (and summed gradients) of the heads no later call attends."""
        for table in (self.received, self.grads):
            for per_head in table.values():
                for j in self.done:
                    per_head.pop(j, None)

    def keep(self, key: int, buffer: torch.Tensor) -> None:
        """Keep each new head's rows of a received ``[2, rows, len(new), d]`` (key: ring distance; relayed
        rows use minus the relay distance)."""
        kept = self.received.setdefault(key, {})
        for i, j in enumerate(self.new):
            kept[j] = buffer[:, :, i]

    def assemble(self, key: int, buffer: Optional[torch.Tensor], num_rows: int, like: torch.Tensor) -> torch.Tensor:
        """``[2, rows, h_kv, d]`` kept rows of this call's heads (``buffer``, what arrived in this call, as is
        when it holds them all; ``like``: dtype and device)."""
        if self.new == self.heads and buffer is not None:
            return buffer
        kept = self.received[key]
        if len(self.heads) == 1 and kept[self.heads[0]].is_contiguous():
            return kept[self.heads[0]].unsqueeze(2)  # a kept one-head buffer, attended as is
        rows = torch.empty((2, num_rows, len(self.heads)) + tuple(like.shape[2:]), dtype=like.dtype,
                           device=like.device)
        for c, j in enumerate(self.heads):
            rows[:, :, c].copy_(kept[j])
        return rows


class _KeyValueSlots:
    """Posts the KV(d) slots of one schedule; received rows arrive as ``[2, rows, h_kv, d]`` (k, then v).
    With ``shared`` only the call's new KV heads travel; ``received(d)`` assembles the call's heads."""

    def __init__(self, schedule: MemberSchedule, topology: CPTopology, k: torch.Tensor, v: torch.Tensor,
                 op: str, shared: Optional[SharedRemoteKeyValues] = None) -> None:
        self.recv = {r.distance: r for r in schedule.recv_steps}
        self.send = {s.distance: s for s in schedule.send_steps}
        self.topology, self.k, self.v, self.op, self.shared = topology, k, v, op, shared
        self.whole = shared is None or shared.new == shared.heads  # every column travels, as is
        self.new_columns = () if self.whole else shared.columns(shared.new)
        #: KV heads (columns) that travel in this call's messages.
        self.heads = k.shape[1] if self.whole else len(self.new_columns)

    def post(self, distance: int) -> _Posted:
        k, v, heads = self.k, self.v, self.heads
        sends, recvs, buffer = [], [], None
        send = self.send.get(distance)
        if send is not None and heads:
            rows = torch.empty((2, send.rows.num_rows, heads) + tuple(k.shape[2:]), dtype=k.dtype, device=k.device)
            if self.whole:
                send.rows.gather_into(k, rows[0])
                send.rows.gather_into(v, rows[1])
            else:
                for i, c in enumerate(self.new_columns):
                    send.rows.gather_into(k[:, c], rows[0, :, i])
                    send.rows.gather_into(v[:, c], rows[1, :, i])
            sends.append((send.dst_member, rows))
        recv = self.recv.get(distance)
        if recv is not None and heads:
            buffer = torch.empty((2, recv.num_rows, heads) + tuple(k.shape[2:]), dtype=k.dtype, device=k.device)
            recvs.append((recv.src_member, buffer))
            if self.shared is not None:
                self.shared.keep(distance, buffer)
        return post_slot(self.topology, sends, recvs, self.op, distance), buffer

    def received(self, distance: int, buffer: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``[2, rows, h_kv, d]`` rows of member m - distance for this call's heads (after its slot's wait)."""
        if self.shared is None or distance not in self.recv:
            return buffer
        return self.shared.assemble(distance, buffer, self.recv[distance].num_rows, self.k)


def _empty_result(q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Out ``[t, h, d]`` = 0 and lse ``[h, t]`` = -inf in the accumulation dtype: rows that see no key."""
    acc = _acc_dtype(q.dtype)
    return (torch.zeros(q.shape, dtype=acc, device=q.device),
            torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc, device=q.device))


def ring_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, schedule: MemberSchedule,
                           topology: CPTopology, kernel: AttentionKernel, softmax_scale: float,
                           shared: Optional[SharedRemoteKeyValues] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """q ``[t_m, h_q', d]``, k/v ``[t_m, h_kv', d]``: this rank's head slice of its member buffer.
    Returns out ``[t_m, h_q', d]`` in q's dtype and lse ``[h_q', t_m]`` (fp32; fp64 for fp64 inputs).
    shared: remote rows kept across calls that attend the same KV heads (see the module doc)."""
    ring_size = topology.ring_size
    if ring_size == 1 and len(schedule.local_blocks):  # one kernel call: its result is final, nothing to merge
        trace_event("kernel", "forward", 0)
        return kernel.forward(q, k, v, schedule.local_blocks, softmax_scale)
    slots = _KeyValueSlots(schedule, topology, k, v, OP_KV, shared)
    pending = slots.post(1) if ring_size > 1 else None
    out, lse = _empty_result(q)

    def attend(k_part: torch.Tensor, v_part: torch.Tensor, blocks: AttentionBlocks, distance: int) -> None:
        nonlocal lse
        if len(blocks):
            trace_event("kernel", "forward", distance)
            part_out, part_lse = kernel.forward(q, k_part, v_part, blocks, softmax_scale)
            lse = merge_partial_attention_(out, lse, part_out, part_lse)

    attend(k, v, schedule.local_blocks, 0)
    relays = _Relays(schedule, topology, slots, shared)
    for distance in range(1, ring_size):
        slot, arrived = pending
        slot.wait()
        pending = slots.post(distance + 1) if distance + 1 < ring_size else None
        relays.keep(distance, arrived)
        received = slots.received(distance, arrived)
        if received is not None:
            attend(received[0], received[1], slots.recv[distance].blocks, distance)
        del received, arrived
    for distance, step, forwarded in relays.exchange(OP_KV_RELAY):
        if step is not None:
            attend(forwarded[0], forwarded[1], step.blocks, distance)
        del forwarded
    if shared is not None:
        shared.forget_done()
    return out.to(q.dtype), lse


def ring_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, schedule: MemberSchedule, topology: CPTopology,
                            kernel: AttentionKernel, softmax_scale: float,
                            shared: Optional[SharedRemoteKeyValues] = None
                            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``ring_attention_forward`` (same layouts), accumulated in fp32/fp64, returned in input dtypes.
    With ``shared`` the gradients of remote rows are summed there and go back to their owners in the call that
    last attends their head; what comes back for this rank's rows is added to that call's dk/dv (the first
    column of the head)."""
    ring_size = topology.ring_size
    dout = dout.contiguous()
    if ring_size == 1 and len(schedule.local_blocks):  # one kernel call: no accumulators
        trace_event("kernel", "backward", 0)
        grads = kernel.backward(dout, q, k, v, out, lse, schedule.local_blocks, softmax_scale)
        return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    slots = _KeyValueSlots(schedule, topology, k, v, OP_KV_BWD, shared)
    returns = _Returns(shared, k)
    pending = slots.post(1) if ring_size > 1 else None
    if len(schedule.local_blocks):
        trace_event("kernel", "backward", 0)
        g_q, g_k, g_v = kernel.backward(dout, q, k, v, out, lse, schedule.local_blocks, softmax_scale)
        dq += g_q
        dk += g_k
        dv += g_v
    returning: Optional[Tuple[PendingSlot, Optional[torch.Tensor], int]] = None

    def add_returned(distance: int, returned: torch.Tensor) -> None:
        rows = slots.send[distance].rows
        for column, grad_k, grad_v in returns.columns(returned):
            rows.add_into(dk[:, column], grad_k)
            rows.add_into(dv[:, column], grad_v)

    def finish_return() -> None:
        slot, returned, distance = returning
        slot.wait()
        if returned is not None:
            add_returned(distance, returned)

    relays = _Relays(schedule, topology, slots, shared)
    for distance in range(1, ring_size):
        slot, arrived = pending
        slot.wait()
        pending = slots.post(distance + 1) if distance + 1 < ring_size else None
        relays.keep(distance, arrived)
        received = slots.received(distance, arrived)
        del arrived
        sends, recvs, returned = [], [], None
        recv = slots.recv.get(distance)
        if recv is not None and received is not None:
            trace_event("kernel", "backward", distance)
            g_q, g_k, g_v = kernel.backward(dout, q, received[0], received[1], out, lse, recv.blocks, softmax_scale)
            del received
            dq += g_q
            if recv.deferred:  # the relayed copies' gradients join these before they go back
                returns.hold(distance, g_k, g_v)
            else:
                grads = returns.outgoing(distance, g_k, g_v)
                if grads is not None:
                    sends.append((recv.src_member, grads))
            del g_q, g_k, g_v
        send = slots.send.get(distance)
        if send is not None and returns.heads and not send.deferred:
            returned = torch.empty((2, send.rows.num_rows, returns.heads) + tuple(k.shape[2:]), dtype=k.dtype,
                                   device=k.device)
            recvs.append((send.dst_member, returned))
        if returning is not None:  # at most one return in flight besides this one
            finish_return()
        returning = (post_slot(topology, sends, recvs, OP_DKV, distance), returned, distance)
    if returning is not None:
        finish_return()
    if schedule.forwarding:
        relays.backward(dq, dout, q, out, lse, kernel, softmax_scale, returns)
        for distance, returned in relays.deferred_returns(returns):
            add_returned(distance, returned)
    if shared is not None:
        shared.forget_done()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _Returns:
    """The dK/dV returns of one backward call: every column's gradient (no ``shared``), or the summed
    gradients of the heads the call attends last. Keys: ring distance of the received rows (minus the
    relay distance for relayed rows, ``_Relays``)."""

    def __init__(self, shared: Optional[SharedRemoteKeyValues], k: torch.Tensor) -> None:
        self.shared, self.dtype = shared, k.dtype
        self.acc = _acc_dtype(k.dtype)
        self.heads = k.shape[1] if shared is None else len(shared.done)
        self.held: Dict[int, torch.Tensor] = {}  # key -> fp32 [2, rows, h_kv, d], without ``shared``

    def hold(self, key: int, g_k: torch.Tensor, g_v: torch.Tensor) -> None:
        """Sum gradients ``[rows, h_kv, d]`` of received rows in fp32 until ``take``."""
        if self.shared is None:
            if key not in self.held:
                self.held[key] = torch.zeros((2,) + tuple(g_k.shape), dtype=self.acc, device=g_k.device)
            self.held[key][0] += g_k
            self.held[key][1] += g_v
            return
        sums = self.shared.grads.setdefault(key, {})
        for c, j in enumerate(self.shared.heads):
            if j not in sums:
                sums[j] = torch.zeros((2,) + tuple(g_k[:, c].shape), dtype=self.acc, device=g_k.device)
            sums[j][0] += g_k[:, c]
            sums[j][1] += g_v[:, c]

    def take(self, key: int) -> Optional[torch.Tensor]:
        """``[2, rows, heads, d]`` in k's dtype: the held gradients that go back now (None: none this call)."""
        if self.shared is None:
            return self.held.pop(key).to(self.dtype)
        if not self.shared.done:
            return None
        sums = self.shared.grads[key]
        first = sums[self.shared.done[0]]
        grads = torch.empty((2, first.shape[1], len(self.shared.done)) + tuple(first.shape[2:]), dtype=self.dtype,
                            device=first.device)
        for i, j in enumerate(self.shared.done):
            grads[:, :, i].copy_(sums[j])
        return grads

    def outgoing(self, key: int, g_k: torch.Tensor, g_v: torch.Tensor) -> Optional[torch.Tensor]:
        """``[2, rows, heads, d]`` in k's dtype to send back for the rows received at ``key``, or None."""
        if self.shared is None:  # straight into the message: one rounding, no fp32 copy
            grads = torch.empty((2,) + tuple(g_k.shape), dtype=self.dtype, device=g_k.device)
            grads[0].copy_(g_k)
            grads[1].copy_(g_v)
            return grads
        self.hold(key, g_k, g_v)
        return self.take(key)

    def add_back(self, key: int, rows: RowRanges, back: torch.Tensor) -> None:
        """Add ``back`` ``[2, n, heads, d]`` (returned gradients of relayed copies) to the held gradients of
        ``rows`` of the rows received at ``key``."""
        if self.shared is None:
            rows.add_into(self.held[key][0], back[0])
            rows.add_into(self.held[key][1], back[1])
            return
        for i, j in enumerate(self.shared.done):
            rows.add_into(self.shared.grads[key][j][0], back[0, :, i])
            rows.add_into(self.shared.grads[key][j][1], back[1, :, i])

    def columns(self, returned: torch.Tensor):
        """``(column of dk/dv, dk rows, dv rows)`` per head of a returned ``[2, rows, heads, d]``."""
        if self.shared is None:
            return [(slice(None), returned[0], returned[1])]
        return [(c, returned[0, :, i], returned[1, :, i])
                for i, c in enumerate(self.shared.columns(self.shared.done))]


class _Relays:
    """Node-level K/V forwarding of one call (``MemberSchedule.relay_sends`` / ``relay_recvs``).

    After the ring distances, each member passes rows it received from other nodes to the members of its
    node that need them too (one message per pair and distance, in increasing distance: FWD(d)); in the
    backward the relayed rows' gradients come back to the relay right after (dFWD(d)), join the gradients
    of its own use of those rows, and only then go back across nodes (the deferred dKV(d), in increasing
    distance). The messages between two ranks are posted in the same order on both sides. With ``shared``
    (head chunks) only the call's new KV heads travel, relayed rows are kept across calls like received
    ones (keys: minus the relay distance) and gradients go back in the call that attends their head last.
    """

    def __init__(self, schedule: MemberSchedule, topology: CPTopology, slots: _KeyValueSlots,
                 shared: Optional[SharedRemoteKeyValues]) -> None:
        self.schedule, self.topology, self.slots, self.shared = schedule, topology, slots, shared
        self.sources = {d for step in schedule.relay_sends for d, _ in step.parts}
        self.arrived: Dict[int, torch.Tensor] = {}  # distance -> [2, rows, travelling heads, d] relayed later

    def keep(self, distance: int, arrived: Optional[torch.Tensor]) -> None:
        """Keep what arrived at ``distance`` in this call, if some of it is relayed."""
        if arrived is not None and distance in self.sources:
            self.arrived[distance] = arrived

    def _gather(self, step: RelaySend) -> torch.Tensor:
        """``[2, rows, heads, d]``: the relayed rows for ``step.dst_member``, concatenated in order."""
        k = self.slots.k
        rows = torch.empty((2, step.num_rows, self.slots.heads) + tuple(k.shape[2:]), dtype=k.dtype,
                           device=k.device)
        at = 0
        for distance, part in step.parts:
            n = part.num_rows
            part.gather_into(self.arrived[distance][0], rows[0, at:at + n])
            part.gather_into(self.arrived[distance][1], rows[1, at:at + n])
            at += n
        return rows

    def exchange(self, op: str) -> Iterator[Tuple[int, Optional[RecvStep], Optional[torch.Tensor]]]:
        """FWD(d) for d = 1, 2, ...: post, wait, and yield ``(d, relay receive step, its rows [2, rows, h_kv, d]
        for this call's heads)`` (None, None where this member only sends); the caller's work on one distance
        is done before the next slot is posted."""
        sends = {step.distance: step for step in self.schedule.relay_sends}
        recvs = {step.distance: step for step in self.schedule.relay_recvs}
        k, heads = self.slots.k, self.slots.heads
        for distance in sorted(set(sends) | set(recvs)):
            outgoing, incoming, buffer = [], [], None
            if heads and distance in sends:
                outgoing.append((sends[distance].dst_member, self._gather(sends[distance])))
            recv = recvs.get(distance)
            if heads and recv is not None:
                buffer = torch.empty((2, recv.num_rows, heads) + tuple(k.shape[2:]), dtype=k.dtype, device=k.device)
                incoming.append((recv.src_member, buffer))
                if self.shared is not None:
                    self.shared.keep(-distance, buffer)
            post_slot(self.topology, outgoing, incoming, op, distance).wait()
            del outgoing
            if recv is not None and self.shared is not None:
                buffer = self.shared.assemble(-distance, buffer, recv.num_rows, k)
            yield distance, recv, buffer
            del buffer
        self.arrived.clear()

    def backward(self, dq: torch.Tensor, dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 kernel: AttentionKernel, softmax_scale: float, returns: _Returns) -> None:
        """Forward the rows again and attend them backward (into ``dq``); dFWD(d) right after FWD(d) returns
        their gradients to the relays, which add them to the gradients they hold back (``returns``)."""
        sends = {step.distance: step for step in self.schedule.relay_sends}
        k = self.slots.k
        for distance, recv, forwarded in self.exchange(OP_KV_RELAY_BWD):
            outgoing, incoming, back = [], [], None
            if recv is not None:
                trace_event("kernel", "backward", distance)
                g_q, g_k, g_v = kernel.backward(dout, q, forwarded[0], forwarded[1], out, lse, recv.blocks,
                                                softmax_scale)
                del forwarded
                dq += g_q
                grads = returns.outgoing(-distance, g_k, g_v)
                if grads is not None:
                    outgoing.append((recv.src_member, grads))
                del g_q, g_k, g_v
            send = sends.get(distance)
            if send is not None and returns.heads:
                back = torch.empty((2, send.num_rows, returns.heads) + tuple(k.shape[2:]), dtype=k.dtype,
                                   device=k.device)
                incoming.append((send.dst_member, back))
            post_slot(self.topology, outgoing, incoming, OP_DKV_RELAY, distance).wait()
            if back is not None:
                at = 0
                for source, part in send.parts:
                    returns.add_back(source, part, back[:, at:at + part.num_rows])
                    at += part.num_rows

    def deferred_returns(self, returns: _Returns) -> Iterator[Tuple[int, torch.Tensor]]:
        """The deferred dKV(d), d = 1, 2, ...: send the held gradients back to their owners and yield
        ``(d, [2, rows, heads, d])``, the gradients of this member's rows sent at distance d."""
        sends = {step.distance: step for step in self.schedule.recv_steps if step.deferred}
        recvs = {step.distance: step for step in self.schedule.send_steps if step.deferred}
        k = self.slots.k
        for distance in sorted(set(sends) | set(recvs)):
            outgoing, incoming, returned = [], [], None
            grads = returns.take(distance) if distance in sends else None
            if grads is not None:
                outgoing.append((sends[distance].src_member, grads))
            if distance in recvs and returns.heads:
                returned = torch.empty((2, recvs[distance].rows.num_rows, returns.heads) + tuple(k.shape[2:]),
                                       dtype=k.dtype, device=k.device)
                incoming.append((recvs[distance].dst_member, returned))
            post_slot(self.topology, outgoing, incoming, OP_DKV, distance).wait()
            del outgoing
            if returned is not None:
                yield distance, returned
