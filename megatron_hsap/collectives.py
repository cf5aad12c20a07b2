"""The two communication patterns of context-parallel attention, with byte accounting.

- Ulysses all-to-all inside a ring member: ``[t_local, h, d]`` on each rank <->
  ``[ulysses_size * t_local, h / ulysses_size, d]`` (the member's tokens, a slice of heads).
- Ring exchanges between members: at one distance, send rows to one peer and
  receive rows from another, asynchronously so the caller overlaps compute.
Every byte that leaves a rank is recorded in ``instrumentation.comm``, split by
whether the peer is on the same node.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_hsap.instrumentation.comm import record_recv, record_send
from megatron_hsap.parallel_state import CPTopology


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _all_to_all(x: torch.Tensor, topology: CPTopology, op: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """all_to_all over the Ulysses group of a ``[U, ...]`` tensor: chunk i goes to Ulysses rank i.
    ``out``: optional preallocated contiguous receive buffer of x's shape and dtype (else a new one)."""
    x = x.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # empty_like would keep x's strides
    dist.all_to_all_single(out, x, group=topology.ulysses_group)
    me = topology.cp_rank
    chunk_bytes = _nbytes(x) // topology.ulysses_size
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
    ``out``: optional contiguous ``[U * t_local, h_u, d]`` buffer to receive into (returned).
    No send copy is made when ``x`` is the transpose of a contiguous ``[U, t_local, h_u, d]``."""
    t, u, h, d = x.shape
    recv = None if out is None else out.view(u, t, h, d)
    return _all_to_all(x.transpose(0, 1), topology, op, recv).reshape(u * t, h, d)


def heads_to_sequence(x: torch.Tensor, topology: CPTopology, op: str = "ulysses_a2a",
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of ``sequence_to_heads``: ``[U * t_local, h_u, d]`` -> ``[t_local, U, h_u, d]``.
    ``out``: optional contiguous ``[U, t_local, h_u, d]`` buffer to receive into; the result is
    its transpose view."""
    u = topology.ulysses_size
    ut, h, d = x.shape
    return _all_to_all(x.reshape(u, ut // u, h, d), topology, op, out).transpose(0, 1)


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


class PendingExchange:
    """Outstanding point-to-point operations of one ring distance; ``wait()`` returns the received rows."""

    def __init__(self, works: List, received: Optional[torch.Tensor]) -> None:
        self._works = works
        self._received = received

    def wait(self) -> Optional[torch.Tensor]:
        for work in self._works:
            work.wait()
        self._works = []
        return self._received


def start_exchange(topology: CPTopology, send: Optional[torch.Tensor], dst_member: Optional[int],
                   recv_shape: Optional[Tuple[int, ...]], src_member: Optional[int], dtype: torch.dtype,
                   device: torch.device, op: str, tag: int = 0) -> PendingExchange:
    """Post an async send of ``send`` to ring member ``dst_member`` and a receive of ``recv_shape``
    from ``src_member`` (each side optional: nothing needed means no message at all).
    ``tag`` keeps messages between the same pair of ranks apart on backends that match by tag."""
    u = topology.ulysses_rank
    me = topology.cp_rank
    ops = []
    received = None
    if send is not None:
        peer = dst_member * topology.ulysses_size + u
        send = send.contiguous()
        ops.append(dist.P2POp(dist.isend, send, topology.cp_global_ranks[peer], group=topology.ring_group, tag=tag))
        record_send(op, _nbytes(send), topology.same_node(me, peer))
    if recv_shape is not None:
        peer = src_member * topology.ulysses_size + u
        received = torch.empty(recv_shape, dtype=dtype, device=device)
        ops.append(dist.P2POp(dist.irecv, received, topology.cp_global_ranks[peer], group=topology.ring_group, tag=tag))
        record_recv(op, _nbytes(received), topology.same_node(me, peer))
    works = dist.batch_isend_irecv(ops) if ops else []
    return PendingExchange(works, received)
