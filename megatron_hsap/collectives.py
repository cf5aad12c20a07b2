"""The two communication patterns of context-parallel attention, with byte accounting.

- Ulysses all-to-all inside a ring member: ``[t_local, h, d]`` on each rank <->
  ``[ulysses_size * t_local, h_r, d]`` (the member's tokens, rank r's slice of heads; the slices
  may differ in size by one head, see ``megatron_hsap.head_split``).
- Ring exchanges between members: one *slot* of point-to-point messages (sends to some
  members, receives from others) posted as one ``batch_isend_irecv``, asynchronously so the
  caller overlaps compute.

Point-to-point messages never carry tags: NCCL ignores them and matches the messages
between two ranks in posting order, so correctness must (and does) come from every rank
posting its slots in one global order (see ``attention/ring.py``). The test harness forces
every tag to 0 on gloo so that CPU tests match messages the way NCCL does.
Every byte that leaves a rank is recorded in ``instrumentation.comm``, split by
whether the peer is on the same node, and every post/wait in ``instrumentation.trace``.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_hsap.instrumentation.comm import record_recv, record_send
from megatron_hsap.instrumentation.trace import trace_event
from megatron_hsap.parallel_state import CPTopology


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_to_all_member(send: torch.Tensor, topology: CPTopology, op: str, out: Optional[torch.Tensor] = None,
                      send_rows: Optional[Sequence[int]] = None,
                      recv_rows: Optional[Sequence[int]] = None) -> torch.Tensor:
    """all_to_all over the Ulysses group, split along dim 0: ``send_rows[i]`` rows go to Ulysses rank i and
    ``recv_rows[i]`` rows of the result came from it (None = ``U`` equal chunks; uneven splits use
    ``all_to_all_single``'s split sizes, which NCCL and gloo both support). ``out``: an optional
    preallocated contiguous receive buffer (returned)."""
    if not send.is_contiguous():
        raise ValueError("all_to_all_member needs a contiguous send buffer")
    u = topology.ulysses_size
    if out is None:
        rows = send.shape[0] if recv_rows is None else sum(recv_rows)
        out = send.new_empty((rows,) + tuple(send.shape[1:]))
    trace_event("post", op)
    dist.all_to_all_single(out, send, output_split_sizes=None if recv_rows is None else list(recv_rows),
                           input_split_sizes=None if send_rows is None else list(send_rows),
                           group=topology.ulysses_group)
    me = topology.cp_rank
    row_bytes = math.prod(send.shape[1:]) * send.element_size()
    for i, peer in enumerate(topology.ring_member_ranks(topology.ring_rank)):
        if peer != me:
            intra = topology.same_node(me, peer)
            record_send(op, (send.shape[0] // u if send_rows is None else send_rows[i]) * row_bytes, intra)
            record_recv(op, (out.shape[0] // u if recv_rows is None else recv_rows[i]) * row_bytes, intra)
    return out


def sequence_to_heads(x: torch.Tensor, topology: CPTopology, counts: Sequence[int], op: str = "ulysses_a2a"
                      ) -> torch.Tensor:
    """``[t_local, H, d]`` (this rank's tokens, all heads) -> ``[U * t_local, counts[me], d]`` (the member's tokens
    in CP-rank order, this rank's heads). Ulysses rank i takes the next ``counts[i]`` heads (``HeadSplit``'s
    contiguous ranges). One copy into the destination-major send buffer."""
    t, _, d = x.shape
    send = x.new_empty(t * d * sum(counts))
    offset = at = 0
    for c in counts:
        send[at:at + t * c * d].view(t, c, d).copy_(x[:, offset:offset + c])
        offset, at = offset + c, at + t * c * d
    mine = counts[topology.ulysses_rank]
    recv = all_to_all_member(send, topology, op, send_rows=[t * c * d for c in counts],
                             recv_rows=[t * mine * d] * len(counts))
    return recv.view(len(counts) * t, mine, d)


def heads_to_sequence(x: torch.Tensor, topology: CPTopology, counts: Sequence[int], op: str = "ulysses_a2a"
                      ) -> torch.Tensor:
    """Inverse of ``sequence_to_heads``: ``[U * t_local, counts[me], d]`` -> ``[t_local, sum(counts), d]``."""
    ut, h, d = x.shape
    t = ut // len(counts)
    recv = all_to_all_member(x.contiguous().view(-1), topology, op, send_rows=[t * h * d] * len(counts),
                             recv_rows=[t * c * d for c in counts])
    out = x.new_empty(t, sum(counts), d)
    offset = at = 0
    for c in counts:
        out[:, offset:offset + c].copy_(recv[at:at + t * c * d].view(t, c, d))
        offset, at = offset + c, at + t * c * d
    return out


class PendingSlot:
    """The outstanding messages of one posted slot; ``wait()`` completes them (on GPU it orders the
    current stream after NCCL's, it does not block the host)."""

    def __init__(self, works: List, op: str, label: object) -> None:
        self._works, self.op, self.label = works, op, label

    def wait(self) -> None:
        if self._works:
            trace_event("wait", self.op, self.label)
        for work in self._works:
            work.wait()
        self._works = []


def post_slot(topology: CPTopology, sends: Sequence[Tuple[int, torch.Tensor]],
              recvs: Sequence[Tuple[int, torch.Tensor]], op: str, label: object = None) -> PendingSlot:
    """Post one slot: each ``(member, tensor)`` of ``sends`` goes to ring member ``member``, each buffer of
    ``recvs`` is filled from its member (peers are the ranks of the same Ulysses position).

    Messages to one peer are matched in the order they appear here, on both sides; tensors must be
    contiguous. An empty slot posts nothing (both sides derive emptiness from the same plan)."""
    u, me = topology.ulysses_rank, topology.cp_rank
    ops = []
    for member, tensor in sends:
        peer = member * topology.ulysses_size + u
        ops.append(dist.P2POp(dist.isend, tensor, topology.cp_global_ranks[peer], group=topology.ring_group))
        record_send(op, _nbytes(tensor), topology.same_node(me, peer))
    for member, tensor in recvs:
        peer = member * topology.ulysses_size + u
        ops.append(dist.P2POp(dist.irecv, tensor, topology.cp_global_ranks[peer], group=topology.ring_group))
        record_recv(op, _nbytes(tensor), topology.same_node(me, peer))
    if ops:
        trace_event("post", op, label)
    return PendingSlot(dist.batch_isend_irecv(ops) if ops else [], op, label)
