"""The two communication patterns of context-parallel attention, with byte accounting.

- Ulysses all-to-all inside a ring member: ``[t_local, h, d]`` on each rank <->
  ``[ulysses_size * t_local, h / ulysses_size, d]`` (the member's tokens, a slice of heads).
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

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_hsap.instrumentation.comm import record_recv, record_send
from megatron_hsap.instrumentation.trace import trace_event
from megatron_hsap.parallel_state import CPTopology


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_to_all_member(send: torch.Tensor, topology: CPTopology, op: str,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """all_to_all over the Ulysses group of a contiguous ``[U, ...]`` tensor: chunk i goes to Ulysses
    rank i, chunk i of the result came from Ulysses rank i. ``out``: an optional preallocated
    contiguous receive buffer of ``send``'s shape and dtype (returned)."""
    if not send.is_contiguous():
        raise ValueError("all_to_all_member needs a contiguous send buffer")
    if out is None:
        out = torch.empty_like(send)
    trace_event("post", op)
    dist.all_to_all_single(out, send, group=topology.ulysses_group)
    me = topology.cp_rank
    chunk_bytes = _nbytes(send) // topology.ulysses_size
    for peer in topology.ring_member_ranks(topology.ring_rank):
        if peer != me:
            intra = topology.same_node(me, peer)
            record_send(op, chunk_bytes, intra)
            record_recv(op, chunk_bytes, intra)
    return out


def sequence_to_heads(x: torch.Tensor, topology: CPTopology, op: str = "ulysses_a2a",
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[t_local, U, h_u, d]`` (this rank's tokens, heads grouped by destination) ->
    ``[U * t_local, h_u, d]`` (the member's tokens in CP-rank order, this rank's head group).
    One copy into the destination-major send buffer, none when ``x`` is the transpose of a
    contiguous ``[U, t_local, h_u, d]``. ``out``: optional contiguous ``[U * t_local, h_u, d]`` receive buffer."""
    t, u, h, d = x.shape
    recv = None if out is None else out.view(u, t, h, d)
    return all_to_all_member(x.transpose(0, 1).contiguous(), topology, op, recv).view(u * t, h, d)


def heads_to_sequence(x: torch.Tensor, topology: CPTopology, op: str = "ulysses_a2a",
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of ``sequence_to_heads``: ``[U * t_local, h_u, d]`` -> ``[t_local, U, h_u, d]`` (a view
    of the all-to-all's output; ``out``: optional contiguous ``[U, t_local, h_u, d]`` receive buffer)."""
    u = topology.ulysses_size
    ut, h, d = x.shape
    return all_to_all_member(x.contiguous().view(u, ut // u, h, d), topology, op, out).transpose(0, 1)


class UlyssesAllToAll(torch.autograd.Function):
    """Differentiable all-to-all: ``to_heads=True`` is ``sequence_to_heads``, False its inverse;
    the gradient of each is the other."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, topology: CPTopology, to_heads: bool) -> torch.Tensor:
        ctx.topology, ctx.to_heads = topology, to_heads
        return (sequence_to_heads if to_heads else heads_to_sequence)(x, topology)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inverse = heads_to_sequence if ctx.to_heads else sequence_to_heads
        return inverse(grad, ctx.topology, "ulysses_a2a_bwd"), None, None


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
