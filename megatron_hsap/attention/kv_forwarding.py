"""Node-level K/V forwarding: an exchange policy (``ring_exchange``) that wraps another one.

Where a node holds several ring members, a remote member's rows that several of them need cross the node
boundary once, to the lowest-numbered member needing them (``MemberSchedule.relay_sends`` /
``relay_recvs``, compiled by ``sequence/placement.py``). After the ring distances that member relays them
inside the node, one message per pair and distance, in increasing distance: FWD(d). In the backward the
relayed rows' gradients come back to the relay right after (dFWD(d)), join the gradients of its own use of
those rows, and only then go back across nodes (the deferred dKV(d), in increasing distance), so each
remote row's gradient crosses the node boundary once too. The slot order is in ``attention/ring.py``.

What the messages carry (all heads, or a UPipe stage's new/done heads) is the wrapped policy's: relayed
rows are kept and their gradients held under key minus the relay distance.
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional, Tuple

import torch

from megatron_hsap.attention.ring_exchange import (
    OP_DKV,
    OP_DKV_RELAY,
    OP_KV_RELAY,
    OP_KV_RELAY_BWD,
    Attend,
    AttendBackward,
    KeyValueExchange,
)
from megatron_hsap.collectives import post_slot
from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.sequence.schedule import MemberSchedule, RecvStep, RelaySend, RowRanges


class NodeForwarding(KeyValueExchange):
    """``inner``'s messages, plus the relay phases after the ring and the deferred returns of ``schedule``."""

    def __init__(self, inner: KeyValueExchange, schedule: MemberSchedule, topology: CPTopology) -> None:
        super().__init__(inner.k, inner.v, inner.heads, inner.return_heads)
        self.inner, self.schedule, self.topology = inner, schedule, topology
        self.sources = {d for step in schedule.relay_sends for d, _ in step.parts}
        self.deferred_recv = {step.distance: step for step in schedule.recv_steps if step.deferred}
        self.deferred_send = {step.distance: step for step in schedule.send_steps if step.deferred}
        self.arrived: Dict[int, torch.Tensor] = {}  # distance -> [2, rows, heads, d] that is relayed later

    # --- the wrapped policy's messages ----------------------------------------------------------------------
    def pack(self, rows: RowRanges) -> Optional[torch.Tensor]:
        return self.inner.pack(rows)

    def receive_buffer(self, key: int, num_rows: int) -> Optional[torch.Tensor]:
        return self.inner.receive_buffer(key, num_rows)

    def attended(self, key: int, buffer: Optional[torch.Tensor], num_rows: int) -> Optional[torch.Tensor]:
        """Also keeps what arrived at a ring distance whose rows are relayed later."""
        if buffer is not None and key in self.sources:
            self.arrived[key] = buffer
        return self.inner.attended(key, buffer, num_rows)

    def hold(self, key: int, g_k: torch.Tensor, g_v: torch.Tensor) -> None:
        self.inner.hold(key, g_k, g_v)

    def take(self, key: int) -> Optional[torch.Tensor]:
        return self.inner.take(key)

    def add_back(self, key: int, rows: RowRanges, back: torch.Tensor) -> None:
        self.inner.add_back(key, rows, back)

    def grads_out(self, key: int, g_k: torch.Tensor, g_v: torch.Tensor) -> Optional[torch.Tensor]:
        """Deferred rows: held until their relayed copies' gradients have joined them."""
        if key in self.deferred_recv:
            self.inner.hold(key, g_k, g_v)
            return None
        return self.inner.grads_out(key, g_k, g_v)

    def return_buffer(self, key: int, num_rows: int) -> Optional[torch.Tensor]:
        return None if key in self.deferred_send else self.inner.return_buffer(key, num_rows)

    def add_returned(self, rows: RowRanges, returned: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
        self.inner.add_returned(rows, returned, dk, dv)

    def finish(self) -> None:
        self.arrived.clear()
        self.inner.finish()

    # --- the phases after the ring ----------------------------------------------------------------------------
    def after_ring_forward(self, attend: Attend) -> None:
        """FWD(1), FWD(2), ...: relay and attend."""
        for distance, recv, forwarded in self._relay(OP_KV_RELAY):
            if recv is not None and forwarded is not None:
                attend(forwarded[0], forwarded[1], recv.blocks, distance)
            del forwarded

    def after_ring_backward(self, attend_backward: AttendBackward, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """FWD(1), dFWD(1), FWD(2), dFWD(2), ..., then the deferred dKV(1), dKV(2), ..."""
        sends = {step.distance: step for step in self.schedule.relay_sends}
        for distance, recv, forwarded in self._relay(OP_KV_RELAY_BWD):
            outgoing, incoming, back = [], [], None
            if recv is not None and forwarded is not None:
                g_k, g_v = attend_backward(forwarded[0], forwarded[1], recv.blocks, distance)
                del forwarded
                grads = self.inner.grads_out(-distance, g_k, g_v)
                if grads is not None:
                    outgoing.append((recv.src_member, grads))
                del g_k, g_v
            send = sends.get(distance)
            if send is not None:
                back = self.inner.return_buffer(-distance, send.num_rows)
                if back is not None:
                    incoming.append((send.dst_member, back))
            post_slot(self.topology, outgoing, incoming, OP_DKV_RELAY, distance).wait()
            if back is not None:
                self._add_back(send, back)
        for distance, returned in self._deferred_returns():
            self.inner.add_returned(self.deferred_send[distance].rows, returned, dk, dv)

    def _add_back(self, send: RelaySend, back: torch.Tensor) -> None:
        """The relayed copies' gradients ``back`` join the held gradients of the rows they were taken from."""
        at = 0
        for source, part in send.parts:
            self.inner.add_back(source, part, back[:, at:at + part.num_rows])
            at += part.num_rows

    def _gather(self, step: RelaySend) -> torch.Tensor:
        """The relayed rows for ``step.dst_member``, concatenated in order (a KV message)."""
        rows, at = self.message(self.heads, step.num_rows), 0
        for distance, part in step.parts:
            n = part.num_rows
            part.gather_into(self.arrived[distance][0], rows[0, at:at + n])
            part.gather_into(self.arrived[distance][1], rows[1, at:at + n])
            at += n
        return rows

    def _relay(self, op: str) -> Iterator[Tuple[int, Optional[RecvStep], Optional[torch.Tensor]]]:
        """FWD(d) for d = 1, 2, ...: post, wait, and yield ``(d, relay receive step, its rows [2, rows, h_kv', d]
        for this call's heads)`` (None, None where this member only sends); the caller's work on one distance
        is done before the next slot is posted."""
        sends = {step.distance: step for step in self.schedule.relay_sends}
        recvs = {step.distance: step for step in self.schedule.relay_recvs}
        for distance in sorted(set(sends) | set(recvs)):
            outgoing, incoming, buffer = [], [], None
            if self.heads and distance in sends:
                outgoing.append((sends[distance].dst_member, self._gather(sends[distance])))
            recv = recvs.get(distance)
            if recv is not None:
                buffer = self.inner.receive_buffer(-distance, recv.num_rows)
                if buffer is not None:
                    incoming.append((recv.src_member, buffer))
            post_slot(self.topology, outgoing, incoming, op, distance).wait()
            del outgoing
            if recv is not None:
                buffer = self.inner.attended(-distance, buffer, recv.num_rows)
            yield distance, recv, buffer
            del buffer
        self.arrived.clear()

    def _deferred_returns(self) -> Iterator[Tuple[int, torch.Tensor]]:
        """The deferred dKV(d), d = 1, 2, ...: send the held gradients back to their owners and yield
        ``(d, returned dKV message)``, the gradients of this member's rows sent at distance d."""
        for distance in sorted(set(self.deferred_recv) | set(self.deferred_send)):
            outgoing, incoming, returned = [], [], None
            grads = self.inner.take(distance) if distance in self.deferred_recv else None
            if grads is not None:
                outgoing.append((self.deferred_recv[distance].src_member, grads))
            if distance in self.deferred_send:
                returned = self.inner.return_buffer(distance, self.deferred_send[distance].rows.num_rows)
                if returned is not None:
                    incoming.append((self.deferred_send[distance].dst_member, returned))
            post_slot(self.topology, outgoing, incoming, OP_DKV, distance).wait()
            del outgoing
            if returned is not None:
                yield distance, returned
