"""Compile a placement into what each ring member computes and exchanges.

After the Ulysses all-to-all, ring member ``m`` (one Ulysses group) holds the tokens
of its ``ulysses_size`` ranks concatenated in CP-rank order: its *member buffer*.
For every ordered pair of members the schedule lists the attention blocks between
the queries of one and the keys of the other (document-causal or document-full,
bottom-right aligned, see ``AttentionBlocks``) and the key/value rows that must
move. Exchanges run in ring order: at distance ``s`` member ``m`` receives from
``m - s`` and sends to ``m + s`` (mod ring size), and an exchange with nothing
needed is skipped on both sides, because both sides derive it from the same plan.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from megatron_hsap.device_cache import DeviceTensorCache
from megatron_hsap.kernels.base import AttentionBlocks
from megatron_hsap.sequence.layouts import Segment

Block = Tuple[int, int, int, int, bool]
Piece = Tuple[int, int, int]  # (buffer_start, doc_start, doc_end) inside one member buffer


@dataclass(frozen=True)
class RowRanges:
    """Rows ``[start, end)`` of a buffer, gathered in order into one message.

    A single range is a slice (no index tensor, no extra copy); several ranges use one
    int64 index tensor per device, built once and kept in a byte-bounded LRU cache.
    """

    ranges: Tuple[Tuple[int, int], ...]

    @property
    def num_rows(self) -> int:
        return sum(e - s for s, e in self.ranges)

    def _index(self, device: torch.device) -> torch.Tensor:
        def build() -> torch.Tensor:
            index = torch.cat([torch.arange(s, e, dtype=torch.int64) for s, e in self.ranges])
            return index.to(device, non_blocking=True) if device.type != "cpu" else index
        return _ROW_INDEX_CACHE.get((self.ranges, device), build)

    def gather_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out[:] = x[rows]`` along dim 0 (one copy; ``out`` may be a strided view); returns ``out``."""
        if len(self.ranges) == 1:
            s, e = self.ranges[0]
            return out.copy_(x[s:e])
        return torch.index_select(x, 0, self._index(x.device), out=out)

    def add_into(self, out: torch.Tensor, rows: torch.Tensor) -> None:
        """``out[rows] += rows`` along dim 0: gradients coming back to their owner, in ``out``'s dtype."""
        if len(self.ranges) == 1:
            s, e = self.ranges[0]
            out[s:e] += rows
        else:
            out.index_add_(0, self._index(out.device), rows.to(out.dtype))


#: Row indices of multi-range sends, per device (see ``device_cache``).
_ROW_INDEX_CACHE = DeviceTensorCache()


@dataclass(frozen=True)
class RecvStep:
    distance: int
    src_member: int
    num_rows: int            # rows of the receive buffer (key/value tokens)
    blocks: AttentionBlocks  # queries of this member vs the receive buffer


@dataclass(frozen=True)
class SendStep:
    distance: int
    dst_member: int
    rows: RowRanges          # rows of this member's buffer that dst needs


@dataclass(frozen=True)
class MemberSchedule:
    """Everything one ring member does in one attention call (forward and backward)."""

    local_blocks: AttentionBlocks
    recv_steps: Tuple[RecvStep, ...]
    send_steps: Tuple[SendStep, ...]

    def steps(self) -> List[Tuple[int, "RecvStep | None", "SendStep | None"]]:
        """(distance, recv, send) for every distance where this member has something to do."""
        recv = {r.distance: r for r in self.recv_steps}
        send = {s.distance: s for s in self.send_steps}
        return [(d, recv.get(d), send.get(d)) for d in sorted(set(recv) | set(send))]

    @property
    def area(self) -> int:
        return self.local_blocks.area() + sum(r.blocks.area() for r in self.recv_steps)


def member_pieces(rank_segments: Sequence[Sequence[Segment]], tokens_per_rank: int,
                  ulysses_size: int) -> List[Dict[int, List[Piece]]]:
    """Per member: doc -> pieces (buffer_start, doc_start, doc_end), adjacent pieces merged."""
    ring_size = len(rank_segments) // ulysses_size
    result: List[Dict[int, List[Piece]]] = []
    for member in range(ring_size):
        docs: Dict[int, List[Piece]] = defaultdict(list)
        for u in range(ulysses_size):
            offset = u * tokens_per_rank
            for doc, start, end in rank_segments[member * ulysses_size + u]:
                pieces = docs[doc]
                if pieces and pieces[-1][0] + pieces[-1][2] - pieces[-1][1] == offset and pieces[-1][2] == start:
                    b, s, _ = pieces[-1]
                    pieces[-1] = (b, s, end)
                else:
                    pieces.append((offset, start, end))
                offset += end - start
        result.append(dict(docs))
    return result


def _pair_blocks(q: Piece, k: Piece, causal: bool) -> List[Block]:
    """Blocks letting query piece ``q`` attend to key piece ``k`` of the same document."""
    qb, q0, q1 = q
    kb, k0, k1 = k
    if not causal:
        return [(qb, qb + q1 - q0, kb, kb + k1 - k0, False)]
    kend = min(k1, q1)
    if kend <= k0:
        return []
    if kend <= q0:  # every key precedes every query
        return [(qb, qb + q1 - q0, kb, kb + kend - k0, False)]
    first = max(q0, k0)  # queries before k0 see none of these keys
    blocks = [(qb + first - q0, qb + kend - q0, kb, kb + kend - k0, True)]
    if kend < q1:  # queries after the last key see all of them
        blocks.append((qb + kend - q0, qb + q1 - q0, kb, kb + kend - k0, False))
    return blocks


def _merge(ranges: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    merged: List[Tuple[int, int]] = []
    for s, e in sorted(ranges):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _pair_schedule(q_docs: Dict[int, List[Piece]], k_docs: Dict[int, List[Piece]],
                   causal: bool) -> List[Block]:
    blocks: List[Block] = []
    for doc, q_pieces in q_docs.items():
        k_pieces = k_docs.get(doc)
        if not k_pieces:
            continue
        for q in q_pieces:
            for k in k_pieces:
                blocks.extend(_pair_blocks(q, k, causal))
    return blocks


def _remote(blocks: List[Block]) -> Tuple[RowRanges, AttentionBlocks]:
    """Rows of the key owner's buffer to send, and the blocks re-indexed into the receive buffer."""
    ranges = _merge([(b[2], b[3]) for b in blocks])
    starts = [s for s, _ in ranges]
    offsets, acc = [], 0
    for s, e in ranges:
        offsets.append(acc)
        acc += e - s
    remapped = []
    for qs, qe, ks, ke, c in blocks:
        i = bisect.bisect_right(starts, ks) - 1
        shift = offsets[i] - ranges[i][0]
        remapped.append((qs, qe, ks + shift, ke + shift, c))
    return RowRanges(tuple(ranges)), AttentionBlocks.from_list(remapped)


def build_member_schedule(pieces: Sequence[Dict[int, List[Piece]]], member: int, causal: bool) -> MemberSchedule:
    """The schedule of one member: local blocks, what it receives and what it sends, per ring distance."""
    ring_size = len(pieces)
    local = AttentionBlocks.from_list(_pair_schedule(pieces[member], pieces[member], causal))
    recv_steps, send_steps = [], []
    for distance in range(1, ring_size):
        src = (member - distance) % ring_size
        blocks = _pair_schedule(pieces[member], pieces[src], causal)
        if blocks:
            rows, remapped = _remote(blocks)
            recv_steps.append(RecvStep(distance, src, rows.num_rows, remapped))
        dst = (member + distance) % ring_size
        blocks = _pair_schedule(pieces[dst], pieces[member], causal)
        if blocks:
            rows, _ = _remote(blocks)
            send_steps.append(SendStep(distance, dst, rows))
    return MemberSchedule(local, tuple(recv_steps), tuple(send_steps))
