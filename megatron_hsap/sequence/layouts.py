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

Segment = Tuple[int, int, int]  # (doc_index, doc_start, doc_end): tokens [doc_start, doc_end) of one document


def zigzag_layout(doc_lengths: Sequence[int], cp_size: int,
                  ulysses_size: int = 1) -> Tuple[List[List[Segment]], int]:
    if cp_size < 1 or ulysses_size < 1 or cp_size % ulysses_size:
        raise ValueError(f"cp_size={cp_size} must be a positive multiple of ulysses_size={ulysses_size}")
    ring = cp_size // ulysses_size
    chunks = 2 * ring
    tokens_per_rank = -(-sum(doc_lengths) // cp_size)
    streams: List[List[Segment]] = [[] for _ in range(ring)]
    # Chunk receiving the t-th remainder token in round-robin order: the first chunks of members
    # 0..R-1, then their second chunks, so any run of R consecutive remainders reaches every member once.
    order = list(range(ring)) + [chunks - 1 - m for m in range(ring)]
    turn = 0
    for doc, length in enumerate(doc_lengths):
        if length == 0:
            continue
        if ring == 1:
            streams[0].append((doc, 0, length))
            continue
        base, remainder = divmod(length, chunks)
        sizes = [base] * chunks
        for t in range(turn, turn + remainder):
            sizes[order[t % chunks]] += 1
        turn = (turn + remainder) % chunks
        starts = [0] * (chunks + 1)
        for c in range(chunks):
            starts[c + 1] = starts[c] + sizes[c]
        for m in range(ring):
            for c in (m, chunks - 1 - m):
                if sizes[c]:
                    streams[m].append((doc, starts[c], starts[c + 1]))
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
