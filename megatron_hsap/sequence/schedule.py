"""Compile a placement into what each ring member computes and exchanges.

After the Ulysses all-to-all, ring member ``m`` (one Ulysses group) holds the tokens
of its ``ulysses_size`` ranks concatenated in CP-rank order: its *member buffer*.
For every ordered pair of members the schedule lists the attention blocks between
the queries of one and the keys of the other (document-causal or document-full,
bottom-right aligned, see ``AttentionBlocks``) and the key/value rows that must
move. Exchanges run in ring order: at distance ``s`` member ``m`` receives from
``m - s`` and sends to ``m + s`` (mod ring size), and an exchange with nothing
needed is skipped on both sides, because both sides derive it from the same plan.

Sliding windows (``window_size``, flash-attn's convention) live here too: a windowed
schedule keeps only the (query piece, key piece) pairs the band reaches, each trimmed to
the rows and keys it touches and labelled with its band (``AttentionBlocks.windows``), so
the key/value rows a member sends shrink to those inside the window.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_hsap.device_cache import cached_device_index
from megatron_hsap.kernels.base import UNBOUNDED, AttentionBlocks
from megatron_hsap.sequence.layouts import Segment

Piece = Tuple[int, int, int]  # (buffer_start, doc_start, doc_end) inside one member buffer
#: A normalised sliding window ``(left, right)`` (see ``normalize_window``); None = unlimited.
Window = Optional[Tuple[int, int]]
_ALLOWED_WINDOWS = ("None, (-1, -1), or (left, right) with left and right ints >= 0 or -1 (unlimited); "
                    "with causal=True right must be 0 or -1")
#: Stands for an unbounded side in the vectorised block arithmetic (far beyond any token count).
_FAR = 1 << 40


def normalize_window(window_size: object, causal: bool) -> Window:
    """Validate ``window_size`` (flash-attn's convention: a query at in-document position i sees keys in
    ``[i - left, i + right]`` of its document, -1 = unlimited) and return its canonical form: None when it
    restricts nothing, else ``(left, right)`` with right = 0 under ``causal``. ValueError names the argument."""
    if window_size is None:
        return None
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= -1 for x in window_size)):
        raise ValueError(f"window_size={window_size!r} is not supported; allowed values: {_ALLOWED_WINDOWS}")
    left, right = window_size
    if causal:
        if right not in (0, -1):
            raise ValueError(f"window_size={tuple(window_size)!r} has right={right} with causal=True; allowed values: "
                             f"{_ALLOWED_WINDOWS}")
        right = 0
    if left == -1 and right == (0 if causal else -1):
        return None
    return left, right


def document_bounds(causal: bool, window: Window) -> Tuple[Optional[int], Optional[int]]:
    """Bounds ``(lo, hi)`` on ``key position - query position`` inside a document (None = unbounded)."""
    left, right = window if window is not None else UNBOUNDED
    hi = right if right >= 0 else None
    if causal:
        hi = 0 if hi is None else min(hi, 0)
    return (-left if left >= 0 else None), hi


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
        return cached_device_index(("ring rows", self.ranges), device,
                                   lambda: torch.cat([torch.arange(s, e, dtype=torch.int64) for s, e in self.ranges]))

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


@dataclass(frozen=True)
class RecvStep:
    distance: int
    src_member: int
    num_rows: int            # rows of the receive buffer (key/value tokens)
    blocks: AttentionBlocks  # queries of this member vs the receive buffer
    #: The rows' gradients go back after the node-level forwarding (their relayed copies' gradients join them).
    deferred: bool = False


@dataclass(frozen=True)
class SendStep:
    distance: int
    dst_member: int
    rows: RowRanges          # rows of this member's buffer that dst needs
    deferred: bool = False   # the gradients of these rows come back after the forwarding (see RecvStep)


@dataclass(frozen=True)
class RelaySend:
    """Node-level K/V forwarding: rows this member received from other nodes, passed on to ``dst_member``
    (a ring member of the same node) as one message: ``parts`` = (ring distance at which the rows were
    received, their rows in that receive buffer), concatenated in order."""

    distance: int
    dst_member: int
    parts: Tuple[Tuple[int, RowRanges], ...]

    @property
    def num_rows(self) -> int:
        return sum(rows.num_rows for _, rows in self.parts)


@dataclass(frozen=True)
class MemberSchedule:
    """Everything one ring member does in one attention call (forward and backward).

    With node-level K/V forwarding, ``relay_sends`` / ``relay_recvs`` (``RecvStep``s whose ``src_member`` is
    the relaying member of this node) run after the ring distances, in increasing distance."""

    local_blocks: AttentionBlocks
    recv_steps: Tuple[RecvStep, ...]
    send_steps: Tuple[SendStep, ...]
    relay_sends: Tuple[RelaySend, ...] = ()
    relay_recvs: Tuple[RecvStep, ...] = ()

    @property
    def forwarding(self) -> bool:
        """Whether this member takes part in node-level forwarding (then some returns are deferred)."""
        return bool(self.relay_sends or self.relay_recvs) or any(
            step.deferred for step in self.recv_steps + self.send_steps)

    def steps(self) -> List[Tuple[int, "RecvStep | None", "SendStep | None"]]:
        """(distance, recv, send) for every distance where this member has something to do."""
        recv = {r.distance: r for r in self.recv_steps}
        send = {s.distance: s for s in self.send_steps}
        return [(d, recv.get(d), send.get(d)) for d in sorted(set(recv) | set(send))]

    @property
    def area(self) -> int:
        return self.local_blocks.area() + sum(r.blocks.area() for r in self.recv_steps + self.relay_recvs)


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


def piece_tables(pieces: Sequence[Dict[int, List[Piece]]]) -> List[np.ndarray]:
    """Per member: int64 ``[n, 4]`` rows (doc, buffer_start, doc_start, doc_end), sorted by document then
    position: the form the schedule compiler joins on, vectorised."""
    tables = []
    for docs in pieces:
        table = np.array([(doc, b, s, e) for doc, doc_pieces in docs.items() for b, s, e in doc_pieces],
                         dtype=np.int64).reshape(-1, 4)
        tables.append(table[np.lexsort((table[:, 2], table[:, 0]))])
    return tables


def _pair_blocks(q: np.ndarray, k: np.ndarray, causal: bool) -> np.ndarray:
    """Blocks ``[m, 5]`` (q_start, q_end, k_start, k_end, causal) letting every query piece of ``q`` attend
    the key pieces of ``k`` of the same document (piece tables as in ``piece_tables``)."""
    lo = np.searchsorted(k[:, 0], q[:, 0], side="left")
    counts = np.searchsorted(k[:, 0], q[:, 0], side="right") - lo
    total = int(counts.sum())
    if total == 0:
        return np.zeros((0, 5), dtype=np.int64)
    qi = np.repeat(np.arange(len(q)), counts)
    ki = np.repeat(lo - (np.cumsum(counts) - counts), counts) + np.arange(total)
    qb, q0, q1 = q[qi, 1], q[qi, 2], q[qi, 3]
    kb, k0, k1 = k[ki, 1], k[ki, 2], k[ki, 3]
    if not causal:
        return np.stack([qb, qb + q1 - q0, kb, kb + k1 - k0, np.zeros_like(qb)], axis=1)
    kend = np.minimum(k1, q1)
    first = np.maximum(q0, k0)  # queries before k0 see none of these keys
    before = kend <= q0         # every key precedes every query: one full block
    diagonal = np.stack([qb + first - q0, qb + kend - q0, kb, kb + kend - k0, np.ones_like(qb)], axis=1)
    # rows from kend on (all of them when every key precedes every query) see every key up to kend
    tail_start = np.where(before, qb, qb + kend - q0)
    tail = np.stack([tail_start, qb + q1 - q0, kb, kb + kend - k0, np.zeros_like(qb)], axis=1)
    blocks = np.concatenate([diagonal[~before], tail])
    return blocks[(blocks[:, 1] > blocks[:, 0]) & (blocks[:, 3] > blocks[:, 2])]


def _windowed_pair_blocks(q: np.ndarray, k: np.ndarray, lo: Optional[int], hi: Optional[int]) -> np.ndarray:
    """Blocks ``[m, 7]`` (q_start, q_end, k_start, k_end, causal, left, right) of a windowed mask: every
    query piece of ``q`` against the key pieces of ``k`` of its document, keeping the pairs where some key
    position minus query position lies in ``[lo, hi]`` (None = unbounded), each trimmed to the rows that
    see a key and the keys some row sees, with its band in the blocks' bottom-right convention."""
    lo_, hi_ = (-_FAR if lo is None else lo), (_FAR if hi is None else hi)
    first = np.searchsorted(k[:, 0], q[:, 0], side="left")
    counts = np.searchsorted(k[:, 0], q[:, 0], side="right") - first
    total = int(counts.sum())
    qi = np.repeat(np.arange(len(q)), counts)
    ki = np.repeat(first - (np.cumsum(counts) - counts), counts) + np.arange(total)
    qb, q0, q1 = q[qi, 1], q[qi, 2], q[qi, 3]
    kb, k0, k1 = k[ki, 1], k[ki, 2], k[ki, 3]
    r0, r1 = np.maximum(q0, k0 - hi_), np.minimum(q1, k1 - lo_)  # rows that see a key of the piece
    c0, c1 = np.maximum(k0, q0 + lo_), np.minimum(k1, q1 + hi_)  # keys some row sees
    keep = (r1 > r0) & (c1 > c0)
    qb, q0, kb, k0, r0, r1, c0, c1 = (x[keep] for x in (qb, q0, kb, k0, r0, r1, c0, c1))
    corner = c1 - r1  # key - query on the trimmed block's bottom-right diagonal, inside [lo, hi]
    left, right = corner - lo_, hi_ - corner
    left = np.where((lo is None) | (left >= c1 - c0 - 1), -1, left)  # a bound that cuts nothing is dropped
    right = np.where((hi is None) | (right >= r1 - r0 - 1), -1, right)
    causal = right == 0
    right = np.where(causal, -1, right)
    return np.stack([qb + r0 - q0, qb + r1 - q0, kb + c0 - k0, kb + c1 - k0, causal.astype(np.int64), left, right],
                    axis=1)


def _pair_blocks_for(q: np.ndarray, k: np.ndarray, causal: bool, window: Window) -> np.ndarray:
    """``_pair_blocks`` without a window, ``_windowed_pair_blocks`` with one (columns 0-4 alike)."""
    if window is None:
        return _merge_adjacent_keys(_pair_blocks(q, k, causal))
    return _windowed_pair_blocks(q, k, *document_bounds(causal, window))


def _merge_adjacent_keys(blocks: np.ndarray) -> np.ndarray:
    """Join a full block with the next block of the same query rows whose keys start where its keys end
    (a zigzag chunk sees both chunks of an earlier rank, or the full part of its own causal diagonal):
    the same mask in fewer kernel calls and LSE merges. The joined block keeps the second's causal flag,
    whose bottom-right alignment is unchanged (same key end, same query rows)."""
    if len(blocks) < 2:
        return blocks
    blocks = blocks[np.lexsort((blocks[:, 2], blocks[:, 1], blocks[:, 0]))]
    joins = ((blocks[1:, 0] == blocks[:-1, 0]) & (blocks[1:, 1] == blocks[:-1, 1])
             & (blocks[1:, 2] == blocks[:-1, 3]) & (blocks[:-1, 4] == 0))
    if not joins.any():
        return blocks
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))  # first block of each run of joined blocks
    ends = np.concatenate([starts[1:], [len(blocks)]]) - 1      # its last block
    return np.stack([blocks[starts, 0], blocks[starts, 1], blocks[starts, 2], blocks[ends, 3], blocks[ends, 4]],
                    axis=1)


def _to_blocks(blocks: np.ndarray) -> AttentionBlocks:
    if not len(blocks):
        return AttentionBlocks()
    qs, qe, ks, ke, c = (tuple(col.tolist()) for col in blocks[:, :5].T)
    windows = tuple(zip(blocks[:, 5].tolist(), blocks[:, 6].tolist())) if blocks.shape[1] > 5 else ()
    if all(w == UNBOUNDED for w in windows):
        windows = ()
    return AttentionBlocks(qs, qe, ks, ke, tuple(bool(x) for x in c), windows)


def _needed_rows(blocks: np.ndarray) -> Tuple[RowRanges, np.ndarray]:
    """The key owner's rows the blocks touch (merged ranges) and each block's shift into the packed rows."""
    order = np.argsort(blocks[:, 2], kind="stable")
    starts, ends = blocks[order, 2], blocks[order, 3]
    opens = np.ones(len(starts), dtype=bool)
    opens[1:] = starts[1:] > np.maximum.accumulate(ends)[:-1]
    first = np.flatnonzero(opens)
    range_starts = starts[first]
    range_ends = np.maximum.reduceat(ends, first)
    packed_starts = np.concatenate([[0], np.cumsum(range_ends - range_starts)[:-1]])
    which = np.searchsorted(range_starts, blocks[:, 2], side="right") - 1
    ranges = tuple(zip(range_starts.tolist(), range_ends.tolist()))
    return RowRanges(ranges), packed_starts[which] - range_starts[which]


def build_member_schedule(tables: Sequence[np.ndarray], member: int, causal: bool, window: Window = None,
                          node_of_member: Optional[Sequence[int]] = None) -> MemberSchedule:
    """The schedule of one member (piece tables of every member, see ``piece_tables``): local blocks,
    what it receives and what it sends, per ring distance; ``window`` from ``normalize_window``.

    ``node_of_member`` (node of each ring member) turns on node-level K/V forwarding
    (``_NodeForwarding``): a remote member's rows needed by several members of a node cross the
    node boundary once, to one of them, which relays them to the others."""
    ring_size = len(tables)
    mine = tables[member]
    local = _to_blocks(_pair_blocks_for(mine, mine, causal, window))
    relay = None if node_of_member is None else _NodeForwarding(tables, node_of_member, causal, window)
    recv_steps, send_steps = [], []
    for distance in range(1, ring_size):
        src = (member - distance) % ring_size
        if relay is not None and relay.forwarded(member, src):
            rows = relay.assigned(member, src)
            if rows.any():
                table = relay.rows_table([(src, rows)])
                recv_steps.append(RecvStep(distance, src, int(rows.sum()),
                                           _to_blocks(_pair_blocks_for(mine, table, causal, window)),
                                           deferred=relay.relays_from(member, src)))
        else:
            blocks = _pair_blocks_for(mine, tables[src], causal, window)
            if len(blocks):
                rows, shift = _needed_rows(blocks)
                blocks[:, 2] += shift
                blocks[:, 3] += shift
                recv_steps.append(RecvStep(distance, src, rows.num_rows, _to_blocks(blocks)))
        dst = (member + distance) % ring_size
        if relay is not None and relay.forwarded(dst, member):
            rows = relay.assigned(dst, member)
            if rows.any():
                send_steps.append(SendStep(distance, dst, RowRanges(_mask_ranges(rows)),
                                           deferred=relay.relays_from(dst, member)))
        else:
            blocks = _pair_blocks_for(tables[dst], mine, causal, window)
            if len(blocks):
                send_steps.append(SendStep(distance, dst, _needed_rows(blocks)[0]))
    if relay is None:
        return MemberSchedule(local, tuple(recv_steps), tuple(send_steps))
    relay_sends, relay_recvs = [], []
    for distance in range(1, ring_size):
        dst, src = (member + distance) % ring_size, (member - distance) % ring_size
        if node_of_member[dst] == node_of_member[member]:
            parts = relay.relayed(member, dst)
            if parts:  # positions in the buffer received from s, which holds the rows assigned to this member
                relay_sends.append(RelaySend(distance, dst, tuple(
                    ((member - s) % ring_size, RowRanges(_mask_ranges(rows[relay.assigned(member, s)])))
                    for s, rows in parts)))
        if node_of_member[src] == node_of_member[member]:
            parts = relay.relayed(src, member)
            if parts:
                relay_recvs.append(RecvStep(distance, src, sum(int(rows.sum()) for _, rows in parts),
                                            _to_blocks(_pair_blocks_for(mine, relay.rows_table(parts), causal,
                                                                        window))))
    return MemberSchedule(local, tuple(recv_steps), tuple(send_steps), tuple(relay_sends), tuple(relay_recvs))


class _NodeForwarding:
    """Who receives which remote rows under node-level forwarding (row sets as bool masks over the
    owner's member buffer).

    For a node N and a member ``src`` on another node, the rows of ``src`` that some member of N needs
    cross once: each goes to the first member of N needing it (``assigned``), in an order of N's members
    rotated by ``src`` so that different sources are relayed by different members, and that member relays
    it to the other members of N needing it (``relayed``). Every rank derives the same assignment from the
    plan, so both sides of every message agree without asking."""

    def __init__(self, tables: Sequence[np.ndarray], node_of_member: Sequence[int], causal: bool,
                 window: Window) -> None:
        self.tables, self.nodes, self.causal, self.window = tables, list(node_of_member), causal, window
        self.members: Dict[int, List[int]] = defaultdict(list)
        for m, node in enumerate(self.nodes):
            self.members[node].append(m)
        self.num_docs = 1 + max((int(t[:, 0].max()) for t in tables if len(t)), default=0)
        self._rows: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}
        self._horizons: Dict[int, np.ndarray] = {}
        self._per_source: Dict[Tuple[int, int], Tuple[List[int], np.ndarray, np.ndarray]] = {}

    def forwarded(self, dst: int, src: int) -> bool:
        """Whether rows of ``src`` reach ``dst`` through forwarding (other node, several members on dst's)."""
        return self.nodes[dst] != self.nodes[src] and len(self.members[self.nodes[dst]]) > 1

    def _row_docs(self, src: int) -> Tuple[np.ndarray, np.ndarray]:
        """(document, in-document position) of every row of ``src``'s buffer (-1: padding)."""
        if src not in self._rows:
            table = self.tables[src]
            lengths = table[:, 3] - table[:, 2]
            first = np.cumsum(lengths) - lengths
            rows = int((table[:, 1] + lengths).max()) if len(table) else 0
            doc, pos = np.full(rows, -1, dtype=np.int64), np.zeros(rows, dtype=np.int64)
            at = np.arange(int(lengths.sum()))
            index = at + np.repeat(table[:, 1] - first, lengths)
            doc[index] = np.repeat(table[:, 0], lengths)
            pos[index] = at + np.repeat(table[:, 2] - first, lengths)
            self._rows[src] = doc, pos
        return self._rows[src]

    def _needed(self, dst: int, src: int) -> np.ndarray:
        """Rows of ``src``'s buffer that some query of ``dst`` attends. Without a window: keys of a document
        ``dst`` holds, before its last query of the document when causal (what the blocks touch)."""
        doc, pos = self._row_docs(src)
        if self.window is not None:
            mask = np.zeros(len(doc), dtype=bool)
            blocks = _pair_blocks_for(self.tables[dst], self.tables[src], self.causal, self.window)
            for s, e in (_needed_rows(blocks)[0].ranges if len(blocks) else ()):
                mask[s:e] = True
            return mask
        if dst not in self._horizons:
            horizon = np.zeros(self.num_docs + 1, dtype=np.int64)  # the last entry: padding rows (doc -1)
            table = self.tables[dst]
            np.maximum.at(horizon, table[:, 0], table[:, 3] if self.causal else np.full(len(table), 1 << 62))
            self._horizons[dst] = horizon
        return pos < self._horizons[dst][doc]

    def _source(self, node: int, src: int) -> Tuple[List[int], np.ndarray, np.ndarray]:
        """(members of ``node`` in the order rotated by ``src``, their needed rows ``[M, rows]``, their
        assigned rows ``[M, rows]``)."""
        key = (node, src)
        if key not in self._per_source:
            members = self.members[node]
            first = src % len(members)
            order = members[first:] + members[:first]
            needed = np.stack([self._needed(m, src) for m in order])
            earlier = np.zeros_like(needed)
            earlier[1:] = np.logical_or.accumulate(needed[:-1], axis=0)
            self._per_source[key] = order, needed, needed & ~earlier
        return self._per_source[key]

    def assigned(self, dst: int, src: int) -> np.ndarray:
        """Rows of ``src`` that cross the node boundary to ``dst`` (bool mask over ``src``'s buffer)."""
        order, _, assigned = self._source(self.nodes[dst], src)
        return assigned[order.index(dst)]

    def relayed(self, relay: int, dst: int) -> List[Tuple[int, np.ndarray]]:
        """(src, rows of src's buffer) that ``relay`` passes on to ``dst`` (same node), in increasing src."""
        parts = []
        for src in range(len(self.nodes)):
            if self.nodes[src] != self.nodes[relay]:
                order, needed, assigned = self._source(self.nodes[relay], src)
                rows = assigned[order.index(relay)] & needed[order.index(dst)]
                if rows.any():
                    parts.append((src, rows))
        return parts

    def relays_from(self, relay: int, src: int) -> bool:
        """Whether ``relay`` passes on some rows it received from ``src``."""
        order, needed, assigned = self._source(self.nodes[relay], src)
        i = order.index(relay)
        others = np.delete(needed, i, axis=0).any(axis=0)
        return bool((assigned[i] & others).any())

    def rows_table(self, parts: Sequence[Tuple[int, np.ndarray]]) -> np.ndarray:
        """Piece table (``piece_tables``' form) of a buffer concatenating, for each ``(src, rows)`` of
        ``parts``, the rows of ``src``'s buffer selected by the mask, in order."""
        docs, positions = [], []
        for src, rows in parts:
            doc, pos = self._row_docs(src)
            docs.append(doc[:len(rows)][rows[:len(doc)]])
            positions.append(pos[:len(rows)][rows[:len(doc)]])
        doc, pos = np.concatenate(docs), np.concatenate(positions)
        heads = np.flatnonzero(np.concatenate([[True], (doc[1:] != doc[:-1]) | (pos[1:] != pos[:-1] + 1)]))
        tails = np.append(heads[1:], len(doc)) - 1
        table = np.stack([doc[heads], heads, pos[heads], pos[tails] + 1], axis=1)
        return table[np.lexsort((table[:, 2], table[:, 0]))]


def _mask_ranges(mask: np.ndarray) -> Tuple[Tuple[int, int], ...]:
    """The ``[start, end)`` runs of True in a bool mask."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return tuple(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))
