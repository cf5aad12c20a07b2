"""Token layouts: which tokens of a packed batch each CP rank holds.

A layout maps document lengths to, per CP rank, a list of ``(doc_index, doc_start,
doc_end)`` segments in local order; every rank holds ``tokens_per_rank`` slots, the
slots after its segments being padding (zero output, zero gradient, masked loss).

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

from typing import List, Sequence, Tuple

import torch

Segment = Tuple[int, int, int]  # (doc_index, doc_start, doc_end): tokens [doc_start, doc_end) of one document


def zigzag_layout(doc_lengths: Sequence[int], cp_size: int,
                  ulysses_size: int = 1) -> Tuple[List[List[Segment]], int]:
    if cp_size < 1 or ulysses_size < 1 or cp_size % ulysses_size:
        raise ValueError(f"cp_size={cp_size} must be a positive multiple of ulysses_size={ulysses_size}")
    ring = cp_size // ulysses_size
    chunks = 2 * ring
    tokens_per_rank = -(-sum(doc_lengths) // cp_size)
    docs = [d for d, n in enumerate(doc_lengths) if n > 0]
    if not docs:
        streams: List[List[Segment]] = [[] for _ in range(ring)]
    elif ring == 1:
        streams = [[(d, 0, doc_lengths[d]) for d in docs]]
    else:
        # Vectorised over documents: chunk sizes [docs, 2R], then each member's two chunks per document.
        lengths = torch.tensor([doc_lengths[d] for d in docs], dtype=torch.int64)
        base, remainder = lengths // chunks, lengths % chunks
        turn = (torch.cumsum(remainder, 0) - remainder) % chunks  # round-robin position of the first remainder
        # Slot of chunk c in the round-robin order: the first chunks of members 0..R-1, then their second
        # chunks, so any run of R consecutive remainder tokens reaches every member once.
        slot = torch.tensor([c if c < ring else 3 * ring - 1 - c for c in range(chunks)], dtype=torch.int64)
        sizes = base[:, None] + (((slot[None, :] - turn[:, None]) % chunks) < remainder[:, None]).to(torch.int64)
        ends = torch.cumsum(sizes, 1)
        bounds = torch.cat([ends - sizes, ends], 1).tolist()  # per document: starts of the 2R chunks, then ends
        streams = []
        for m in range(ring - 1):
            first, second = m, chunks - 1 - m
            streams.append([seg for d, row in zip(docs, bounds)
                            for seg in ((d, row[first], row[chunks + first]), (d, row[second], row[chunks + second]))
                            if seg[2] > seg[1]])
        middle = ring - 1  # the last member's two chunks are adjacent: one segment
        streams.append([(d, row[middle], row[chunks + middle + 1]) for d, row in zip(docs, bounds)
                        if row[chunks + middle + 1] > row[middle]])
    out: List[List[Segment]] = []
    for stream in streams:
        out.extend(split_member_stream(stream, ulysses_size, tokens_per_rank))
    return out, tokens_per_rank


def split_member_stream(stream: Sequence[Segment], ulysses_size: int, tokens_per_rank: int) -> List[List[Segment]]:
    """Cut a ring member's segments (in buffer order) into ``ulysses_size`` consecutive ranks of at most
    ``tokens_per_rank`` tokens each: after the all-to-all the member buffer is the stream again."""
    ranks: List[List[Segment]] = []
    pos, offset = 0, 0  # next segment, tokens of it already given out
    for _ in range(ulysses_size):
        rank: List[Segment] = []
        need = tokens_per_rank
        while need and pos < len(stream):
            doc, s, e = stream[pos]
            s += offset
            take = min(need, e - s)
            rank.append((doc, s, s + take))
            need -= take
            if s + take == e:
                pos, offset = pos + 1, 0
            else:
                offset += take
        ranks.append(rank)
    if pos < len(stream):
        raise AssertionError(f"member stream does not fit {ulysses_size} ranks of {tokens_per_rank} tokens")
    return ranks


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
    pieces: List[Segment] = []
    for rank, segments in enumerate(rank_segments):
        if sum(e - s for _, s, e in segments) > tokens_per_rank:
            raise AssertionError(f"layout puts more than tokens_per_rank={tokens_per_rank} tokens on CP rank {rank}")
        pieces.extend(segments)
    pieces.sort()
    doc, position = -1, 0
    for piece in pieces:
        d, start, end = piece
        if d != doc:
            _check_finished(doc, position, doc_lengths, d)
            doc, position = d, 0
        if not (0 <= start < end <= doc_lengths[d]):
            raise AssertionError(f"layout segment {piece} is outside document {d}")
        if start != position:
            raise AssertionError(f"layout does not cover document {d} exactly once at token {position}")
        position = end
    _check_finished(doc, position, doc_lengths, len(doc_lengths))


def _check_finished(doc: int, position: int, doc_lengths: Sequence[int], next_doc: int) -> None:
    """Document ``doc`` covered up to its length, and every document before ``next_doc`` after it empty."""
    if doc >= 0 and position != doc_lengths[doc]:
        raise AssertionError(f"layout covers document {doc} up to {position} of {doc_lengths[doc]} tokens")
    for skipped in range(doc + 1, min(next_doc, len(doc_lengths))):
        if doc_lengths[skipped]:
            raise AssertionError(f"layout covers document {skipped} up to 0 of {doc_lengths[skipped]} tokens")
