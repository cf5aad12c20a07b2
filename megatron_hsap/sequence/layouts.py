"""Token layouts: which tokens of a packed batch each CP rank holds.

A layout maps document lengths to, per CP rank, a list of ``(doc_index, doc_start,
doc_end)`` segments in local order; every rank holds ``tokens_per_rank`` slots, the
slots after its segments being padding (zero output, zero gradient, masked loss).
Internally a layout is one *segment table*: int64 ``[n, 4]`` rows ``(cp_rank, doc,
doc_start, doc_end)`` ordered by rank, then local order, built and checked with numpy
ops (a 1M-token batch in a pure ring of 16 has ~19K zigzag segments; per-segment Python
cost 25-45 ms a batch).

- ``zigzag``: per document, TE-style, over the ring members: a document is cut into 2R
  chunks (R = ring size), ring member r keeping chunks r and 2R-1-r, which balances
  causal work per document. No padding: a document's L % 2R remainder tokens go one
  each to chunks taken round-robin over the members (continuing from the previous
  document), so every member holds the same number of tokens up to one. A member's
  share (its chunks in document order) is then cut contiguously over its Ulysses ranks,
  so after the all-to-all a document is at most two contiguous ranges per member.
- ``contiguous``: the packed stream cut into C equal pieces (tail padding only).
- ``sequence-aware``: documents placed by cost, see ``placement.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import numpy as np

if TYPE_CHECKING:
    from megatron_hsap.parallel_state import CPTopology
    from megatron_hsap.sequence.cost_model import CostModel
    from megatron_hsap.sequence.placement_config import PlacementConfig

Segment = Tuple[int, int, int]  # (doc_index, doc_start, doc_end): tokens [doc_start, doc_end) of one document


class Layout:
    """One layout: its name and how it places a batch (``table``); ``plan_batch`` looks it up in ``LAYOUT_TABLES``."""

    name: str = ""
    #: Whether ``cost_model`` and ``placement`` change the table (when not, the plan cache key drops them).
    configurable: bool = False

    def table(self, doc_lengths: np.ndarray, topology: "CPTopology", cost_model: Optional["CostModel"],
              placement: Optional["PlacementConfig"]) -> Tuple[np.ndarray, int]:
        """Segment table (int64 ``[n, 4]`` rows ``(cp_rank, doc, doc_start, doc_end)``) and ``tokens_per_rank`` of the
        documents of int64 ``doc_lengths`` ``[num_docs]``."""
        raise NotImplementedError


class ZigzagLayout(Layout):
    name = "zigzag"

    def table(self, doc_lengths, topology, cost_model, placement):
        return zigzag_table(doc_lengths, topology.cp_size, topology.ulysses_size)


class ContiguousLayout(Layout):
    name = "contiguous"

    def table(self, doc_lengths, topology, cost_model, placement):
        return contiguous_table(doc_lengths, topology.cp_size)


class SequenceAwareLayout(Layout):
    name = "sequence-aware"
    configurable = True

    def table(self, doc_lengths, topology, cost_model, placement):
        from megatron_hsap.sequence.placement import sequence_aware_table  # imported by the first plan that uses it

        nodes = topology.node_of_cp_rank
        members_on_node0 = sum(1 for m in range(topology.ring_size) if nodes[m * topology.ulysses_size] == nodes[0])
        tokens_per_rank = -(-int(np.sum(doc_lengths, dtype=np.int64)) // topology.cp_size)
        table = sequence_aware_table(doc_lengths, ring_size=topology.ring_size, ulysses_size=topology.ulysses_size,
                                     ring_members_per_node=members_on_node0, tokens_per_rank=tokens_per_rank,
                                     cost_model=cost_model, placement=placement)
        return table, tokens_per_rank


#: The layouts by name (``config.LAYOUTS`` lists the same names).
LAYOUT_TABLES: Dict[str, Layout] = {layout.name: layout
                                    for layout in (ZigzagLayout(), ContiguousLayout(), SequenceAwareLayout())}


def split_streams(member: np.ndarray, doc: np.ndarray, start: np.ndarray, end: np.ndarray, ulysses_size: int,
                  tokens_per_rank: int) -> np.ndarray:
    """Segment table of ring members' token streams (segments ordered by member, then buffer order) cut into
    ``ulysses_size`` consecutive ranks of ``tokens_per_rank`` slots each: after the all-to-all the member
    buffer is the stream again. A segment crossing a rank boundary is split there."""
    member, doc, start, end = (np.asarray(a, dtype=np.int64) for a in (member, doc, start, end))
    keep = end > start
    member, doc, start, end = member[keep], doc[keep], start[keep], end[keep]
    if not len(doc):
        return np.zeros((0, 4), dtype=np.int64)
    length = end - start
    # Buffer position of every segment inside its member, then in the concatenation of member capacities.
    before = np.cumsum(length) - length
    counts = np.bincount(member)
    offset = before - before[(np.cumsum(counts) - counts)[member]]  # minus the tokens before the member's first
    member_tokens = ulysses_size * tokens_per_rank
    if np.any(offset + length > member_tokens):
        raise AssertionError(f"a member stream does not fit {ulysses_size} ranks of {tokens_per_rank} tokens")
    if ulysses_size == 1:  # a member is one rank: nothing to split
        return np.stack([member, doc, start, end], axis=1)
    pos = member * member_tokens + offset
    # A segment inside one rank is one row; a rank boundary falling strictly inside a segment splits it.
    first_rank, last_rank = pos // tokens_per_rank, (pos + length - 1) // tokens_per_rank
    table = np.stack([first_rank, doc, start, end], axis=1)
    parts = last_rank - first_rank + 1
    cross = np.flatnonzero(parts > 1)  # (few: the formulas below run on these only)
    if not len(cross):
        return table
    table = np.repeat(table, parts, axis=0)
    count = parts[cross]
    row = np.repeat(cross, count)  # the segment of each piece of a crossing segment
    piece = np.arange(len(row)) - np.repeat(np.cumsum(count) - count, count)
    rank = first_rank[row] + piece
    lo = np.maximum(pos[row], rank * tokens_per_rank)
    hi = np.minimum(pos[row] + length[row], (rank + 1) * tokens_per_rank)
    s = start[row] + lo - pos[row]
    table[(np.cumsum(parts) - parts)[row] + piece] = np.stack([rank, doc[row], s, s + hi - lo], axis=1)
    return table


def zigzag_table(doc_lengths: Sequence[int], cp_size: int, ulysses_size: int = 1) -> Tuple[np.ndarray, int]:
    """Segment table and ``tokens_per_rank`` of the pad-free per-member zigzag (module docstring)."""
    if cp_size < 1 or ulysses_size < 1 or cp_size % ulysses_size:
        raise ValueError(f"cp_size={cp_size} must be a positive multiple of ulysses_size={ulysses_size}")
    ring = cp_size // ulysses_size
    chunks = 2 * ring
    lengths = np.asarray(doc_lengths, dtype=np.int64).reshape(-1)
    tokens_per_rank = -(-int(lengths.sum()) // cp_size)
    docs = np.flatnonzero(lengths > 0)
    if ring == 1:
        zeros = np.zeros(len(docs), dtype=np.int64)
        return split_streams(zeros, docs, zeros, lengths[docs], ulysses_size, tokens_per_rank), tokens_per_rank
    n = lengths[docs]
    base, remainder = n // chunks, n % chunks
    turn = (np.cumsum(remainder) - remainder) % chunks  # round-robin position of the document's first remainder
    # Slot of chunk c in the round-robin order: the first chunks of members 0..R-1, then their second chunks,
    # so any run of R consecutive remainder tokens reaches every member once.
    c = np.arange(chunks)
    slot = np.where(c < ring, c, 3 * ring - 1 - c)
    sizes = base[:, None] + (((slot[None, :] - turn[:, None]) % chunks) < remainder[:, None])
    ends = np.cumsum(sizes, axis=1)
    starts = ends - sizes
    # Member m keeps chunks m and 2R-1-m; the last member's two chunks are adjacent: one segment.
    m = np.arange(ring)
    second = chunks - 1 - m
    first_end = ends[:, m]
    first_end[:, ring - 1] = ends[:, ring]
    seg_start = np.stack([starts[:, m], starts[:, second]], axis=2)  # [docs, ring, 2]
    seg_end = np.stack([first_end, ends[:, second]], axis=2)
    seg_end[:, ring - 1, 1] = seg_start[:, ring - 1, 1]  # the middle member has no second segment
    # Order: member, then document, then its two chunks.
    seg_start, seg_end = seg_start.transpose(1, 0, 2).reshape(-1), seg_end.transpose(1, 0, 2).reshape(-1)
    member = np.repeat(m, 2 * len(docs))
    doc = np.tile(np.repeat(docs, 2), ring)
    return split_streams(member, doc, seg_start, seg_end, ulysses_size, tokens_per_rank), tokens_per_rank


def contiguous_table(doc_lengths: Sequence[int], cp_size: int) -> Tuple[np.ndarray, int]:
    """Segment table and ``tokens_per_rank`` of the packed stream cut into ``cp_size`` equal pieces."""
    lengths = np.asarray(doc_lengths, dtype=np.int64).reshape(-1)
    tokens_per_rank = -(-int(lengths.sum()) // cp_size)
    zeros = np.zeros(len(lengths), dtype=np.int64)
    return split_streams(zeros, np.arange(len(lengths)), zeros, lengths, cp_size, tokens_per_rank), tokens_per_rank


def table_segments(table: np.ndarray, cp_size: int) -> List[List[Segment]]:
    """Per CP rank, its ``(doc, doc_start, doc_end)`` segments in local order."""
    bounds = np.searchsorted(table[:, 0], np.arange(cp_size + 1)).tolist()
    rows = list(zip(*(table[:, k].tolist() for k in (1, 2, 3)))) if len(table) else []
    return [rows[bounds[c]:bounds[c + 1]] for c in range(cp_size)]


def segment_table(rank_segments: Sequence[Sequence[Segment]]) -> np.ndarray:
    """The segment table of per-rank segment lists (inverse of ``table_segments``)."""
    rows = [(c, d, s, e) for c, segments in enumerate(rank_segments) for d, s, e in segments]
    return np.array(rows, dtype=np.int64).reshape(-1, 4)


def zigzag_layout(doc_lengths: Sequence[int], cp_size: int,
                  ulysses_size: int = 1) -> Tuple[List[List[Segment]], int]:
    table, tokens_per_rank = zigzag_table(doc_lengths, cp_size, ulysses_size)
    return table_segments(table, cp_size), tokens_per_rank


def check_table(table: np.ndarray, doc_lengths: Sequence[int], tokens_per_rank: int) -> None:
    """Every token placed exactly once, no rank over capacity: a placement bug must fail loudly, not attend wrongly.

    Segments inside their documents whose packed positions, sorted, tile ``[0, total)`` end to end cover
    every token exactly once."""
    lengths = np.asarray(doc_lengths, dtype=np.int64).reshape(-1)
    doc_starts = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lengths)])
    rank, doc, start, end = table.T
    if len(table) and (np.any(np.diff(rank) < 0) or rank[0] < 0):
        raise AssertionError("layout segment table is not ordered by CP rank")
    load = np.bincount(rank, weights=end - start)
    if np.any(load > tokens_per_rank):
        raise AssertionError(f"layout puts more than tokens_per_rank={tokens_per_rank} tokens on CP rank "
                             f"{int(np.argmax(load > tokens_per_rank))}")
    inside = (doc >= 0) & (doc < len(lengths)) & (start >= 0) & (end > start)
    inside &= end <= lengths[np.where(inside, doc, 0)]
    if not np.all(inside):
        k = int(np.argmin(inside))
        raise AssertionError(f"layout segment {tuple(table[k, 1:].tolist())} is outside document {doc[k]}")
    first = doc_starts[doc] + start
    order = np.argsort(first, kind="stable")
    g_start, g_end = first[order], (doc_starts[doc] + end)[order]
    expected = np.concatenate([np.zeros(1, dtype=np.int64), g_end[:-1]])
    if np.any(g_start != expected) or (g_end[-1] if len(g_end) else 0) != doc_starts[-1]:
        bad = np.flatnonzero(g_start != expected)
        position = int(expected[bad[0]]) if len(bad) else int(g_end[-1] if len(g_end) else 0)
        d = min(int(np.searchsorted(doc_starts, position, side="right")) - 1, len(lengths) - 1)
        while d > 0 and lengths[d] == 0 and doc_starts[d] == position:
            d -= 1
        raise AssertionError(f"layout does not cover document {d} exactly once at token {position - doc_starts[d]}")


def check_layout(rank_segments: Sequence[Sequence[Segment]], doc_lengths: Sequence[int], tokens_per_rank: int) -> None:
    """``check_table`` on per-rank segment lists."""
    check_table(segment_table(rank_segments), doc_lengths, tokens_per_rank)
