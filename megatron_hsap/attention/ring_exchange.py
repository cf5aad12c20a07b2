"""The ring's exchange-policy interface, and the plain policy.

The ring core (``attention/ring.py``) walks the message order its module docstring fixes and knows
nothing else. What a message carries, what is done with what arrives, and what runs after the ring
distances is asked of one ``KeyValueExchange``:

- ``AllHeads`` (this module): every K/V head of the call travels, received rows are attended as they
  are, gradients go straight back. The plain ring.
- ``SharedHeads`` (``attention/shared_kv.py``): UPipe's head chunks. Only the KV heads a stage attends
  first travel, received rows are kept for the later stages, gradients are summed over the stages and
  go back in the stage of last use.
- ``NodeForwarding`` (``attention/kv_forwarding.py``): wraps one of the two; rows several members of
  a node need cross the node boundary once and are relayed inside the node after the ring distances.

Keys name a set of received rows: the ring distance it arrived at, or minus the relay distance for
relayed rows. Messages are ``[2, rows, heads, d]`` (k then v, or dk then dv) in k's dtype.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from megatron_hsap.kernels.base import AttentionBlocks
from megatron_hsap.sequence.schedule import RowRanges

#: Operation names in ``instrumentation.comm`` of the ring's messages.
OP_KV, OP_KV_BWD, OP_DKV = "ring_kv", "ring_kv_bwd", "ring_dkv"
#: Node-level K/V forwarding inside a node (``NodeForwarding``).
OP_KV_RELAY, OP_KV_RELAY_BWD, OP_DKV_RELAY = "ring_kv_relay", "ring_kv_relay_bwd", "ring_dkv_relay"

#: ``attend(k, v, blocks, distance)``: fold one kernel call over received rows ``[rows, h_kv, d]`` into the result.
Attend = Callable[[torch.Tensor, torch.Tensor, AttentionBlocks, int], None]
#: ``attend_backward(k, v, blocks, distance) -> (dk, dv)``: one backward kernel call over received rows; dq is
#: accumulated by the caller, the gradients of the received rows ``[rows, h_kv, d]`` are returned.
AttendBackward = Callable[[torch.Tensor, torch.Tensor, AttentionBlocks, int], "tuple[torch.Tensor, torch.Tensor]"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for every input dtype but fp64 (which stays fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class KeyValueExchange:
    """What the ring's messages carry and what happens to what arrives; one object per ring call.

    k ``[t_m, h_kv', d]``: this rank's keys of the call (their shape, dtype and device shape every message).
    ``heads``: K/V heads each KV message carries; ``return_heads``: heads each dKV message carries
    (0 = the slot posts nothing of that kind, on both sides alike).
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, heads: int, return_heads: int) -> None:
        self.k, self.v, self.heads, self.return_heads = k, v, heads, return_heads

    def message(self, heads: int, num_rows: int) -> torch.Tensor:
        """An empty ``[2, num_rows, heads, d]`` message in k's dtype and device."""
        return torch.empty((2, num_rows, heads) + tuple(self.k.shape[2:]), dtype=self.k.dtype, device=self.k.device)

    # --- forward and backward: K/V --------------------------------------------------------------------------
    def pack(self, rows: RowRanges) -> Optional[torch.Tensor]:
        """The KV message of this rank's ``rows`` (None: nothing travels)."""
        raise NotImplementedError

    def receive_buffer(self, key: int, num_rows: int) -> Optional[torch.Tensor]:
        """The buffer ``num_rows`` received rows arrive in (None: nothing travels)."""
        return self.message(self.heads, num_rows) if self.heads else None

    def attended(self, key: int, buffer: Optional[torch.Tensor], num_rows: int) -> Optional[torch.Tensor]:
        """``[2, rows, h_kv', d]``: the received rows of ``key`` for this call's heads, after their slot's wait."""
        raise NotImplementedError

    # --- backward: dK/dV --------------------------------------------------------------------------------------
    def hold(self, key: int, g_k: torch.Tensor, g_v: torch.Tensor) -> None:
        """Sum gradients ``[rows, h_kv', d]`` of the rows received at ``key`` (fp32; fp64 for fp64) until ``take``."""
        raise NotImplementedError

    def take(self, key: int) -> Optional[torch.Tensor]:
        """The dKV message of the held gradients of ``key`` that go back now (None: none this call)."""
        raise NotImplementedError

    def add_back(self, key: int, rows: RowRanges, back: torch.Tensor) -> None:
        """Add ``back`` ``[2, n, return_heads, d]`` to the held gradients of ``rows`` of the rows of ``key``."""
        raise NotImplementedError

    def grads_out(self, key: int, g_k: torch.Tensor, g_v: torch.Tensor) -> Optional[torch.Tensor]:
        """The dKV message for the gradients ``[rows, h_kv', d]`` of the rows of ``key`` (None: none now)."""
        self.hold(key, g_k, g_v)
        return self.take(key)

    def return_buffer(self, key: int, num_rows: int) -> Optional[torch.Tensor]:
        """The buffer the gradients of this rank's ``num_rows`` rows sent at ``key`` come back in, or None."""
        return self.message(self.return_heads, num_rows) if self.return_heads else None

    def add_returned(self, rows: RowRanges, returned: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Add a returned dKV message to the accumulators dk/dv ``[t_m, h_kv', d]`` at ``rows``."""
        raise NotImplementedError

    # --- after the ring distances ---------------------------------------------------------------------------
    def after_ring_forward(self, attend: Attend) -> None:
        """Phases that follow the ring distances in the forward (none here)."""

    def after_ring_backward(self, attend_backward: AttendBackward, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Phases that follow the ring distances and their returns in the backward (none here)."""

    def finish(self) -> None:
        """The call is over (forward or backward)."""


class AllHeads(KeyValueExchange):
    """The plain ring: every head of the call travels and received rows are attended as they are. A
    gradient goes back in the slot after its kernel call, rounded once into the message (no fp32 copy);
    ``hold``/``take`` (used by node-level forwarding) sum in fp32 first."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        super().__init__(k, v, heads=k.shape[1], return_heads=k.shape[1])
        self.held: Dict[int, torch.Tensor] = {}  # key -> [2, rows, h_kv', d] in the accumulation dtype

    def pack(self, rows: RowRanges) -> Optional[torch.Tensor]:
        if not self.heads:
            return None
        message = self.message(self.heads, rows.num_rows)
        rows.gather_into(self.k, message[0])
        rows.gather_into(self.v, message[1])
        return message

    def attended(self, key: int, buffer: Optional[torch.Tensor], num_rows: int) -> Optional[torch.Tensor]:
        return buffer

    def hold(self, key: int, g_k: torch.Tensor, g_v: torch.Tensor) -> None:
        if key not in self.held:
            self.held[key] = torch.zeros((2,) + tuple(g_k.shape), dtype=accumulation_dtype(self.k.dtype),
                                         device=g_k.device)
        self.held[key][0] += g_k
        self.held[key][1] += g_v

    def take(self, key: int) -> Optional[torch.Tensor]:
        return self.held.pop(key).to(self.k.dtype)

    def add_back(self, key: int, rows: RowRanges, back: torch.Tensor) -> None:
        rows.add_into(self.held[key][0], back[0])
        rows.add_into(self.held[key][1], back[1])

    def grads_out(self, key: int, g_k: torch.Tensor, g_v: torch.Tensor) -> Optional[torch.Tensor]:
        grads = self.message(g_k.shape[1], g_k.shape[0])
        grads[0].copy_(g_k)
        grads[1].copy_(g_v)
        return grads

    def add_returned(self, rows: RowRanges, returned: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
        rows.add_into(dk, returned[0])
        rows.add_into(dv, returned[1])
