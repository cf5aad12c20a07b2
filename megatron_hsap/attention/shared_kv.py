"""Remote K/V rows shared by the ring calls of UPipe's head chunks (an exchange policy, ``ring_exchange``).

UPipe calls the ring once per stage (and per GQA run inside a stage), and a KV head is attended by several
stages; the sharing rule and why both ring peers skip the same slots are in ``attention/ring.py``'s module
docstring. Here: the store kept across the calls (``SharedRemoteKeyValues``) and the policy of one call
(``SharedHeads``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

from megatron_hsap.attention.ring_exchange import KeyValueExchange, accumulation_dtype
from megatron_hsap.sequence.schedule import RowRanges


@dataclass
class SharedRemoteKeyValues:
    """Remote K/V rows of the KV heads a sequence of calls (UPipe stages) attends, kept from a head's first
    call to its last. Before each call the caller sets, identically on every ring peer: ``heads``, the KV
    head of each k/v column of the call (in order, repeats allowed); ``new``, the heads first attended in
    this call; ``done``, the heads last attended in it.

    received: key -> head -> ``[2, rows, d]`` (k, v) received at that key (``ring_exchange``'s keys);
    grads: key -> head -> their gradient summed over the calls so far (fp32; fp64 for fp64).
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


class SharedHeads(KeyValueExchange):
    """The exchange policy of one call that shares remote rows with the other calls of ``shared``: messages
    carry the call's new KV heads (K/V) and its done heads (returned dK/dV)."""

    def __init__(self, shared: SharedRemoteKeyValues, k: torch.Tensor, v: torch.Tensor) -> None:
        self.shared = shared
        self.whole = shared.new == shared.heads  # every column travels, as is
        self.new_columns = shared.columns(shared.new)
        super().__init__(k, v, heads=len(shared.new), return_heads=len(shared.done))

    def pack(self, rows: RowRanges) -> Optional[torch.Tensor]:
        if not self.heads:
            return None
        message = self.message(self.heads, rows.num_rows)
        if self.whole:
            rows.gather_into(self.k, message[0])
            rows.gather_into(self.v, message[1])
        else:
            for i, c in enumerate(self.new_columns):
                rows.gather_into(self.k[:, c], message[0, :, i])
                rows.gather_into(self.v[:, c], message[1, :, i])
        return message

    def receive_buffer(self, key: int, num_rows: int) -> Optional[torch.Tensor]:
        """Also keeps each new head's rows of the buffer for the later calls."""
        buffer = super().receive_buffer(key, num_rows)
        if buffer is not None:
            kept = self.shared.received.setdefault(key, {})
            for i, j in enumerate(self.shared.new):
                kept[j] = buffer[:, :, i]
        return buffer

    def attended(self, key: int, buffer: Optional[torch.Tensor], num_rows: int) -> Optional[torch.Tensor]:
        """The kept rows of this call's heads (``buffer``, what arrived in this call, as is when it holds them all)."""
        shared = self.shared
        if self.whole and buffer is not None:
            return buffer
        kept = shared.received[key]
        if len(shared.heads) == 1 and kept[shared.heads[0]].is_contiguous():
            return kept[shared.heads[0]].unsqueeze(2)  # a kept one-head buffer, attended as is
        rows = torch.empty((2, num_rows, len(shared.heads)) + tuple(self.k.shape[2:]), dtype=self.k.dtype,
                           device=self.k.device)
        for c, j in enumerate(shared.heads):
            rows[:, :, c].copy_(kept[j])
        return rows

    def hold(self, key: int, g_k: torch.Tensor, g_v: torch.Tensor) -> None:
        sums = self.shared.grads.setdefault(key, {})
        for c, j in enumerate(self.shared.heads):
            if j not in sums:
                sums[j] = torch.zeros((2,) + tuple(g_k[:, c].shape), dtype=accumulation_dtype(self.k.dtype),
                                      device=g_k.device)
            sums[j][0] += g_k[:, c]
            sums[j][1] += g_v[:, c]

    def take(self, key: int) -> Optional[torch.Tensor]:
        done = self.shared.done
        if not done:
            return None
        sums = self.shared.grads[key]
        grads = self.message(len(done), sums[done[0]].shape[1])
        for i, j in enumerate(done):
            grads[:, :, i].copy_(sums[j])
        return grads

    def add_back(self, key: int, rows: RowRanges, back: torch.Tensor) -> None:
        for i, j in enumerate(self.shared.done):
            rows.add_into(self.shared.grads[key][j][0], back[0, :, i])
            rows.add_into(self.shared.grads[key][j][1], back[1, :, i])

    def add_returned(self, rows: RowRanges, returned: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Into the first column of each done head (UPipe sums the columns of one head)."""
        for i, c in enumerate(self.shared.columns(self.shared.done)):
            rows.add_into(dk[:, c], returned[0, :, i])
            rows.add_into(dv[:, c], returned[1, :, i])

    def finish(self) -> None:
        self.shared.forget_done()
