"""Token layouts: which tokens of a packed batch each CP rank holds.

A layout maps document lengths to, per CP rank, a list of ``(doc_index, doc_start,
doc_end)`` segments in local order; every rank holds ``tokens_per_rank`` slots, the
slots after its segments being padding (zero output, zero gradient, masked loss).

- ``zigzag``: per document, TE-style: the document is padded to a multiple of 2C
  and cut into 2C equal chunks, rank r keeping chunks r and 2C-1-r (balances causal
  work per document, moves every document across every rank). Padding per document
  is ``ceil(L / 2C) * 2C - L`` tokens; it is gathered at the end of each rank's slots.
- ``contiguous``: the packed stream cut into C equal pieces (tail padding only).
- ``sequence-aware``: documents placed by cost, see ``placement.py``.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

Segment = Tuple[int, int, int]  # (doc_index, doc_start, doc_end): tokens [doc_start, doc_end) of one document


def zigzag_layout(doc_lengths: Sequence[int], cp_size: int) -> Tuple[List[List[Segment]], int]:
    chunks = 2 * cp_size
    rank_segments: List[List[Segment]] = [[] for _ in range(cp_size)]
    tokens_per_rank = 0
    for doc, length in enumerate(doc_lengths):
        if length == 0:
            continue
        chunk = -(-length // chunks)
        tokens_per_rank += 2 * chunk
        for rank in range(cp_size):
            for index in (rank, chunks - 1 - rank):
                start, end = index * chunk, min((index + 1) * chunk, length)
                if end > start:
                    rank_segments[rank].append((doc, start, end))
    return rank_segments, tokens_per_rank


def contiguous_layout(doc_lengths: Sequence[int], cp_size: int) -> Tuple[List[List[Segment]], int]:
    total = sum(doc_lengths)
    tokens_per_rank = -(-total // cp_size)
    rank_segments: List[List[Segment]] = [[] for _ in range(cp_size)]
    rank, used = 0, 0
    for doc, length in enumerate(doc_lengths):
        start = 0
        while start < length:
            take = min(length - start, tokens_per_rank - used)
            rank_segments[rank].append((doc, start, start + take))
            start += take
            used += take
            if used == tokens_per_rank:
                rank, used = rank + 1, 0
    return rank_segments, tokens_per_rank


def check_layout(rank_segments: Sequence[Sequence[Segment]], doc_lengths: Sequence[int], tokens_per_rank: int) -> None:
    """Every token placed exactly once, no rank over capacity: a placement bug must fail loudly, not attend wrongly."""
    covered = [[] for _ in doc_lengths]
    for rank, segments in enumerate(rank_segments):
        if sum(e - s for _, s, e in segments) > tokens_per_rank:
            raise AssertionError(f"layout puts more than tokens_per_rank={tokens_per_rank} tokens on CP rank {rank}")
        for doc, start, end in segments:
            if not (0 <= start < end <= doc_lengths[doc]):
                raise AssertionError(f"layout segment {(doc, start, end)} is outside document {doc}")
            covered[doc].append((start, end))
    for doc, pieces in enumerate(covered):
        pieces.sort()
        position = 0
        for start, end in pieces:
            if start != position:
                raise AssertionError(f"layout does not cover document {doc} exactly once at token {position}")
            position = end
        if position != doc_lengths[doc]:
            raise AssertionError(f"layout covers document {doc} up to {position} of {doc_lengths[doc]} tokens")
