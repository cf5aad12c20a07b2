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


def _reach(causal: bool, window: Window) -> Tuple[int, int]:
    """``document_bounds`` with an unbounded side as -``_FAR`` / ``_FAR``."""
    lo, hi = document_bounds(causal, window)
    return (-_FAR if lo is None else lo), (_FAR if hi is None else hi)


def _join(q: np.ndarray, k: np.ndarray, lo: int, hi: int) -> Tuple[np.ndarray, np.ndarray]:
    """Index pairs (query piece of ``q``, key piece of ``k``) of one document where some key position minus
    query position lies in ``[lo, hi]``: by query piece, then by key position (piece tables sorted by document
    then position, as ``piece_tables``). Pairs out of reach (a causal key piece after the query piece) never
    form, so the work follows the blocks, not the pieces sharing a document."""
    if not len(q) or not len(k):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    span = 2 + max(int(q[:, 3].max()), int(k[:, 3].max()))  # (document, position) keys, reaches clipped to it

    def reach(position: np.ndarray) -> np.ndarray:
        return q[:, 0] * span + np.clip(position, -1, span - 2)

    first = np.searchsorted(k[:, 0] * span + k[:, 3], reach(q[:, 2] + lo), side="right")  # keys end after
    end = np.searchsorted(k[:, 0] * span + k[:, 2], reach(q[:, 3] + hi), side="left")  # keys start before
    counts = np.maximum(end - first, 0)
    qi = np.repeat(np.arange(len(q)), counts)
    ki = np.repeat(first - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
    return qi, ki


def _pair_blocks(q: np.ndarray, k: np.ndarray, causal: bool) -> np.ndarray:
    """Blocks ``[m, 5]`` (q_start, q_end, k_start, k_end, causal) letting every query piece of ``q`` attend
    the key pieces of ``k`` of the same document (piece tables as in ``piece_tables``)."""
    qi, ki = _join(q, k, *_reach(causal, None))
    if not len(qi):
        return np.zeros((0, 5), dtype=np.int64)
    qb, q0, q1 = (np.take(q[:, c], qi) for c in (1, 2, 3))
    kb, k0, k1 = (np.take(k[:, c], ki) for c in (1, 2, 3))
    if not causal:
        blocks = np.empty((len(qi), 5), dtype=np.int64)
        blocks[:, 0] = qb
        blocks[:, 1] = qb + q1 - q0
        blocks[:, 2] = kb
        blocks[:, 3] = kb + k1 - k0
        blocks[:, 4] = 0
        return blocks
    kend = np.minimum(k1, q1)
    before = kend <= q0  # every key precedes every query: one full block
    # pairs with a diagonal (queries before k0 see none of these keys), then every pair's full part: rows from
    # kend on (all of them when every key precedes every query) see every key up to kend
    diagonal = np.flatnonzero(~before)
    n = len(diagonal)
    blocks = np.empty((n + len(qi), 5), dtype=np.int64)
    dqb, dq0, dkend, dkb = qb[diagonal], q0[diagonal], kend[diagonal], kb[diagonal]
    blocks[:n, 0] = dqb + np.maximum(dq0, k0[diagonal]) - dq0
    blocks[:n, 1] = dqb + dkend - dq0
    blocks[:n, 2] = dkb
    blocks[:n, 3] = dkb + dkend - k0[diagonal]
    blocks[:n, 4] = 1
    full = kend - q0
    blocks[n:, 0] = qb + np.where(before, 0, full)
    blocks[n:, 1] = qb + q1 - q0
    blocks[n:, 2] = kb
    blocks[n:, 3] = kb + kend - k0
    blocks[n:, 4] = 0
    nonempty = (blocks[:, 1] > blocks[:, 0]) & (blocks[:, 3] > blocks[:, 2])
    return blocks if nonempty.all() else np.compress(nonempty, blocks, axis=0)


def _windowed_pair_blocks(q: np.ndarray, k: np.ndarray, lo: Optional[int], hi: Optional[int]) -> np.ndarray:
    """Blocks ``[m, 7]`` (q_start, q_end, k_start, k_end, causal, left, right) of a windowed mask: every
    query piece of ``q`` against the key pieces of ``k`` of its document where some key position minus query
    position lies in ``[lo, hi]`` (None = unbounded), each trimmed to the rows that see a key and the keys
    some row sees, with its band in the blocks' bottom-right convention."""
    lo_, hi_ = (-_FAR if lo is None else lo), (_FAR if hi is None else hi)
    qi, ki = _join(q, k, lo_, hi_)
    qb, q0, q1 = q[qi, 1], q[qi, 2], q[qi, 3]
    kb, k0, k1 = k[ki, 1], k[ki, 2], k[ki, 3]
    r0, r1 = np.maximum(q0, k0 - hi_), np.minimum(q1, k1 - lo_)  # rows that see a key of the piece
    c0, c1 = np.maximum(k0, q0 + lo_), np.minimum(k1, q1 + hi_)  # keys some row sees
    corner = c1 - r1  # key - query on the trimmed block's bottom-right diagonal, inside [lo, hi]
    left, right = corner - lo_, hi_ - corner
    left = np.where((lo is None) | (left >= c1 - c0 - 1), -1, left)  # a bound that cuts nothing is dropped
    right = np.where((hi is None) | (right >= r1 - r0 - 1), -1, right)
    causal = right == 0
    right = np.where(causal, -1, right)
    return np.stack([qb + r0 - q0, qb + r1 - q0, kb + c0 - k0, kb + c1 - k0, causal.astype(np.int64), left, right],
                    axis=1)


def _pair_blocks_for(q: np.ndarray, k: np.ndarray, causal: bool, window: Window, width: int = _FAR) -> np.ndarray:
    """``_pair_blocks`` without a window, ``_windowed_pair_blocks`` with one (columns 0-4 alike). With ``k``
    several buffers laid end to end ``width`` apart (``_stack``), the blocks come buffer by buffer, each
    buffer's as on its own."""
    if window is None:
        return _merge_adjacent_keys(_pair_blocks(q, k, causal), width)
    blocks = _windowed_pair_blocks(q, k, *document_bounds(causal, window))
    return np.take(blocks, np.argsort(blocks[:, 2] // width, kind="stable"), axis=0)


def _merge_adjacent_keys(blocks: np.ndarray, width: int = _FAR) -> np.ndarray:
    """Join a full block with the next block of the same query rows whose keys start where its keys end
    (a zigzag chunk sees both chunks of an earlier rank, or the full part of its own causal diagonal):
    the same mask in fewer kernel calls and LSE merges. The joined block keeps the second's causal flag,
    whose bottom-right alignment is unchanged (same key end, same query rows). Sorted by key buffer
    (``_pair_blocks_for``'s ``width``), then query rows, then keys."""
    if len(blocks) < 2:
        return blocks
    blocks = np.take(blocks, _block_order(blocks, width), axis=0)
    joins = ((blocks[1:, 0] == blocks[:-1, 0]) & (blocks[1:, 1] == blocks[:-1, 1])
             & (blocks[1:, 2] == blocks[:-1, 3]) & (blocks[:-1, 4] == 0))
    if not joins.any():
        return blocks
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))  # first block of each run of joined blocks
    ends = np.concatenate([starts[1:], [len(blocks)]]) - 1      # its last block
    merged = np.take(blocks, starts, axis=0)
    merged[:, 3:5] = np.take(blocks[:, 3:5], ends, axis=0)
    return merged


def _block_order(blocks: np.ndarray, width: int) -> np.ndarray:
    """The order sorting blocks by key buffer (``k_start // width``), query start, query end, key start: two
    stable argsorts of combined keys (each under 2**62 for buffers under 2**31 rows), faster than ``lexsort``."""
    buffer, key = np.divmod(blocks[:, 2], width)
    rows = 1 + int(blocks[:, 1].max())
    keys = 1 + int(key.max())
    minor = blocks[:, 1] * keys + key  # under rows * keys
    major = buffer * rows + blocks[:, 0]
    if (1 + int(major.max())) * rows * keys < 1 << 62:  # one argsort of the combined key: the same order
        return np.argsort(major * (rows * keys) + minor, kind="stable")
    order = np.argsort(minor, kind="stable")
    return order[np.argsort(major[order], kind="stable")]


def _touched_keys(q: np.ndarray, k: np.ndarray, causal: bool, window: Window
                  ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per pair of ``_join``: its query piece, and the rows ``[start, end)`` of ``k``'s buffer that some query
    of the piece sees (the keys of the pair's blocks)."""
    lo, hi = _reach(causal, window)
    qi, ki = _join(q, k, lo, hi)
    k0 = k[ki, 2]
    shift = k[ki, 1] - k0
    return qi, np.maximum(k0, q[qi, 2] + lo) + shift, np.minimum(k[ki, 3], q[qi, 3] + hi) + shift


def _split_blocks(blocks: np.ndarray, bounds: Sequence[int]) -> List[AttentionBlocks]:
    """The ``AttentionBlocks`` of rows ``[bounds[i], bounds[i + 1])`` of ``blocks`` (``_pair_blocks_for``'s
    columns) for every i, converted to Python ints in one pass."""
    columns = np.ascontiguousarray(blocks[:, :4].T)  # each step's rows converted straight into its tuples
    q_starts, q_ends, k_starts, k_ends = columns
    causal = blocks[:, 4].astype(bool)
    windowed = blocks.shape[1] > 5
    if windowed:
        left, right = blocks[:, 5].tolist(), blocks[:, 6].tolist()
        bounded = np.concatenate([[0], np.cumsum((blocks[:, 5] != -1) | (blocks[:, 6] != -1))]).tolist()
    result = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        windows = tuple(zip(left[a:b], right[a:b])) if windowed and bounded[b] > bounded[a] else ()
        result.append(AttentionBlocks(tuple(q_starts[a:b].tolist()), tuple(q_ends[a:b].tolist()),
                                      tuple(k_starts[a:b].tolist()), tuple(k_ends[a:b].tolist()),
                                      tuple(causal[a:b].tolist()), windows))
    return result


def _union(starts: np.ndarray, ends: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows the intervals ``[starts, ends)`` cover, as sorted ranges (overlapping or touching ones joined),
    and the range holding each interval."""
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    opens = np.ones(len(starts), dtype=bool)
    opens[1:] = starts[1:] > np.maximum.accumulate(ends)[:-1]
    first = np.flatnonzero(opens)
    which = np.empty(len(order), dtype=np.int64)
    which[order] = np.cumsum(opens) - 1
    return starts[first], np.maximum.reduceat(ends, first) if len(first) else ends, which


def _ranges_by_group(starts: np.ndarray, ends: np.ndarray, group: np.ndarray, width: int,
                     count: int) -> List[Tuple[Tuple[int, int], ...]]:
    """For each group ``0 .. count - 1`` the ``_union`` of its intervals (rows of buffers shorter than ``width``)."""
    offset = group * width
    range_starts, range_ends, _ = _union(starts + offset, ends + offset)
    bounds = np.searchsorted(range_starts, np.arange(count + 1) * width).tolist()
    offset = range_starts // width * width
    range_starts, range_ends = (range_starts - offset).tolist(), (range_ends - offset).tolist()
    return [tuple(zip(range_starts[a:b], range_ends[a:b])) for a, b in zip(bounds[:-1], bounds[1:])]


def _group_sums(values: np.ndarray, group: np.ndarray, count: int) -> List[int]:
    """Sum of ``values`` per group ``0 .. count - 1`` (``group`` non-decreasing)."""
    total = np.concatenate([[0], np.cumsum(values)])
    bounds = np.searchsorted(group, np.arange(count + 1))
    return (total[bounds[1:]] - total[bounds[:-1]]).tolist()


def _stack(tables: Sequence[np.ndarray], members: Sequence[int], width: int) -> np.ndarray:
    """One piece table for the buffers of ``members`` laid end to end, member m's at ``m * width``, sorted by
    document then position (as ``piece_tables``): joining a table with it joins it with each of theirs at
    once (a position lives in one buffer)."""
    if not members:
        return np.zeros((0, 4), dtype=np.int64)
    stacked = np.concatenate([tables[m] for m in members])
    stacked[:, 1] += np.repeat(np.asarray(members, dtype=np.int64) * width, [len(tables[m]) for m in members])
    return np.take(stacked, _document_order(stacked[:, 0], stacked[:, 2]), axis=0)


def _document_order(doc: np.ndarray, position: np.ndarray) -> np.ndarray:
    """The order sorting ``(doc, position)`` pairs (a stable argsort of one key: faster than ``lexsort``)."""
    span = 1 + int(position.max()) if len(position) else 1
    return np.argsort(doc * span + position, kind="stable")


def _packed_table(doc: np.ndarray, start: np.ndarray, end: np.ndarray, group: np.ndarray, width: int,
                  count: int) -> Tuple[np.ndarray, List[int]]:
    """The ``_stack``ed piece table of buffers gathering, in order, the positions ``[start, end)`` of documents
    ``doc``, one buffer per group (``group`` non-decreasing), and each buffer's rows. Consecutive ranges that
    continue each other (same document, next position) form one piece."""
    length = end - start
    if not len(doc):
        return np.zeros((0, 4), dtype=np.int64), [0] * count
    head = np.ones(len(doc), dtype=bool)
    head[1:] = (group[1:] != group[:-1]) | (doc[1:] != doc[:-1]) | (start[1:] != end[:-1])
    heads = np.flatnonzero(head)
    tails = np.append(heads[1:], len(doc)) - 1
    packed = np.cumsum(length) - length
    buffer = packed[heads] - packed[np.searchsorted(group, group[heads])] + group[heads] * width
    table = np.stack([doc[heads], buffer, start[heads], end[tails]], axis=1)
    return np.take(table, _document_order(doc[heads], start[heads]), axis=0), _group_sums(length, group, count)


def _grouped_blocks(mine: np.ndarray, stacked: np.ndarray, width: int, count: int, causal: bool,
                    window: Window) -> Tuple[np.ndarray, List[int]]:
    """The blocks of ``mine``'s queries on each buffer of a ``_stack``ed table, buffer by buffer (keys in that
    buffer's rows), and where each buffer's blocks start (``count + 1`` bounds)."""
    blocks = _pair_blocks_for(mine, stacked, causal, window, width)
    group = blocks[:, 2] // width
    blocks[:, 2:4] -= group[:, None] * width
    return blocks, np.searchsorted(group, np.arange(count + 1)).tolist()


def _direct_receives(mine: np.ndarray, stacked: np.ndarray, member: int, srcs: Sequence[int], ring_size: int,
                     width: int, causal: bool, window: Window) -> List[RecvStep]:
    """What ``member`` (piece table ``mine``) receives straight from each of ``srcs`` (buffers in ``stacked``,
    ``_stack``'s form): the rows its queries touch, packed in the receive buffer, with the blocks shifted
    onto them."""
    blocks, bounds = _grouped_blocks(mine, stacked, width, ring_size, causal, window)
    offset = np.repeat(np.arange(ring_size) * width, np.diff(bounds))  # sources' rows kept apart
    starts, ends, which = _union(blocks[:, 2] + offset, blocks[:, 3] + offset)
    packed = np.concatenate([[0], np.cumsum(ends - starts)])  # rows before each range
    source_bounds = np.searchsorted(starts, np.arange(ring_size + 1) * width)
    source_first = packed[source_bounds[:-1]]  # rows before each source's first range
    shift = (packed[:-1] - np.repeat(source_first, np.diff(source_bounds)) - starts)[which] + offset
    blocks[:, 2] += shift
    blocks[:, 3] += shift
    rows = (packed[source_bounds[1:]] - source_first).tolist()
    steps = _split_blocks(blocks, bounds)
    return [RecvStep((member - src) % ring_size, src, rows[src], steps[src]) for src in srcs if rows[src]]


def _direct_sends(mine: np.ndarray, stacked: np.ndarray, member: int, dsts: Sequence[int], ring_size: int,
                  width: int, causal: bool, window: Window) -> List[SendStep]:
    """What ``member`` sends straight to each of ``dsts`` (buffers in ``stacked``): the rows of its buffer
    their queries touch."""
    lo, hi = _reach(causal, window)
    if lo == -_FAR:
        ranges = _sends_from_starts(mine, stacked, hi, width, ring_size)
    else:
        query, starts, ends = _touched_keys(stacked, mine, causal, window)
        ranges = _ranges_by_group(starts, ends, stacked[query, 1] // width, width, ring_size)
    return [SendStep((dst - member) % ring_size, dst, RowRanges(ranges[dst])) for dst in dsts if ranges[dst]]


def _sends_from_starts(mine: np.ndarray, stacked: np.ndarray, hi: int, width: int,
                       count: int) -> List[Tuple[Tuple[int, int], ...]]:
    """``_ranges_by_group`` of ``_touched_keys(stacked, mine)`` when no query's reach is bounded on the left
    (``lo`` = -``_FAR``): every key piece is then touched from its start, so each buffer's rows of it are
    one range ending at the furthest reach of that buffer's queries (a scatter-max, no sort of the pairs);
    the ranges come out by buffer then row, touching ones joined."""
    qi, ki = _join(stacked, mine, -_FAR, hi)
    if not len(qi):
        return [()] * count
    pieces = len(mine)
    by_row = np.argsort(mine[:, 1], kind="stable")  # key pieces in buffer order
    place = np.empty(pieces, dtype=np.int64)
    place[by_row] = np.arange(pieces)
    reach = np.zeros(count * pieces, dtype=np.int64)  # per (buffer, key piece): its furthest key, 0 = untouched
    np.maximum.at(reach, np.take(stacked[:, 1], qi) // width * pieces + place[ki],
                  np.minimum(np.take(mine[:, 3], ki), np.take(stacked[:, 3], qi) + hi))  # > the piece's start
    cells = np.flatnonzero(reach)
    group, piece = np.divmod(cells, pieces)
    piece = by_row[piece]
    starts = mine[piece, 1]
    ends = reach[cells] - mine[piece, 2] + starts
    opens = np.ones(len(cells), dtype=bool)  # pieces are disjoint: a range joins the previous one if touching
    opens[1:] = (group[1:] != group[:-1]) | (starts[1:] != ends[:-1])
    first = np.flatnonzero(opens)
    last = np.append(first[1:], len(cells)) - 1
    bounds = np.searchsorted(group[first], np.arange(count + 1)).tolist()
    range_starts, range_ends = starts[first].tolist(), ends[last].tolist()
    return [tuple(zip(range_starts[a:b], range_ends[a:b])) for a, b in zip(bounds[:-1], bounds[1:])]


def build_member_schedule(tables: Sequence[np.ndarray], member: int, causal: bool, window: Window = None,
                          node_of_member: Optional[Sequence[int]] = None,
                          shared: Optional[Dict[object, object]] = None) -> MemberSchedule:
    """The schedule of one member (piece tables of every member, see ``piece_tables``): local blocks,
    what it receives and what it sends, per ring distance; ``window`` from ``normalize_window``.

    ``node_of_member`` (node of each ring member) turns on node-level K/V forwarding
    (``_NodeForwarding``): a remote member's rows needed by several members of a node cross the
    node boundary once, to one of them, which relays them to the others. Every exchange with every other
    member is worked out at once, on the other members' piece tables laid end to end (``_stack``).

    ``shared``: a dict kept with ``tables`` (one per plan) where what every member's schedule derives from
    the tables alike (the buffer width, all members' tables stacked, the forwarding's segments and what a
    node receives) is kept after its first build, so each later member only does its own part. Entries are
    written whole once built: concurrent builds at worst repeat the work."""
    shared = {} if shared is None else shared
    ring_size = len(tables)
    mine = tables[member]
    width = shared.get("width")
    if width is None:
        width = shared["width"] = 1 + max((int((t[:, 1] + t[:, 3] - t[:, 2]).max()) for t in tables if len(t)),
                                          default=0)
    local_blocks = _pair_blocks_for(mine, mine, causal, window)
    local = _split_blocks(local_blocks, [0, len(local_blocks)])[0]
    relay = None
    if node_of_member is not None:
        key = ("forwarding", causal, window, tuple(node_of_member))
        relay = shared.get(key)
        if relay is None:
            relay = shared[key] = _NodeForwarding(tables, node_of_member, causal, window, width)
    srcs = [(member - distance) % ring_size for distance in range(1, ring_size)]
    dsts = [(member + distance) % ring_size for distance in range(1, ring_size)]
    if relay is not None:
        srcs = [src for src in srcs if not relay.forwarded(member, src)]
        dsts = [dst for dst in dsts if not relay.forwarded(dst, member)]
    if relay is None:  # every other member: the stack of all (kept in ``shared``) less this member's rows
        stacked = _shared_stack(tables, width, shared)
        stacked = np.compress(stacked[:, 1] // width != member, stacked, axis=0)
    else:  # the members of this member's node: a small stack, not worth the stack of all on a first build
        stacked = _stack(tables, sorted(set(srcs) | set(dsts)), width)
    recv_steps = _direct_receives(mine, stacked, member, srcs, ring_size, width, causal, window)
    send_steps = _direct_sends(mine, stacked, member, dsts, ring_size, width, causal, window)
    if relay is None:
        return MemberSchedule(local, tuple(recv_steps), tuple(send_steps))
    received, relay_sends, relay_recvs = relay.incoming(member)
    by_distance = lambda step: step.distance  # noqa: E731
    return MemberSchedule(local, tuple(sorted(recv_steps + received, key=by_distance)),
                          tuple(sorted(send_steps + relay.outgoing(member), key=by_distance)),
                          tuple(sorted(relay_sends, key=by_distance)), tuple(sorted(relay_recvs, key=by_distance)))


def _shared_stack(tables: Sequence[np.ndarray], width: int, shared: Dict[object, object]) -> np.ndarray:
    """All members' tables ``_stack``ed, kept in ``shared``: the stack of any subset of members is its rows
    of it, in the same order (``_stack`` sorts by (document, position), unique per token, ties kept in member
    order)."""
    stacked = shared.get("stack")
    if stacked is None:
        stacked = shared["stack"] = _stack(tables, range(len(tables)), width)
    return stacked


class _NodeForwarding:
    """Who receives which remote rows under node-level forwarding.

    For a node N and a member ``src`` on another node, the rows of ``src`` that some member of N needs
    cross once: each goes to the first member of N needing it, in an order of N's members rotated by
    ``src`` so that different sources are relayed by different members, and that member relays it to the
    other members of N needing it. Every rank derives the same assignment from the plan, so both sides of
    every message agree without asking.

    Rows are found by their keys on one line of (node, document, position): the reaches of a node's members
    (the keys some query of theirs sees) cut the node's part of the line into segments each needed by a fixed
    set of its members, and the rows of a member needed by a node are its pieces' overlaps with those
    segments, so the work follows the number of pieces, not of rows.
    """

    def __init__(self, tables: Sequence[np.ndarray], node_of_member: Sequence[int], causal: bool,
                 window: Window, width: int) -> None:
        self.tables, self.causal, self.window, self.width = tables, causal, window, width
        self.nodes = list(node_of_member)
        self.members: Dict[int, List[int]] = defaultdict(list)
        for m, node in enumerate(self.nodes):
            self.members[node].append(m)
        self.index = [0] * len(self.nodes)  # each member's place among its node's members
        for members in self.members.values():
            for i, m in enumerate(members):
                self.index[m] = i
        stacked = np.concatenate(tables)
        owner = np.repeat(np.arange(len(tables)), [len(t) for t in tables])
        self.span = 1 + int(stacked[:, 3].max()) if len(stacked) else 1  # past every position
        docs = 1 + int(stacked[:, 0].max()) if len(stacked) else 1
        node_rank = {node: i for i, node in enumerate(sorted(self.members))}
        #: Where each member's node starts on the line.
        self.line_start = np.array([node_rank[node] * docs * self.span for node in self.nodes], dtype=np.int64)
        lo, hi = document_bounds(causal, window)
        first = np.clip(stacked[:, 2] + (-_FAR if lo is None else lo), 0, self.span - 1)
        last = np.clip(stacked[:, 3] + (_FAR if hi is None else hi), 0, self.span - 1)
        keep = last > first
        base = (self.line_start[owner] + stacked[:, 0] * self.span)[keep]
        starts, ends, column = base + first[keep], base + last[keep], np.asarray(self.index)[owner[keep]]
        points = np.concatenate([starts, ends])
        order = np.argsort(points, kind="stable")  # merges the members' sorted runs
        distinct = np.ones(len(points), dtype=bool)
        distinct[1:] = points[order[1:]] != points[order[:-1]]
        boundary = np.empty(len(points), dtype=np.int64)  # each reach end's place among the distinct ones
        boundary[order] = np.cumsum(distinct) - 1
        bounds = points[order[distinct]]
        columns = max(len(members) for members in self.members.values())
        change = np.zeros(columns * len(bounds), dtype=np.int32)  # reaches opened minus closed, per place
        ones = np.ones(len(starts), dtype=np.int32)  # (same-dtype operands keep ufunc.at on its fast path)
        np.add.at(change, column * len(bounds) + boundary[:len(starts)], ones)
        np.subtract.at(change, column * len(bounds) + boundary[len(starts):], ones)
        change = change.reshape(columns, -1)
        #: Segment j = [bounds[j], bounds[j + 1]): need[i, j] whether member i of the node there reaches it.
        self.need = np.cumsum(change, axis=1, dtype=np.int32) > 0
        self.shared = self.need.sum(axis=0) > 1  # needed by several members: relayed
        #: next_needing[r, j]: the first member at place r or after needing segment j (``columns``: none).
        self.next_needing = np.full((columns + 1, len(bounds)), columns, dtype=np.int64)
        for place in range(columns - 1, -1, -1):
            self.next_needing[place] = np.where(self.need[place], place, self.next_needing[place + 1])
        self.bounds = np.append(bounds, np.iinfo(np.int64).max)
        self._arrivals: Dict[int, object] = {}  # node -> ``_arriving(node)``

    def forwarded(self, dst: int, src: int) -> bool:
        """Whether rows of ``src`` reach ``dst`` through forwarding (other node, several members on dst's)."""
        return self.nodes[dst] != self.nodes[src] and len(self.members[self.nodes[dst]]) > 1

    def _overlaps(self, table: np.ndarray, line_start: np.ndarray
                  ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(piece, segment, start, end): the positions ``[start, end)`` of each piece of ``table`` (placed on
        the line at ``line_start``, one per piece) in each segment some member needs."""
        base = line_start + table[:, 0] * self.span
        x0, x1 = base + table[:, 2], base + table[:, 3]
        lo = np.maximum(np.searchsorted(self.bounds, x0, side="right") - 1, 0)
        counts = np.maximum(np.searchsorted(self.bounds, x1, side="left") - lo, 0)
        piece = np.repeat(np.arange(len(table)), counts)
        segment = np.repeat(lo - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
        needed = self.next_needing[0, segment] < len(self.need)
        piece, segment = piece[needed], segment[needed]
        return (piece, segment, np.maximum(x0[piece], self.bounds[segment]) - base[piece],
                np.minimum(x1[piece], self.bounds[segment + 1]) - base[piece])

    def _first_needing(self, segment: np.ndarray, rotation: np.ndarray, size: np.ndarray) -> np.ndarray:
        """Per segment, the member (place on its node of ``size`` members) it crosses to: the first needing it
        in the node's order rotated by ``rotation``."""
        after = self.next_needing[rotation, segment]
        return np.where(after < size, after, self.next_needing[0, segment])

    def _arriving(self, node: int) -> Optional[Tuple[List[int], np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                     np.ndarray, np.ndarray]]:
        """What crosses into ``node`` from the members of other nodes, the same for each of its members (kept
        after the first): the sources, and per piece overlap of a needed segment, ordered by source then
        buffer row, its document, segment, positions ``[start, end)``, the place of the member it crosses to,
        and its source's index. None when nothing is forwarded to the node."""
        if node in self._arrivals:
            return self._arrivals[node]
        members, ring_size = self.members[node], len(self.tables)
        srcs = [src for src in range(ring_size) if self.nodes[src] != node]
        arriving = None
        if len(members) > 1 and srcs:
            table = np.concatenate([self.tables[src] for src in srcs])
            source = np.repeat(np.arange(len(srcs)), [len(self.tables[src]) for src in srcs])
            piece, segment, start, end = self._overlaps(table, self.line_start[members[0]])
            size = np.full(len(piece), len(members))
            owner = self._first_needing(segment, np.asarray(srcs)[source[piece]] % size, size)
            group = source[piece]
            # source, buffer order (unique keys: a member's kept rows come out in the order sorting them would)
            order = np.argsort(group * self.width + table[piece, 1] + start - table[piece, 2])
            piece, segment, start, end, owner, group = (x[order] for x in (piece, segment, start, end, owner, group))
            arriving = (srcs, table[piece, 0], segment, start, end, owner, group)
        self._arrivals[node] = arriving
        return arriving

    def incoming(self, member: int) -> Tuple[List[RecvStep], List[RelaySend], List[RecvStep]]:
        """What ``member`` receives from other nodes, what it relays to the members of its node, and what
        they relay to it."""
        node, me, ring_size = self.nodes[member], self.index[member], len(self.tables)
        members = self.members[node]
        arriving = self._arriving(node)
        if arriving is None:
            return [], [], []
        srcs, doc, segment, start, end, owner, group = arriving
        keep = (owner == me) | self.need[me, segment]
        doc, segment, start, end, owner, group = (x[keep] for x in (doc, segment, start, end, owner, group))
        distance = [(member - src) % ring_size for src in srcs]

        # The rows assigned to this member, each source's in one receive buffer.
        mine = owner == me
        stacked, rows = _packed_table(doc[mine], start[mine], end[mine], group[mine], self.width, len(srcs))
        blocks, bounds = _grouped_blocks(self.tables[member], stacked, self.width, len(srcs), self.causal,
                                         self.window)
        deferred = np.bincount(group[mine][self.shared[segment[mine]]], minlength=len(srcs)) > 0
        received = [RecvStep(distance[g], src, rows[g], step_blocks, deferred=bool(deferred[g]))
                    for g, (src, step_blocks) in enumerate(zip(srcs, _split_blocks(blocks, bounds))) if rows[g]]

        # Of those, what each other member of the node needs, as rows of the receive buffers.
        length = (end - start)[mine]
        at = np.cumsum(length) - length
        at -= at[np.searchsorted(group[mine], group[mine])]
        relay_sends = []
        for i, dst in enumerate(members):
            if dst != member:
                needed = self.need[i, segment[mine]]
                ranges = _ranges_by_group(at[needed], (at + length)[needed], group[mine][needed], self.width,
                                          len(srcs))
                parts = tuple((distance[g], RowRanges(r)) for g, r in enumerate(ranges) if r)
                if parts:
                    relay_sends.append(RelaySend((dst - member) % ring_size, dst, parts))

        # What the other members of the node relay to this one: one buffer per relay, sources in order.
        theirs = np.flatnonzero(~mine)
        theirs = theirs[np.argsort(owner[theirs], kind="stable")]
        width = 1 + int((end - start)[theirs].sum())  # a relayed buffer holds rows of several sources
        stacked, rows = _packed_table(doc[theirs], start[theirs], end[theirs], owner[theirs], width, len(members))
        blocks, bounds = _grouped_blocks(self.tables[member], stacked, width, len(members), self.causal,
                                         self.window)
        relay_recvs = [RecvStep((member - src) % ring_size, src, rows[i], step_blocks)
                       for i, (src, step_blocks) in enumerate(zip(members, _split_blocks(blocks, bounds)))
                       if rows[i]]
        return received, relay_sends, relay_recvs

    def outgoing(self, member: int) -> List[SendStep]:
        """What ``member`` sends to members of other nodes under forwarding: to each, the rows assigned to it."""
        ring_size, mine = len(self.tables), self.tables[member]
        targets = [node for node in sorted(self.members) if node != self.nodes[member] and len(self.members[node]) > 1]
        if not targets:
            return []
        firsts = [self.members[node][0] for node in targets]
        table = np.tile(mine, (len(targets), 1))
        target = np.repeat(np.arange(len(targets)), len(mine))
        piece, segment, start, end = self._overlaps(table, self.line_start[np.asarray(firsts)][target])
        size = np.asarray([len(self.members[node]) for node in targets])[target[piece]]
        owner = self._first_needing(segment, member % size, size)
        members = np.zeros((len(targets), len(self.need)), dtype=np.int64)  # by target node and place
        for t, node in enumerate(targets):
            members[t, :len(self.members[node])] = self.members[node]
        dst = members[target[piece], owner]
        buffer = table[piece, 1] - table[piece, 2]
        ranges = _ranges_by_group(buffer + start, buffer + end, dst, self.width, ring_size)
        deferred = np.bincount(dst[self.shared[segment]], minlength=ring_size) > 0
        return [SendStep((d - member) % ring_size, d, RowRanges(r), deferred=bool(deferred[d]))
                for d, r in enumerate(ranges) if r]
