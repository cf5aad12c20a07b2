"""Sequence-aware placement: which tokens of which documents each CP rank holds.

Inside a ring member (one Ulysses group) the all-to-all gathers all of the member's
tokens for each head group, so only a member's total cost matters; between members
(and above all between nodes) every split document costs key/value traffic. The
placement is a recursive bisection over the hierarchy -- halves of the nodes, down to
single nodes, then each node's items shared among its members in one pass (``_shared``; a node of
short documents only by counts of documents per length, ``whole_shares``; where that misses a member's target,
halves of the node's members, down to single members) --
followed by cutting each member's token stream into equal contiguous parts for its Ulysses
ranks. docs/sequence_aware.md has the full argument; in short, one bisection:

1. Both sides have an exact token capacity (only the last bins hold tail padding) and
   an attention target (an equal share of the attention per bin, within what its tokens can carry:
   ``_attention_targets``).
2. Items (documents, or pieces of documents at lower levels) are taken by decreasing
   density (area per token; for whole documents, by decreasing length). The items not
   placed yet are then always the sparsest ones, so the least and the largest area that
   ``r`` more tokens of a side can still receive are prefix sums (``_Pool``): a side is
   *feasible* while its missing area lies between them.
3. A heavy item goes whole to a side that stays feasible (the one needing the denser
   filling). If neither does, it is cut: one side takes its tail ``[x, L)`` with the
   smallest ``x`` that keeps that side feasible, the other side the head ``[0, x)``.
   The head's holder is the only one needing the other's keys, exactly ``x`` rows
   (the horizon formula: a split document moves, over all holders but the one holding
   its last token, the sum of their last position + 1), so the smallest ``x`` is the
   cheapest cut.
4. The light items (each a small part of a side's area) are dealt as one window of the
   density order: the left side takes a run of whole items whose area matches its
   missing area, and the token gap left at the end of the run is closed with the
   shortest items (a light item is cut only when no combination of short ones fits).
5. Between nodes a bisection of few items first tries every subset of whole items for the left
   side, with at most one cut, and keeps the one moving the fewest rows (``_exhaustive_bisection``):
   the greedy steps cut at the cheapest cut *given the items placed so far*, which leaves a side at
   the edge of feasibility and forces further cuts. A larger bisection between nodes that the greedy
   steps cut is searched again the same way over the documents they cut, the heaviest and the
   shortest items (``_reopened``), kept when it moves fewer rows.
6. Between 3 or 4 nodes a bisection that cut a document is weighed with the bisections between nodes below it:
   splits with a second cut (a long document's head as sparse filler on one side, its rest on the other), the
   same bisection with shorter pieces for the sides without the cut documents' last tokens, and other splits of
   step 5's search, are planned down to single nodes and the one moving the fewest rows in all is kept
   (``_lookahead``).

A bisection's items are numpy arrays (``_Items``: one row per document; only pieces of cut documents carry ranges)
and the steps over many items are numpy operations, with the per-item rules' results exactly (docs/sequence_aware.md,
"Items in bulk"); heavy items and cuts are handled one by one (``_Item``).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from itertools import chain, zip_longest
from operator import attrgetter
from typing import Callable, Collection, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple, Union

import numpy as np

from megatron_hsap.sequence.cost_model import CostModel, causal_area
from megatron_hsap.sequence.layouts import Segment, split_streams, table_segments
from megatron_hsap.sequence.placement_config import PlacementConfig
from megatron_hsap.sequence.whole_shares import share_whole

__all__ = ["sequence_aware_placement", "sequence_aware_table"]

Ranges = Tuple[Tuple[int, int], ...]  # disjoint, increasing in-document ranges of one document
_doc_of = attrgetter("doc")

# The tuning constants and targets are fields of ``PlacementConfig`` (placement_config.py), documented there and in
# docs/sequence_aware.md.


class _Item:
    """Some tokens of one document (``ranges``, increasing), seen as one stream of ``length`` tokens."""

    __slots__ = ("doc", "ranges", "length", "area", "_offsets", "_areas")

    def __init__(self, doc: int, ranges: Ranges) -> None:
        self.doc = doc
        self.ranges = ranges
        if len(ranges) == 1:
            s, e = ranges[0]
            self.length, self.area = e - s, causal_area(s, e)
            self._offsets = None
        else:
            offsets, areas = [0], [0]
            for s, e in ranges:  # (causal_area(s, e) written out: each range holds tokens)
                offsets.append(offsets[-1] + e - s)
                areas.append(areas[-1] + (e - s) * (s + e + 1) // 2)
            self.length, self.area = offsets[-1], areas[-1]
            self._offsets, self._areas = offsets, areas

    @classmethod
    def whole(cls, doc: int, length: int) -> "_Item":
        """Document ``doc`` whole (``length > 0``), as ``_Item(doc, ((0, length),))``, without the general path."""
        return cls.one(doc, 0, length)

    @classmethod
    def one(cls, doc: int, start: int, end: int) -> "_Item":
        """Tokens ``[start, end)`` of document ``doc`` (``end > start``), as ``_Item(doc, ((start, end),))``, without
        the general path (the pieces cut inside a node are many)."""
        it = cls.__new__(cls)
        it.doc, it.ranges, it.length, it._offsets = doc, ((start, end),), end - start, None
        it.area = (end - start) * (start + end + 1) // 2  # causal_area(start, end)
        return it

    @property
    def simple(self) -> bool:
        """Whether the item is its document's first ``length`` tokens (what ``_Items`` holds without ranges)."""
        return len(self.ranges) == 1 and self.ranges[0][0] == 0

    def area_before(self, offset: int) -> int:
        """Causal area of the first ``offset`` tokens of the stream."""
        # causal_area(s, s + t) for t >= 0 written out: t * (2 * s + t + 1) // 2 (a planning step's innermost call)
        if offset <= 0:
            return 0
        if offset > self.length:
            offset = self.length
        if self._offsets is None:
            s = self.ranges[0][0]
            return offset * (2 * s + offset + 1) // 2
        j = bisect.bisect_right(self._offsets, offset) - 1
        if j >= len(self.ranges):
            return self.area
        s, t = self.ranges[j][0], offset - self._offsets[j]
        return self._areas[j] + t * (2 * s + t + 1) // 2

    def end_position(self, offset: int) -> int:
        """In-document position after the stream's first ``offset`` tokens (a piece ending there moves that many
        rows to the holder of the document's last token)."""
        for s, e in self.ranges:
            if offset <= e - s:
                return s + offset
            offset -= e - s
        return self.ranges[-1][1]

    def outside(self, lo: int, hi: int) -> Ranges:
        """The ranges of the stream outside offsets ``[lo, hi)``: its head and tail, one item (one per document)."""
        if self._offsets is None:  # one range: written out
            s, e = self.ranges[0]
            head, tail = min(lo, e - s), max(hi, 0)
            return ((((s, s + head),) if head > 0 else ()) + (((s + tail, e),) if tail < e - s else ()))
        return self.sub(0, lo).ranges + self.sub(hi, self.length).ranges

    def sub(self, lo: int, hi: int) -> "_Item":
        """The item made of stream offsets ``[lo, hi)``."""
        if self._offsets is None:  # one range: written out
            s, e = self.ranges[0]
            a, b = s + max(lo, 0), s + min(hi, e - s)
            return _Item.one(self.doc, a, b) if b > a else _Item(self.doc, ())
        out, pos = [], 0
        for s, e in self.ranges:
            a, b = max(lo, pos), min(hi, pos + e - s)
            if b > a:
                out.append((s + a - pos, s + b - pos))
            pos += e - s
        return _Item(self.doc, tuple(out))


def _first_tokens_area(tau: int) -> int:
    """Causal area of a document's first ``tau`` tokens (``tau >= 0``)."""
    return tau * (tau + 1) // 2


def _areas_before(items: Sequence[_Item], which: np.ndarray, taus: np.ndarray) -> np.ndarray:
    """``items[which[i]].area_before(taus[i])`` for every i at once (float64: exact below 2**53): the items'
    ranges in one table keyed by (item, stream offset), one search for all queries; items of one range each (the
    usual case) without the search, by the same formula."""
    if all(it._offsets is None for it in items):
        a = np.array([it.ranges[0][0] for it in items], dtype=np.float64)[which]
        return taus * (a + (a + taus) + 1) / 2  # (b - a) * (a + b + 1) / 2 with b = a + taus, as below
    owner, offsets, starts, prefix = [], [], [], []
    for k, it in enumerate(items):
        offset, area = 0, 0
        for s, e in it.ranges:
            owner.append(k)
            offsets.append(offset)
            starts.append(s)
            prefix.append(area)
            offset += e - s
            area += causal_area(s, e)
    scale = float(1 << 40)  # above any stream offset: (item, offset) keys sort by item, then offset
    keys = np.array(owner, dtype=np.float64) * scale + np.array(offsets, dtype=np.float64)
    j = keys.searchsorted(which * scale + taus, side="right") - 1
    a = np.array(starts, dtype=np.float64)[j]
    b = a + (taus - np.array(offsets, dtype=np.float64)[j])
    return np.array(prefix, dtype=np.float64)[j] + (b - a) * (a + b + 1) / 2


class _Items:
    """Items (one per document) as arrays: what a bisection takes and returns, so that the many short documents
    of a batch never become Python objects. ``doc`` / ``length`` / ``area``: int64 ``[n]`` (area: causal pairs);
    ``pieces``: the ranges of the items that are not their document's first ``length`` tokens (cut above), by
    document (a superset is fine: only the documents present are read)."""

    __slots__ = ("doc", "length", "area", "pieces")

    def __init__(self, doc: np.ndarray, length: np.ndarray, area: np.ndarray, pieces: Dict[int, Ranges]) -> None:
        self.doc, self.length, self.area, self.pieces = doc, length, area, pieces

    @classmethod
    def of(cls, items: Sequence[_Item]) -> "_Items":
        n = len(items)
        return cls(np.fromiter((it.doc for it in items), np.int64, n),
                   np.fromiter((it.length for it in items), np.int64, n),
                   np.fromiter((it.area for it in items), np.int64, n),
                   {it.doc: it.ranges for it in items if not it.simple})

    def __len__(self) -> int:
        return len(self.doc)

    def __iter__(self) -> Iterator[_Item]:
        return iter(self.items())

    def total_area(self) -> int:
        return int(np.add.reduce(self.area))  # (the ufunc: no Python wrapper, many small groups)

    def item(self, k: int) -> _Item:
        doc = int(self.doc[k])
        ranges = self.pieces.get(doc)
        return _Item.whole(doc, int(self.length[k])) if ranges is None else _Item(doc, ranges)

    def items(self) -> List[_Item]:
        return [self.item(k) for k in range(len(self))]

    def take(self, index: np.ndarray) -> "_Items":
        return _Items(self.doc[index], self.length[index], self.area[index], self.pieces)

    def ranged(self) -> List[Tuple[int, int, Ranges]]:
        """(position, document, ranges) of the items that are not their document's first ``length`` tokens, by
        position."""
        pieces = self.pieces
        if not pieces:
            return []
        if len(self.doc) <= _SCANNED:  # (one dict lookup each, no numpy calls)
            return [(k, d, pieces[d]) for k, d in enumerate(self.doc.tolist()) if d in pieces]
        at = _among(self.doc, pieces).nonzero()[0]
        return [(k, d, pieces[d]) for k, d in zip(at.tolist(), self.doc[at].tolist())]

    def ends(self) -> np.ndarray:
        """In-document position after each item's last token."""
        ends = self.length.copy()
        for k, _, ranges in self.ranged():
            ends[k] = ranges[-1][1]
        return ends

    def by_density(self) -> "_Items":
        """Sorted by decreasing density (area per token, on an integer scale: deterministic), then document."""
        key = -((self.length + 1) << 19)  # -area * 2**20 // length, exactly, for a document's first tokens
        pieces = {}
        for k, d, ranges in self.ranged():  # (only the pieces present are kept)
            key[k] = -int(self.area[k]) * (1 << 20) // int(self.length[k])
            pieces[d] = ranges
        # Groups come mostly sorted already (a side receives its items in its parent's order): a stable sort by
        # density is the (density, document) order unless it leaves equal densities out of document order.
        order = key.argsort(kind="stable")
        ordered, doc = key[order], self.doc[order]
        if ((ordered[1:] == ordered[:-1]) & (doc[1:] < doc[:-1])).any():
            order = np.lexsort((self.doc, key))
            doc = self.doc[order]
        return _Items(doc, self.length[order], self.area[order], pieces)


#: Arrays of at most this many values are scanned with one Python loop (``_among``, ``_Items.ranged``): numpy's
#: setup costs more there. A speed threshold, the results are the same.
_SCANNED = 48
#: ... and at most this many with a search in the sorted keys (``_among``), more with ``np.isin`` (faster there).
_SEARCHED = 4096


def _among(values: np.ndarray, keys: Collection[int]) -> np.ndarray:
    """``np.isin(values, keys)`` (bool, like ``values``), cheaply for few keys or values: a short batch's
    bisections are many and small, where np.isin's setup would cost more than the rest of the bisection."""
    if len(keys) <= 2:
        mask = np.zeros(len(values), dtype=bool)
        for key in keys:
            mask |= values == key
        return mask
    if len(values) <= _SCANNED:
        keys = keys if isinstance(keys, (dict, set, frozenset)) else set(keys)  # (a dict's keys are a set already)
        return np.fromiter((v in keys for v in values.tolist()), bool, len(values))
    if len(values) > _SEARCHED:
        return np.isin(values, list(keys))
    ordered = np.fromiter(keys, np.int64, len(keys))
    ordered.sort()  # (a search in the sorted keys: less setup than np.isin)
    return ordered[np.minimum(ordered.searchsorted(values), len(ordered) - 1)] == values


def _as_items(items: Union[_Items, Sequence[_Item]]) -> _Items:
    return items if isinstance(items, _Items) else _Items.of(items)


def _concat(parts: Sequence[_Items], pieces: Dict[int, Ranges]) -> _Items:
    return _Items(*(np.concatenate([getattr(p, f) for p in parts]) if parts else np.zeros(0, dtype=np.int64)
                    for f in ("doc", "length", "area")), pieces)


class _Pool:
    """Items sorted by decreasing density; the unplaced ones are always a suffix ``items[i:]`` (``items[sel]``
    of the bisection's sorted items).

    ``least(i, r)`` / ``most(i, r)``: the smallest / largest area that ``r`` tokens taken from
    ``items[i:]`` can carry (items cut where needed, at their mean density): prefix sums and a bisection.
    Prefix sums and the items' figures are numpy arrays, or Python lists (``as_lists``) for the one-by-one
    placement of many items; the scalar figures are read as Python ints either way (exact products).
    """

    def __init__(self, items: _Items, sel: np.ndarray) -> None:
        self.items, self.sel = items, sel
        self.lengths, self.item_areas = items.length[sel], items.area[sel]
        self.tokens, self.areas = np.zeros(len(sel) + 1, dtype=np.int64), np.zeros(len(sel) + 1, dtype=np.int64)
        self.lengths.cumsum(out=self.tokens[1:])
        self.item_areas.cumsum(out=self.areas[1:])
        # Kept as numpy for the bulk steps.
        self.length_array, self.item_area_array, self.token_array = self.lengths, self.item_areas, self.tokens
        self.listed = False

    def as_lists(self) -> None:
        self.tokens, self.areas = self.tokens.tolist(), self.areas.tolist()
        self.lengths, self.item_areas = self.lengths.tolist(), self.item_areas.tolist()
        self.listed = True

    def __len__(self) -> int:
        return len(self.sel)

    def item(self, i: int) -> _Item:
        return self.items.item(int(self.sel[i]))

    def search(self, tokens: int, side: str) -> int:
        """Where ``tokens`` goes in the prefix token counts (``np.searchsorted``'s ``side``)."""
        if self.listed:
            return (bisect.bisect_left if side == "left" else bisect.bisect_right)(self.tokens, tokens)
        return int(self.token_array.searchsorted(tokens, side))

    def size(self, i: int) -> int:
        return self.tokens[-1] - self.tokens[i]

    def _area_upto(self, position: int) -> float:
        """Area of the first ``position`` tokens of the whole density order."""
        tokens, areas = self.tokens, self.areas
        if self.listed:
            j = bisect.bisect_right(tokens, position) - 1
            if j == len(tokens) - 1:
                return float(areas[-1])
            return areas[j] + (position - tokens[j]) * self.item_areas[j] / self.lengths[j]
        j = int(tokens.searchsorted(position, "right")) - 1
        if j == len(self.sel):
            return float(areas[-1])
        # numpy scalars: as Python ints, whose products do not overflow.
        return int(areas[j]) + (int(position) - int(tokens[j])) * int(self.item_areas[j]) / int(self.lengths[j])

    def most(self, i: int, r: int) -> float:
        return self._area_upto(self.tokens[i] + r) - self.areas[i]

    def least(self, i: int, r: int) -> float:
        return self.areas[-1] - self._area_upto(self.tokens[-1] - r)


def _attention_targets(caps: Sequence[int], total_area: int, lengths: np.ndarray) -> List[float]:
    """Attention area per bin: equal on every bin (the attention target is on attention alone), except that a bin
    never gets more than its ``caps[b]`` tokens can carry (``_densest_area``; a bin of no tokens gets none), the
    rest being shared equally by the others (water-filling).

    A padded bin thus holds the same attention as a full one on fewer tokens: denser, i.e. longer, documents or
    pieces. Tail padding is less than one token per CP rank, so the linear work it saves is not given back as
    attention (which would break the attention target; docs/sequence_aware.md, "Cost model").
    """
    bins = len(caps)
    if min(caps, default=0) == max(caps, default=0):  # nothing padded: one equal share each
        return [total_area / bins if caps[0] > 0 else 0.0] * bins
    reach = {c: _densest_area(lengths, c) for c in set(caps)}
    targets = [0.0] * bins
    left, open_bins = float(total_area), bins
    for b in sorted(range(bins), key=lambda b: reach[caps[b]]):  # the least reach first: bound, or all equal
        targets[b] = min(reach[caps[b]], left / open_bins)
        left, open_bins = left - targets[b], open_bins - 1
    return targets


def _densest_area(lengths: np.ndarray, tokens: int) -> float:
    """The most attention area ``tokens`` tokens of the batch can hold: the sum of its ``tokens`` largest token
    densities (a token at position ``p`` of a document attends to ``p + 1`` keys), i.e. the tail pieces of the
    longest documents. An upper bound for any placement, reached by cutting those pieces off."""
    if tokens <= 0:
        return 0.0
    at_least = np.cumsum(np.bincount(lengths)[::-1])[::-1][1:]  # [v - 1]: tokens of density v = documents >= v long
    density = np.arange(len(at_least), 0, -1, dtype=np.int64)  # densest first
    count = at_least[::-1]
    upto = np.cumsum(count)
    k = int(np.searchsorted(upto, tokens))  # the density class holding the last of the `tokens` densest
    if k >= len(upto):
        return float(int((count * density).sum()))
    before = int(upto[k - 1]) if k else 0
    return float(int((count[:k] * density[:k]).sum()) + (tokens - before) * int(density[k]))


def _horizon_for(item: _Item, tau: int, area: float, head: Optional[int] = None) -> Optional[int]:
    """Smallest stream offset ``x`` such that the ``tau`` tokens ending at ``x`` carry at least ``area``
    (``head``: ``item.area_before(tau)`` where the caller has it).

    The window's area ``W(x) = area_before(x) - area_before(x - tau)`` grows by ``density(x) - density(x - tau)``
    per token, a constant while both ends stay inside one range (a token's density is its position + 1): ``W``
    is piecewise linear with at most ``2 * len(ranges)`` pieces, so one walk over them finds ``x`` exactly.
    """
    if tau == 0:
        return 0 if area <= 0 else None
    x, window = tau, item.area_before(tau) if head is None else head
    if window >= area:
        return x
    ranges, n = item.ranges, item.length
    if len(ranges) == 1:  # one piece: W grows by tau per token up to the end
        return x + _steps(window, tau, area) if window + tau * (n - x) >= area else None
    i = j = 0  # the ranges holding stream tokens x - tau (i) and x (j); o_i, o_j: their first offsets
    o_i = o_j = 0
    while x < n:
        while x >= o_j + ranges[j][1] - ranges[j][0]:
            o_j += ranges[j][1] - ranges[j][0]
            j += 1
        while x - tau >= o_i + ranges[i][1] - ranges[i][0]:
            o_i += ranges[i][1] - ranges[i][0]
            i += 1
        end = min(o_j + ranges[j][1] - ranges[j][0], o_i + ranges[i][1] - ranges[i][0] + tau)
        slope = (ranges[j][0] - o_j) - (ranges[i][0] - o_i) + tau
        if window + slope * (end - x) >= area:
            return x + _steps(window, slope, area)
        window += slope * (end - x)
        x = end
    return None


def _pairs_slack(slack: float, targets: Sequence[float]) -> float:
    """How far (causal pairs) a side may end from its target when it may miss it by ``slack`` (a fraction of the
    smallest of ``targets``), plus a rounding margin of the pairs at stake: a bisection's sides, or one bin of a
    node's single pass (``targets`` of one)."""
    return slack * min(targets) + 1e-5 * (sum(targets) + 1.0)


def _steps(window: float, slope: int, area: float) -> int:
    """Fewest tokens ``step >= 1`` with ``window + slope * step >= area`` (``window < area``, ``slope > 0``): the
    ceiling of the quotient, corrected by one where float rounding put it off."""
    step = max(1, math.ceil((area - window) / slope))
    return step - 1 if step > 1 and window + slope * (step - 1) >= area else step + int(window + slope * step < area)


#: A column of a side's items (``_Bisection.sides``): int64 array, or a Python list for a side of few items.
_Column = Union[np.ndarray, List[int]]
#: Light items of a pool of at most this many, and a side of at most this many items, are dealt and assembled with
#: Python lists instead of numpy calls (``_Bisection.place_light``, ``sides``): a speed threshold, the plans are the
#: same (tests/test_placement_bulk.py checks both ways).
_LISTED = 64

#: What a side receives, in order: an index (into the bisection's sorted items) or an index array of items placed
#: whole, or a piece cut here.
_Entry = Union[int, np.ndarray, _Item]


def _subtract_all(value: float, areas: np.ndarray) -> float:
    """``value`` minus each of ``areas`` in turn, rounded after every step as ``value -= area`` would be (a
    ufunc's accumulate is sequential: the same float bookkeeping as one subtraction per item)."""
    if len(areas) <= 32:
        for area in areas.tolist():
            value -= area
        return value
    steps = np.empty(len(areas) + 1, dtype=np.float64)
    steps[0], steps[1:] = value, areas
    return float(np.subtract.accumulate(steps)[-1])


class _Bisection:
    """Two sides (0 = left, 1 = right) filled from one pool; see the module docstring."""

    def __init__(self, items: Union[_Items, Sequence[_Item]], rooms: Tuple[int, int], targets: Tuple[float, float],
                 config: PlacementConfig, between_nodes: bool, slack: Optional[float] = None,
                 cap: Optional[int] = None) -> None:
        self.config = config
        self.cap = cap  # the most tokens a heavy item's cut gives the side without its last token (None: any)
        self.rounds = config.rounds_between_nodes if between_nodes else config.rounds_inside_node
        self.items = _as_items(items).by_density()
        self.pool = _Pool(self.items, np.arange(len(self.items)))
        self.room = list(rooms)
        self.missing = [float(t) for t in targets]
        self.out: List[List[_Entry]] = [[], []]
        self.cut: set = set()  # documents cut here: the only ones of which a side can hold several pieces
        self._columns: Optional[Tuple[List[int], List[int], List[int]]] = None  # the items' columns as lists (sides)
        # A side may end this far from its target (``slack``: a fraction of the smaller side's target, default
        # ``config.slack``): documents are not cut for a smaller gain.
        self._slack = _pairs_slack(config.slack if slack is None else slack, targets)
        self.slack_read = False

    @property
    def slack(self) -> float:
        """How far a side may end from its target (pairs); reading it marks the bisection as depending on it
        (``slack_read``: a bisection that never read it splits its items the same way under any slack)."""
        self.slack_read = True
        return self._slack

    def put(self, side: int, entries: Sequence[_Entry]) -> None:
        """Give ``entries`` (in order: a side's float bookkeeping is the same however its items are batched)."""
        out, room, missing = self.out[side], self.room[side], self.missing[side]
        items = self.items
        for e in entries:
            if isinstance(e, _Item):
                if e.length:
                    out.append(e)
                    room -= e.length
                    missing -= e.area
            elif isinstance(e, np.ndarray):
                if len(e):
                    out.append(e)
                    room -= int(np.add.reduce(items.length[e]))
                    missing = _subtract_all(missing, items.area[e])
            else:
                out.append(e)
                room -= int(items.length[e])
                missing -= int(items.area[e])
        self.room[side], self.missing[side] = room, missing

    def place_heavy(self, end: int, short: int) -> List[int]:
        """Place heavy items ``0 .. end - 1`` in turn, each whole or cut; returns the ones left to the light phase
        (which fills rooms without cutting): those that would be cut but have at most ``short`` tokens.

        The densest item left goes to the side whose remaining room needs the denser filling if that side stays
        *feasible* after it: the side's missing area within the slack of the least and the most area the items
        after it can give its remaining room (``_Pool.least`` / ``_Pool.most``); else to the other side if that
        one stays feasible; else it is cut (``_cut_heavy``). The test is written out in the loop, one Python
        call per item instead of a dozen: batches of short documents have tens of thousands of heavy items."""
        pool, room, missing, out = self.pool, self.room, self.missing, self.out
        lengths, item_areas, upto = pool.lengths, pool.item_areas, pool._area_upto
        tokens, areas = pool.tokens, pool.areas
        last_tokens, last_area = tokens[-1], areas[-1]
        slack = self.slack if end else 0.0
        deferred = []
        for i in range(end):
            length, area = lengths[i], item_areas[i]
            if not pool.listed:
                length, area = int(length), int(area)
            (m0, m1), (r0, r1) = missing, room
            for side in ((0, 1) if (m0 / r0 if r0 else 0.0) >= (m1 / r1 if r1 else 0.0) else (1, 0)):
                r = room[side] - length  # the side's room after the item, filled from items i + 1 ..
                if r < 0 or r > last_tokens - tokens[i + 1]:
                    continue
                need = missing[side] - area
                # pool.least(i + 1, r) - slack <= need <= pool.most(i + 1, r) + slack
                if last_area - upto(last_tokens - r) - slack <= need <= upto(tokens[i + 1] + r) - areas[i + 1] + slack:
                    out[side].append(i)  # the first pool's positions are the sorted items' indices
                    room[side] -= length
                    missing[side] -= area
                    break
            else:
                if length <= short:
                    deferred.append(i)
                else:
                    self._cut_heavy(i)
        return deferred

    def _cut_heavy(self, i: int) -> None:
        """Cut heavy item ``i``, which fits neither side whole: one side takes the piece that moves the fewest
        rows (``_cheapest_cut``), the other the rest."""
        item = self.pool.item(i)
        best = None
        for holder in (0, 1):  # the side that will not hold the item's last token
            cut = self._cheapest_cut(holder, i + 1, item, best[0] if best and self.rounds == 1 else None)
            if cut is not None and (best is None or cut[0] < best[0]):
                best = cut + (holder,)
        if best is None:  # numerically at the edge: the side lacking more area takes the longest tail it has room for
            side = max((0, 1), key=lambda s: (self.missing[s] - self.pool.least(i + 1, self.room[s]), -s))
            x = max(0, item.length - self.room[side])
            best = (x, x, 1 - side)
        horizon, tau, holder = best
        p = horizon - tau  # the piece ends at the horizon: the densest tau tokens below it
        self.cut.add(item.doc)
        self.put(holder, (item.sub(p, p + tau),))
        self.put(1 - holder, (item.sub(0, p), item.sub(p + tau, item.length)))

    def _cheapest_cut(self, holder: int, i: int, item: _Item, beat: Optional[int]) -> Optional[Tuple[int, int]]:
        """Cut of ``item`` giving ``holder`` a piece ``[p, p + tau)`` and the other side the rest (with the last
        token), feasible for both sides, with the smallest horizon ``p + tau`` (= key/value rows moved).
        Returns (horizon, tau) or None. ``beat``: only a horizon below it is wanted (the other holder's), so a
        single scan (refinements are centred on the best tau found: they need all of the first scan) stops there.

        For a given ``tau`` the piece's area can be anything between its head ``[0, tau)`` and the ``tau``
        tokens ending at the horizon, so the horizon needed is the smallest one whose densest piece reaches
        the least area that keeps ``holder`` feasible (prefix division). The horizon is not monotone in
        ``tau``: a coarse scan and (between nodes) two refinements, each ``tau`` evaluated once.
        """
        n, pool, room = item.length, self.pool, self.room[holder]
        lo = max(0, n - self.room[1 - holder], room - pool.size(i))
        hi = min(n, room) if self.cap is None else min(n, room, self.cap)
        if lo > hi:
            return None
        missing, slack = self.missing[holder], self.slack
        area_before, upto = item.area_before, pool._area_upto
        # pool.least(i, r) and pool.most(i, r) written out below (one call each instead of two)
        last_tokens, last_area = pool.tokens[-1], pool.areas[-1]
        first_tokens, first_area = pool.tokens[i], pool.areas[i]
        start = item.ranges[0][0] if len(item.ranges) == 1 else None  # one piece: its heads without the method
        best, seen = None, set()
        limit = hi + 1 if beat is None else beat  # the horizon is at least tau: no better cut from tau = limit on
        left, right = lo, hi
        for _ in range(self.rounds):
            step = max(1, (right - left) // 8)
            for tau in chain(range(left, right + 1, step), (right,)):
                if tau >= limit:
                    break
                if tau in seen:
                    continue
                seen.add(tau)
                head = area_before(tau) if start is None else tau * (2 * start + tau + 1) // 2
                if head > missing - (last_area - upto(last_tokens - room + tau)) + slack:
                    continue
                need = missing - (upto(first_tokens + room - tau) - first_area)
                x = tau if need <= head else _horizon_for(item, tau, need, head)
                if x is not None and (best is None or (x, tau) < best):
                    best, limit = (x, tau), min(limit, x)
            if best is None or step == 1:
                break
            left, right = max(lo, best[1] - step), min(hi, best[1] + step)
        return best

    def place_light(self, i: int) -> None:
        """Deal ``items[i:]``: the left side takes a run of whole items matching its missing area (step 4), with
        numpy ops over the run (a batch's short documents are many), or, for at most ``_LISTED`` items, Python
        lists (a small bisection's numpy calls would cost more than the rest of it; the same rules and results)."""
        pool, room = self.pool, self.room[0]
        n = len(pool)
        listed = n - i <= _LISTED
        if listed and not pool.listed:
            pool.as_lists()
        sel = pool.sel.tolist() if listed else pool.sel
        if room == 0 or i == n:
            self.put(1, sel[i:] if listed else (sel[i:],))
            return
        if room >= pool.size(i):
            self.put(0, sel[i:] if listed else (sel[i:],))
            return
        lengths, tokens = pool.lengths if listed else pool.length_array, pool.tokens
        taken = [False] * n if listed else np.zeros(n, dtype=bool)
        # The shortest items (2 % of the tokens) are shared in proportion to the rooms: both sides keep short
        # documents for filling their bins exactly at the next level. They are the longest suffix within the
        # share (suffix token counts fall with the start; an int is within a float iff within its floor),
        # leaving at least item i.
        total = pool.size(i)
        t = max(i + 1, pool.search(int(tokens[-1]) - math.floor(self.config.tiny * total), "left"))
        shares0 = shares1 = 0
        room1 = self.room[1]
        tiny_taken = []
        for length in reversed(lengths[t:] if listed else lengths[t:].tolist()):
            if shares0 * room1 <= shares1 * room and shares0 + length <= room:
                shares0 += length
                tiny_taken.append(True)
            else:
                shares1 += length
                tiny_taken.append(False)
        taken[t:] = tiny_taken[::-1]
        gap = room - shares0
        if listed:
            target = self.missing[0] - sum(a for a, k in zip(pool.item_areas[t:], tiny_taken[::-1]) if k)
        else:
            target = self.missing[0] - int(np.add.reduce(pool.item_area_array[t:][taken[t:]]))
        # Start of the run over items[i:t]: the window of `gap` tokens starting at item j has an area decreasing in j.
        last = pool.search(int(tokens[t]) - gap, "right") - 1  # latest start with `gap` tokens before t
        last = max(i, min(last, t - 1))
        end_t = int(tokens[t])

        def window(j: int) -> float:
            return pool.most(j, min(gap, end_t - int(tokens[j])))

        lo, hi = i, last
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if window(mid) >= target else (lo, mid)
        j = lo if abs(window(lo) - target) <= abs(window(hi) - target) else hi
        # The run: items j, j + 1, ... while each fits the gap left, i.e. while the run's tokens stay within it.
        k = min(t, pool.search(int(tokens[j]) + gap, "right") - 1)
        taken[j:k] = [True] * (k - j) if listed else True
        gap -= int(tokens[k]) - int(tokens[j])
        if gap:  # close the gap with the longest items left that fit (the run may have used the shortest)
            gap = _close_gap(lengths, taken, i, gap)
        if gap:  # or exchange items: one or two untaken ones in, one or two taken ones out, `gap` tokens more
            inside, outside = (_shortest_of(lengths, taken, i, flag, self.config.exchange) for flag in (True, False))
            gap = _exchange(inside, outside, {m: int(lengths[m]) for m in inside + outside}, taken, gap)
        cut = None
        if gap:  # no combination fits: cut the shortest item left that is longer than the gap
            if listed:
                cut = max(m for m in range(i, n) if not taken[m] and lengths[m] > gap)
            else:
                cut = int(np.flatnonzero(~taken[i:] & (lengths[i:] > gap))[-1]) + i
            it = pool.item(cut)
            self.cut.add(it.doc)
            pieces = (it.sub(it.length - gap, it.length), it.sub(0, it.length - gap))
        for side in (0, 1):
            keep = side == 0  # the items of `side`: those taken (left) or not (right), in order, the piece in place
            if listed:
                entries = [sel[m] if m != cut else pieces[side] for m in range(i, n) if taken[m] == keep or m == cut]
            elif cut is None:
                entries = [sel[i:][taken[i:] == keep]]
            else:
                entries = [sel[i:cut][taken[i:cut] == keep], pieces[side], sel[cut + 1:][taken[cut + 1:] == keep]]
            self.put(side, entries)

    def sides(self) -> List[Tuple[_Column, _Column, _Column, Dict[int, _Item]]]:
        """Per side, what it received in order: doc / length / area columns and the pieces cut here by position.
        A side of at most ``_LISTED`` items gets Python lists (the steps after it, ``mend_cuts`` and ``merged``,
        then read it without numpy calls: a pure ring's bisections inside nodes are many and small); a larger one
        int64 arrays."""
        items, out = self.items, []
        for entries in self.out:
            if sum(len(e) if isinstance(e, np.ndarray) else 1 for e in entries) <= _LISTED:
                if self._columns is None:
                    self._columns = (items.doc.tolist(), items.length.tolist(), items.area.tolist())
                entries = [k for e in entries for k in (e.tolist() if isinstance(e, np.ndarray) else (e,))]
                out.append(tuple([getattr(e, f) if isinstance(e, _Item) else column[e] for e in entries]
                                 for f, column in zip(("doc", "length", "area"), self._columns))
                           + ({k: e for k, e in enumerate(entries) if isinstance(e, _Item)},))
                continue
            chunks, run, pieces = [], [], {}
            size = 0
            for e in entries:
                if isinstance(e, np.ndarray):
                    if run:
                        chunks.append(run)
                        run = []
                    chunks.append(e)
                    size += len(e)
                else:
                    if isinstance(e, _Item):
                        pieces[size] = e
                        e = -1  # filled in below
                    run.append(e)
                    size += 1
            if run:
                chunks.append(run)
            index = np.concatenate(chunks) if len(chunks) > 1 else np.asarray(chunks[0] if chunks else [], np.int64)
            doc, length, area = items.doc[index], items.length[index], items.area[index]
            if pieces:
                at = list(pieces)
                doc[at], length[at], area[at] = zip(*((it.doc, it.length, it.area) for it in pieces.values()))
            out.append((doc, length, area, pieces))
        return out

    def mend_cuts(self, sides: List[Tuple[_Column, _Column, _Column, Dict[int, _Item]]]) -> None:
        """Undo cuts that only filled rooms: a document on both sides whose piece on one side is as long as a
        whole, uncut item on the other is reunited by swapping the two, when the areas stay within the slack.
        ``sides``: ``self.sides()``, changed in place."""
        # A document with two items anywhere is on both sides (a cut gives each side a piece): only the documents
        # cut here can be, and their items are the pieces.
        split = sorted({it.doc for it in sides[0][3].values()} & {it.doc for it in sides[1][3].values()})
        if not split:
            return
        # Where each document's pieces are: a swap moves only the split document being mended and an uncut
        # item, so the positions of the split documents still to be visited never change.
        where: List[dict] = [{}, {}]
        for side, places in zip(sides, where):
            for k, it in sorted(side[3].items()):
                if it.doc in split:
                    places.setdefault(it.doc, []).append(k)
        lengths = sorted({int(side[1][k]) for side, places in zip(sides, where) for ks in places.values() for k in ks})
        # Per side, the uncut items by length (positions increasing; the last one is swapped first).
        by_length: List[dict] = [{}, {}]
        for side, places, lists in zip(sides, where, by_length):
            pieces = {k for ks in places.values() for k in ks}
            if isinstance(side[1], list):
                wanted = set(lengths)
                at = [(k, length) for k, length in enumerate(side[1]) if length in wanted]
            else:
                at = _among(side[1], lengths).nonzero()[0]
                at = zip(at.tolist(), side[1][at].tolist())
            for k, length in at:
                if k not in pieces:
                    lists.setdefault(length, []).append(k)

        def entry(side: int, k: int) -> Tuple[int, int, int, Optional[_Item]]:
            doc, length, area, pieces = sides[side]
            return int(doc[k]), int(length[k]), int(area[k]), pieces.pop(k, None)

        def store(side: int, k: int, value: Tuple[int, int, int, Optional[_Item]]) -> None:
            doc, length, area, pieces = sides[side]
            doc[k], length[k], area[k] = value[:3]
            if value[3] is not None:
                pieces[k] = value[3]

        for doc in split:
            for home in (0, 1):
                away = where[1 - home][doc]
                if len(away) != 1:
                    continue
                piece_length, piece_area = int(sides[1 - home][1][away[0]]), int(sides[1 - home][2][away[0]])
                candidates = by_length[home].get(piece_length, [])
                if not candidates:
                    continue
                delta = piece_area - int(sides[home][2][candidates[-1]])
                if not (abs(self.missing[home] - delta) <= max(abs(self.missing[home]), self.slack)
                        and abs(self.missing[1 - home] + delta) <= max(abs(self.missing[1 - home]), self.slack)):
                    continue
                k = candidates.pop()
                piece, swap = entry(1 - home, away[0]), entry(home, k)
                store(home, k, piece)
                store(1 - home, away[0], swap)
                self.missing[home] -= delta
                self.missing[1 - home] += delta
                break

    def merged(self, side: Tuple[_Column, _Column, _Column, Dict[int, _Item]]) -> _Items:
        """One item per document (what a pool holds): the uncut items in order, then the pieces of each
        document cut here (the only documents a side can hold several pieces of) as one item, adjacent ranges
        merged (few, contiguous segments)."""
        doc, length, area, pieces = side
        inherited = self.items.pieces
        kept = {d: r for d, r in inherited.items() if d not in self.cut} if self.cut else inherited
        by_doc: dict = {}
        for k in sorted(pieces):
            by_doc.setdefault(pieces[k].doc, []).append(pieces[k])
        merged = []
        for d, parts in by_doc.items():
            if len(parts) == 1:
                merged.append(parts[0])
                continue
            ranges: List[List[int]] = []
            for s, e in sorted(r for it in parts for r in it.ranges):
                if ranges and ranges[-1][1] == s:
                    ranges[-1][1] = e
                else:
                    ranges.append([s, e])
            merged.append(_Item(d, tuple((s, e) for s, e in ranges)))
        columns = ((doc, "doc"), (length, "length"), (area, "area"))
        if isinstance(doc, list):  # (``sides``: a side of items placed one by one)
            arrays = [np.array([v for k, v in enumerate(values) if k not in pieces] + [getattr(it, f) for it in merged],
                               dtype=np.int64) for values, f in columns]
        elif pieces:
            uncut = np.ones(len(doc), dtype=bool)
            uncut[list(pieces)] = False
            arrays = [np.concatenate([values[uncut], [getattr(it, f) for it in merged]]) for values, f in columns]
        else:
            return _Items(doc, length, area, kept)
        return _Items(*arrays, {**kept, **{it.doc: it.ranges for it in merged if not it.simple}} if merged else kept)


def _close_gap(lengths: Union[np.ndarray, List[int]], taken: Union[np.ndarray, List[bool]], i: int, gap: int) -> int:
    """Take untaken items of ``i:`` (``taken`` updated) into a ``gap`` of tokens: the longest that fit first, by
    decreasing length, then increasing index; of equal ones, as many as fit. Returns the gap left. Arrays, or
    Python lists for few items (``place_light``)."""
    if isinstance(taken, list):
        fits = [m for m in range(i, len(taken)) if not taken[m] and lengths[m] <= gap]
        fits.sort(key=lambda m: -lengths[m])  # stable: ties by index
        values = [lengths[m] for m in fits]
        starts = [a for a in range(len(fits)) if a == 0 or values[a] != values[a - 1]]
        keys = [-values[a] for a in starts]
    else:
        fits = (~taken[i:] & (lengths[i:] <= gap)).nonzero()[0] + i
        fits = fits[(-lengths[fits]).argsort(kind="stable")]
        values = lengths[fits]
        change = np.ones(len(values), dtype=bool)  # the first of each run of equal lengths
        change[1:] = values[1:] != values[:-1]
        at = change.nonzero()[0]
        starts, keys = at.tolist(), (-values[at]).tolist()
    starts.append(len(fits))
    # Group by group of equal lengths, longest first; the groups longer than the gap left take none of theirs and are
    # skipped (``keys``: minus each group's length, increasing).
    chosen = []
    g = bisect.bisect_left(keys, -gap)
    while g < len(keys) and gap:
        count = min(starts[g + 1] - starts[g], gap // -keys[g])
        chosen.append(fits[starts[g]:starts[g] + count])
        gap += count * keys[g]
        g = bisect.bisect_left(keys, -gap, g + 1)
    if isinstance(taken, list):
        for m in chain.from_iterable(chosen):
            taken[m] = True
    elif chosen:
        taken[np.concatenate(chosen)] = True
    return gap


def _shortest_of(lengths: Union[np.ndarray, List[int]], taken: Union[np.ndarray, List[bool]], i: int, flag: bool,
                 count: int) -> List[int]:
    """The ``count`` shortest items of ``i:`` whose ``taken`` is ``flag``, in (length, index) order."""
    if isinstance(taken, list):
        return sorted((m for m in range(i, len(taken)) if taken[m] == flag), key=lambda m: lengths[m])[:count]
    at = (taken[i:] == flag).nonzero()[0] + i
    return at[lengths[at].argsort(kind="stable")[:count]].tolist()


def _exchange(inside: List[int], outside: List[int], lengths: Dict[int, int], taken: Union[np.ndarray, List[bool]],
              gap: int) -> int:
    """Swap the shortest few items so that ``taken`` gains exactly ``gap`` tokens: u - t, u1 + u2 - t or
    u - t1 - t2 = gap (u: items not taken, t: taken; ``inside`` / ``outside``: the shortest taken / untaken items
    in (length, index) order; ``lengths``: theirs). Returns the gap left (0 on success).

    The first solution in the order of the loops ``for u (for u2 after u1) (for t1 in inside)`` with ``t`` (``t2``)
    the first taken item of the length wanted, found with all pairs at once: each form's wanted lengths as an array,
    looked up in the taken items' sorted lengths."""
    if not inside or not outside:
        return gap
    ins = np.array([lengths[m] for m in inside], dtype=np.int64)
    order = ins.argsort(kind="stable")  # taken items by length, then their order in `inside`
    values = ins[order]
    need = np.array([lengths[u] for u in outside], dtype=np.int64) - gap  # what the taken items given back hold

    def found(wanted: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Per wanted length, the position of the first taken item of that length in ``values``, and whether
        there is one."""
        at = values.searchsorted(wanted)
        return at, values[np.minimum(at, len(values) - 1)] == wanted

    def swap(ins: Sequence[int], outs: Sequence[int]) -> int:
        for m in ins:
            taken[m] = True
        for m in outs:
            taken[m] = False
        return 0

    at, hit = found(need)  # u - t = gap
    if hit.any():
        x = int(hit.argmax())
        return swap([outside[x]], [inside[order[at[x]]]])
    n = len(outside)
    at, hit = found(need[:, None] + (need + gap)[None, :])  # u1 + u2 - t = gap, u2 after u1
    hit &= np.arange(n)[None, :] > np.arange(n)[:, None]
    if hit.any():
        x, y = divmod(int(hit.argmax()), n)
        return swap([outside[x], outside[y]], [inside[order[at[x, y]]]])
    at, hit = found(need[:, None] - ins[None, :])  # u - t1 - t2 = gap, t2 not t1 itself
    twin = values[np.minimum(at + 1, len(values) - 1)] == values[np.minimum(at, len(values) - 1)]
    hit &= (order[np.minimum(at, len(values) - 1)] != np.arange(len(inside))[None, :]) | (twin & (at + 1 < len(values)))
    if hit.any():
        x, a = divmod(int(hit.argmax()), len(inside))
        t = order[at[x, a]] if order[at[x, a]] != a else order[at[x, a] + 1]
        return swap([outside[x]], [inside[a], inside[t]])
    return gap


def _least_end(length: np.ndarray, area: np.ndarray) -> np.ndarray:
    """A lower bound on the end position of ``length`` tokens of a document carrying ``area``: the ``length``
    positions just below the end are the densest, ``length * (2 * end - length + 1) / 2 >= area``."""
    return np.maximum(length, np.ceil(area / np.maximum(length, 1) + (length - 1) / 2))


@functools.lru_cache(maxsize=None)
def _subset_masks(n: int) -> Tuple[np.ndarray, np.ndarray]:
    """``[2**n, n]`` float64 0/1 (row m holds the bits of m: item k in subset m) and its bool complement;
    read-only, shared by every call."""
    masks = ((np.arange(1 << n)[:, None] >> np.arange(n)) & 1).astype(np.float64)
    outside = masks == 0
    masks.setflags(write=False)
    outside.setflags(write=False)
    return masks, outside


def _exhaustive_bisection(items: List[_Item], rooms: Tuple[int, int], targets: Tuple[float, float],
                          slack: float, visits: int = PlacementConfig.visits,
                          cap: Optional[int] = None) -> Optional[List[List[_Item]]]:
    """``_exhaustive_bisections``' cheapest split, or None."""
    found = _exhaustive_bisections(items, rooms, targets, slack, visits, cap)
    return found[0] if found else None


def _exhaustive_bisections(items: List[_Item], rooms: Tuple[int, int], targets: Tuple[float, float],
                           slack: float, visits: int = PlacementConfig.visits, cap: Optional[int] = None,
                           count: int = 1, distinct: Collection[int] = ()) -> List[List[List[_Item]]]:
    """The cheapest split of a few items with at most one cut, over every subset of whole items for the left
    side (one item per document on each side); none (an empty list) when none is within ``slack`` of the
    targets. ``cap``: the most tokens the cut may give the side without the item's last token (None: any).
    ``count``: up to this many splits, cheapest first, each the cheapest of its kind: which item is cut and which
    of the documents ``distinct`` go left (``_lookahead`` weighs them with the levels below).

    The greedy bisection cuts the item that fits neither side at its cheapest cut *given the items placed
    before it*, which leaves the sides at the edge of feasibility and forces more cuts later (three documents
    cut in one bisection of 17 items, 64K rows where one cut of 17K did). Between nodes, where every row
    counts, a bisection of few items is small enough to try all ``2**n`` subsets: tokens and areas of all
    subsets at once (numpy), then for each item the subsets it would complete by a cut, feasible when the
    missing area lies between the area of its first and last ``tau`` tokens; candidates are visited by a lower
    bound on their rows (``_least_end``, exact for a whole document; at most ``visits``), stopping at the best."""
    items = sorted(items, key=_doc_of)  # ties between subsets go to the same one whatever the items' order
    n = len(items)
    masks, outside = _subset_masks(n)
    # Subset sums as one product (integers below 2**53: exact in float64 whatever the order of the sums).
    tokens, areas = (masks @ np.array([(it.length, it.area) for it in items], dtype=np.float64).reshape(n, 2)).T
    error = np.abs(areas - targets[0])
    exact = ((tokens == rooms[0]) & (error <= slack)).nonzero()[0]
    if len(exact):
        chosen = masks[exact[np.argmin(error[exact])]]
        return [[[it for it, b in zip(items, chosen) if b == side] for side in (1, 0)]]
    room = rooms[0] - tokens
    lengths = tokens[1 << np.arange(n)]  # the one-item subsets
    # (item, subset) pairs where the item, not in the subset, would fill the room by a cut: one 2-D test over the
    # subsets some item could complete, grouped by item (each item's subsets increasing).
    near = ((room > 0) & (room < lengths.max(initial=0))).nonzero()[0]
    cuts, pairs = (outside[near] & (room[near, None] < lengths)).T.nonzero()
    pairs = near[pairs]
    if not len(cuts):
        return []
    cut_length, cut_area = lengths[cuts], areas[1 << cuts]
    tau, missing = room[pairs], targets[0] - areas[pairs]
    # The areas of the cut item's [0, tau) and [0, L - tau): the least and (by their complement) the most
    # area its tau tokens can carry.
    heads = _areas_before(items, np.concatenate([cuts, cuts]), np.concatenate([tau, cut_length - tau]))
    head, rest = heads[:len(tau)], heads[len(tau):]
    fits = (head - slack <= missing) & (missing <= cut_area - rest + slack)
    if cap is not None:
        fits &= np.minimum(tau, cut_length - tau) <= cap
    if not fits.any():
        return []
    tau, missing, cut_length, cut_area = tau[fits], missing[fits], cut_length[fits], cut_area[fits]
    bounds = np.minimum(_least_end(tau, missing - 0.9 * slack), _least_end(cut_length - tau, cut_area - missing - 0.9 * slack))
    subsets, cut = pairs[fits], cuts[fits]
    best = None
    kinds: dict = {}  # (cut item, the `distinct` items on the left) -> the cheapest split of that kind
    marks = [k for k, it in enumerate(items) if it.doc in distinct]
    for k in bounds.argsort(kind="stable")[:visits].tolist():
        if best is not None and (bounds[k] >= best[0] if count == 1 else len(kinds) >= count
                                 and bounds[k] >= sorted(v[0] for v in kinds.values())[count - 1]):
            break
        m, c = int(subsets[k]), int(cut[k])
        it, tau = items[c], int(rooms[0] - tokens[m])
        missing = targets[0] - float(areas[m])
        for holder, length, area in ((0, tau, missing - 0.9 * slack), (1, it.length - tau, it.area - missing - 0.9 * slack)):
            if cap is not None and length > cap:
                continue
            # The holder gets `length` tokens carrying at least `area`, the least end position possible.
            head = it.area_before(length)
            x = _horizon_for(it, length, max(float(head), area), head)
            if x is not None:
                cost = it.end_position(x)
                if best is None or cost < best[0]:
                    best = (cost, m, c, holder, x - length, x)
                if count > 1:
                    kind = (c,) + tuple(bool(masks[m, j]) for j in marks)
                    if kind not in kinds or cost < kinds[kind][0]:
                        kinds[kind] = (cost, m, c, holder, x - length, x)
    if best is None:
        return []
    chosen = [best] if count == 1 else sorted(kinds.values(), key=lambda v: v[0])[:count]
    return [_subset_split(items, masks[m], c, holder, p, x) for _, m, c, holder, p, x in chosen]


def _subset_split(items: List[_Item], left: np.ndarray, c: int, holder: int, p: int, x: int) -> List[List[_Item]]:
    """The sides of an ``_exhaustive_bisections`` split: the items marked in ``left`` (0/1 per item) on the left,
    the others on the right, but item ``c``: stream offsets ``[p, x)`` to side ``holder``, its head and tail (one
    item: one per document) to the other side."""
    sides: List[List[_Item]] = [[], []]
    for k, it in enumerate(items):
        if k == c:
            sides[holder].append(it.sub(p, x))
            rest = it.outside(p, x)
            if rest:
                sides[1 - holder].append(_Item(it.doc, rest))
        else:
            sides[0 if left[k] else 1].append(it)
    return sides


def _bisect_items(items: Union[_Items, Sequence[_Item]], rooms: Tuple[int, int], targets: Tuple[float, float],
                  between_nodes: bool, config: PlacementConfig = PlacementConfig(),
                  slack: Optional[float] = None, states: Optional[list] = None,
                  cap: Optional[int] = None) -> List[_Items]:
    """Split ``items`` into two sides of exactly ``rooms`` tokens whose areas approach ``targets``.
    ``between_nodes``: the sides are groups of nodes, so short documents are not cut (inter-node traffic).
    ``slack``: how far (a fraction of the smaller target) a side may miss its target; default ``config.slack``.
    ``states``: where given, the bisection's ``_Bisection`` is appended to it (whether it read its slack).
    ``cap``: the most tokens a heavy item's cut may give the side without its last token (``_lookahead``)."""
    items = _as_items(items)
    if rooms[0] == 0 or rooms[1] == 0:
        empty = items.take(np.zeros(0, dtype=np.int64))
        return [items, empty] if rooms[1] == 0 else [empty, items]
    state = _Bisection(items, rooms, targets, config, between_nodes, slack, cap)
    if states is not None:
        states.append(state)
    if between_nodes and len(items) <= config.exhaustive:
        found = _exhaustive_bisection(items.items(), rooms, targets, state.slack, config.visits, cap)
        if found is not None:
            return [_Items.of(side) for side in found]
    pool = state.pool
    heavy = config.heavy * max(1.0, min(targets))
    # Items are placed one by one up to the last heavy one; the rest are dealt as a window.
    over = (pool.item_area_array > heavy).nonzero()[0]
    end = int(over[-1]) + 1 if len(over) else 0
    if end > 64 or len(pool) <= 4096:  # many scalar reads, or few items: Python lists are faster
        pool.as_lists()
    short = max(int(config.short * min(rooms)), config.short_tokens) if between_nodes else 0
    deferred = state.place_heavy(end, short)
    if deferred:  # one light pool in density order again (the deferred items come before the rest in it)
        state.pool = _Pool(state.items, np.concatenate([np.array(deferred, dtype=np.int64), pool.sel[end:]]))
        end = 0
    state.place_light(end)
    placed = state.sides()
    state.mend_cuts(placed)
    sides = [state.merged(side) for side in placed]
    # Greedy sides off their targets by more than the slack are searched again, inside a node too (a member 10 %
    # over its share on a lognormal batch in a pure ring of 8 x 8); between nodes, so are several cuts.
    # The slack is read (``_Bisection.slack``: ``_split``'s memo) only where the error is above the least slack any
    # pass gives, ``config.slack``: below it, no pass finds the sides off their targets.
    error, least = abs(sides[0].total_area() - targets[0]), _pairs_slack(config.slack, targets)
    missed = error > state.slack if error > least or state._slack < least else False
    if not between_nodes and not missed:
        return sides
    # The documents on both sides: only ones cut here can be.
    cut = sorted({it.doc for it in placed[0][3].values()} & {it.doc for it in placed[1][3].values()})
    if len(cut) < (1 if missed else 2) or len(cut) > config.reopened - 2:  # (state.slack not read: see above)
        return sides
    return _reopened(items, sides, cut, rooms, targets, state.slack, config, missed, cap)


def _cut_rows(sides: Sequence[Union[_Items, Sequence[_Item]]], docs: Optional[Sequence[int]] = None) -> int:
    """Rows a bisection moves (``_node_rows`` of its two sides), counting only the documents ``docs`` where
    given. Sides given as items (a few, from a search) are counted from their ends one by one."""
    if docs is None and not any(isinstance(side, _Items) for side in sides):
        return _horizon_rows((it.doc, it.ranges[-1][1]) for side in sides for it in side)
    sides = [_as_items(side) for side in sides]
    if docs is None:
        return _node_rows(sides)
    ends = []  # (few documents: their items' ends gathered one by one)
    for side in sides:
        at = _among(side.doc, docs).nonzero()[0]
        for k, d in zip(at.tolist(), side.doc[at].tolist()):
            ranges = side.pieces.get(d)
            ends.append((d, int(side.length[k]) if ranges is None else ranges[-1][1]))
    return _horizon_rows(ends)


def _horizon_rows(ends: Iterable[Tuple[int, int]]) -> int:
    """Rows moved between the holders of pieces ending at ``ends`` (document, in-document end position): the
    horizon formula, for every document the ends of its pieces but the one ending last."""
    by_doc: Dict[int, List[int]] = {}
    for d, end in ends:
        by_doc.setdefault(d, []).append(end)
    return sum(sum(e) - max(e) for e in by_doc.values())


def _reopened(items: _Items, sides: List[_Items], cut: List[int], rooms: Tuple[int, int],
              targets: Tuple[float, float], slack: float, config: PlacementConfig,
              missed: bool = False, cap: Optional[int] = None) -> List[_Items]:
    """The greedy bisection's cuts searched again (between nodes; inside a node only where it ``missed``): the
    documents it cut, whole, the heaviest whole items (by area; with the cut documents, ``config.heaviest`` in
    all) and the shortest whole items of each side (alternately, ``config.reopened`` items in all) are split
    again over every subset (``_exhaustive_bisection``), the other items staying where they are; kept when it
    moves fewer rows, or when the greedy sides ``missed`` their targets by more than the slack (the search's are
    within it).

    A greedy cut leaves its holder at the edge of feasibility, so the items placed after it are cut too (three
    cuts in one bisection of two nodes, where one would do); the short items give the search the token counts
    and areas to fill the rooms exactly around a single cut. Each greedy cut is the cheapest *given the heavy
    items placed before it*: with the heaviest items free as well, the search also chooses which heavy documents
    go whole to which side and which one is cut (on the bimodal mix, the few documents of 64K-512K tokens decide
    the traffic). After a single cut within the slack the search saved ~0.1-0.5 % of the rows at up to 2.5 ms
    per 1M-token plan (docs/sequence_aware.md), so it runs after one cut only where the greedy steps missed.
    ``cut``: the documents on both sides (at least 2, or 1 where ``missed``; at most ``config.reopened - 2``)."""
    found, fixed, moved = _reopenings(items, sides, cut, rooms, targets, slack, config, cap)
    if not found:
        return sides
    # (the rows of the moved documents: those of the split alone, before it is joined to the items left in place)
    if missed or _cut_rows(found[0]) < _cut_rows(sides, cut):
        return _joined(fixed, found[0], moved)
    return sides


def _reopenings(items: _Items, sides: List[_Items], cut: Sequence[int], rooms: Tuple[int, int],
                targets: Tuple[float, float], slack: float, config: PlacementConfig, cap: Optional[int] = None,
                count: int = 1, head_cuts: int = 0) -> Tuple[List[List[List[_Item]]], List[_Items], Set[int]]:
    """``_reopened``'s search: up to ``count`` splits of the items it frees (``_exhaustive_bisections``, of distinct
    kinds: which item is cut and where each free item heavier than the ``slack`` goes), the items each side keeps in
    place, and the documents it moves (``_joined`` makes a split whole sides). ``head_cuts``: then, of the splits
    with a second cut, up to this many moving the fewest rows here (one split each search): for each of the
    ``config.head_cut_items`` longest free items after the longest (of at least ``config.head_cut_share`` of the
    smaller side's tokens) and each fraction ``f`` of ``config.head_cuts``, its head of ``f`` x its length on the
    side holding the longest item's last token and its rest on the other (a second cut: the head is sparse filler
    beside that dense tail, and the rest can go whole to one node below), the other free items searched the same
    way, kept where that side still holds the longest item's last token (``_lookahead`` weighs them with the levels
    below)."""
    # The heaviest uncut items of both sides, by decreasing area (ties: left side first, then position).
    uncut = [(~_among(side.doc, cut)).nonzero()[0] for side in sides]
    heaviest = min(config.heaviest, config.reopened) - len(cut)
    chosen: List[Tuple[int, int]] = []
    if heaviest > 0:
        areas = np.concatenate([side.area[u] for side, u in zip(sides, uncut)])
        owner = np.repeat([0, 1], [len(u) for u in uncut])
        position = np.concatenate(uncut)
        top = np.lexsort((position, owner, -areas))[:heaviest]
        chosen = list(zip(owner[top].tolist(), position[top].tolist()))
    wanted = config.reopened - len(cut) - len(chosen)
    # Per side, its other uncut items by increasing length (ties in the side's order): the first `wanted` can move.
    shortest = []
    for s, (side, u) in enumerate(zip(sides, uncut)):
        u = u[~_among(u, [k for t, k in chosen if t == s])]
        shortest.append(u[_shortest(side.length[u], wanted)].tolist())
    alternate = [(s, k) for pair in zip_longest(*shortest) for s, k in zip((0, 1), pair) if k is not None][:wanted]
    free = [items.item(k) for k in _among(items.doc, cut).nonzero()[0].tolist()]
    free += [sides[s].item(k) for s, k in chosen + alternate]
    moved = {it.doc for it in free}
    fixed = [side.take((~_among(side.doc, moved)).nonzero()[0]) for side in sides]
    held = [(int(np.add.reduce(f.length)), f.total_area()) for f in fixed]  # what each side keeps in place

    def search(free: List[_Item], parts: Sequence[Sequence[_Item]], kinds: int) -> List[List[List[_Item]]]:
        """Splits of ``free`` with ``parts`` (per side) fixed besides what the sides keep."""
        room = tuple(r - t - sum(it.length for it in p) for r, (t, _), p in zip(rooms, held, parts))
        if min(room) < 0:
            return []
        wanted = tuple(w - a - sum(it.area for it in p) for w, (_, a), p in zip(targets, held, parts))
        return _exhaustive_bisections(free, room, wanted, slack, config.visits * kinds, cap, kinds,
                                      [it.doc for it in free if it.area > slack])

    # The search as it was, then with a second cut fixed: (rows here, the split with its parts).
    found = search(free, ((), ()), count) if count else []
    seconds = []
    if head_cuts:
        longest, *after = sorted(free, key=lambda it: (-it.length, it.doc))
        # The side holding the longest item's last token: the head goes there (the rest to the other side).
        ends = [side.ends()[side.doc == longest.doc] for side in sides]
        tail = 0 if len(ends[0]) and (not len(ends[1]) or ends[0].max() > ends[1].max()) else 1
        for c in after[:config.head_cut_items]:
            if c.length < config.head_cut_share * min(rooms):
                break  # a head too short to fill what a node's dense pieces leave: it rarely paid its planning time
            rest = [it for it in free if it is not c]
            for fraction in config.head_cuts:
                h = int(fraction * c.length)
                if not 0 < h < c.length:
                    continue
                parts = ((c.sub(0, h),), (c.sub(h, c.length),))[::1 if tail == 0 else -1]
                for split in search(rest, parts, 1):
                    # The head is filler next to the longest item's tail: elsewhere it rarely paid.
                    if any(it.doc == longest.doc and it.ranges[-1][1] == longest.ranges[-1][1] for it in split[tail]):
                        seconds.append((h + _cut_rows(split), [list(p) + side for p, side in zip(parts, split)]))
    found += [split for _, split in sorted(seconds, key=lambda s: s[0])[:head_cuts]]
    return found, fixed, moved


def _joined(fixed: List[_Items], split: List[List[_Item]], moved: Set[int]) -> List[_Items]:
    """A split of ``_reopenings`` as whole sides: each side's items kept in place (``fixed``), then its part of the
    split (the documents ``moved``)."""
    sides = []
    for f, side in zip(fixed, split):
        side = _Items.of(side)
        sides.append(_concat([f, side], {**{d: r for d, r in f.pieces.items() if d not in moved}, **side.pieces}))
    return sides


def _all_joined(found: List[List[List[_Item]]], fixed: List[_Items], moved: Set[int]) -> List[List[_Items]]:
    """Every split ``_reopenings`` found, as whole sides (``_joined``)."""
    return [_joined(fixed, split, moved) for split in found]


def _shortest(lengths: np.ndarray, count: int) -> np.ndarray:
    """Indices of the ``count`` smallest of ``lengths`` in (length, index) order (a stable sort's first ``count``),
    without sorting them all."""
    if len(lengths) <= _SCANNED:  # (few: one Python sort, stable)
        values = lengths.tolist()
        return np.array(sorted(range(len(values)), key=values.__getitem__)[:max(count, 0)], dtype=np.int64)
    if count >= len(lengths):
        return lengths.argsort(kind="stable")
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    bar = np.partition(lengths, count - 1)[count - 1]
    # Every index below the bar, then the first ones at it: the `count` smallest, ties by index.
    chosen = np.flatnonzero(lengths <= bar)
    below = lengths[chosen] < bar
    chosen = np.concatenate([chosen[below], chosen[~below][:count - np.count_nonzero(below)]])
    return chosen[lengths[chosen].argsort(kind="stable")]


class _Stream:
    """What is left of one node's items while ``_shared`` deals them: items ``i .. r - 1`` of the density order,
    where item ``i`` (cut at the front) and item ``r - 1`` (its head cut off at the back) may be only the ``rest``
    of what they were; what each bin received so far (``owner``: the bin of each item given whole, -1 for the cut
    ones; ``pieces``: the pieces, per bin) and their area (``given``)."""

    def __init__(self, items: _Items, bins: int) -> None:
        self.items = items.by_density()
        n = len(self.items)
        self.lengths, self.tok, self.pre = self.items.length.tolist(), [0] * (n + 1), [0] * (n + 1)
        self.tok[1:], self.pre[1:] = self.items.length.cumsum().tolist(), self.items.area.cumsum().tolist()
        self.ranged = {k: _Item(d, ranges) for k, d, ranges in self.items.ranged()}
        self.i, self.r, self.rest = 0, n, {}
        self.owner = np.full(n, -1, dtype=np.int64)
        self.pieces: List[List[_Item]] = [[] for _ in range(bins)]
        self.given = 0

    def item(self, k: int) -> _Item:
        return self.rest.get(k) or self.items.item(k)

    def length(self, k: int) -> int:
        return self.rest[k].length if k in self.rest else self.lengths[k]

    def head(self, k: int, tau: int) -> int:
        """Area of the first ``tau`` tokens of item ``k`` as it is now."""
        return self.heads(k)(tau)

    def heads(self, k: int) -> Callable[[int], int]:
        """``head(k, .)``, for the many calls of one search."""
        it = self.rest.get(k) or self.ranged.get(k)
        return _first_tokens_area if it is None else it.area_before

    def front_area(self) -> Callable[[int], int]:
        """``front(.)[0]``, for the many calls of one search: the heads of the front item while they stay in it."""
        size, heads, front = self.length(self.i), self.heads(self.i), self.front
        return lambda f: heads(f) if f < size else front(f)[0]

    def span(self, a: int, b: int) -> Tuple[int, int]:
        """Tokens and area of items ``a .. b - 1`` as they are now."""
        tokens, area = self.tok[b] - self.tok[a], self.pre[b] - self.pre[a]
        for k, it in self.rest.items():
            if a <= k < b:
                tokens += it.length - self.lengths[k]
                area += it.area - (self.pre[k + 1] - self.pre[k])
        return tokens, area

    def front(self, f: int) -> Tuple[int, int, int]:
        """The first ``f`` tokens left: their area, the item ``k`` they end in and their ``tau`` tokens of it (the
        head; 0: they end at item ``k``)."""
        i = self.i
        size = self.length(i)
        if f < size:
            return self.head(i, f), i, f
        p = self.tok[i + 1] + f - size
        k = bisect.bisect_right(self.tok, p) - 1
        tau = p - self.tok[k]
        if k < self.r and tau >= self.length(k):  # (item r - 1, shorter than it was)
            k, tau = k + 1, 0
        return self.span(i, k)[1] + (self.head(k, tau) if tau else 0), k, tau

    def back_fits(self, cap: int) -> int:
        """The first ``e`` whose items ``e .. r - 1`` fit ``cap`` tokens (after the front item)."""
        r = self.r
        shorter = self.rest[r - 1].length - self.lengths[r - 1] if r - 1 in self.rest else 0
        return min(max(self.i + 1, bisect.bisect_left(self.tok, self.tok[r] + shorter - cap)), r)

    def take(self, b: int, a: int, z: int) -> None:
        """Items ``a .. z - 1`` whole to bin ``b``."""
        self.given += self.span(a, z)[1]
        self.owner[a:z] = b
        for k in [k for k in self.rest if a <= k < z]:
            self.owner[k] = -1
            self.pieces[b].append(self.rest.pop(k))

    def cut(self, b: int, k: int, lo: int, hi: int) -> None:
        """Stream offsets ``[lo, hi)`` of item ``k`` to bin ``b``; the rest stays as item ``k``."""
        it = self.item(k)
        piece = it.sub(lo, hi)
        self.pieces[b].append(piece)
        self.given += piece.area
        self.rest[k] = _Item(it.doc, it.outside(lo, hi))
        self.owner[k] = -1

    def fill(self, b: int, cap: int, need: float, tolerance: float, short: float) -> bool:
        """Give bin ``b`` its ``cap`` tokens carrying ``need`` (within ``tolerance``): whole items from both ends and a
        window of the front's last item, or (``fill_cutting``) the head of a back item. False where neither can
        without cutting an item of at most ``short`` tokens (or with no items left)."""
        if self.i >= self.r:
            return False
        r, lo = self.r, self.back_fits(cap)
        span, front_area = self.span, self.front_area()

        def area(e: int) -> int:  # back items e .. r - 1, the rest from the front
            tokens, back = span(e, r)
            return back + front_area(cap - tokens)

        if area(lo) > need:
            return self.fill_cutting(b, cap, need, lo - 1, short)  # the item that does not fit whole
        e = r
        if area(r) > need:  # the last e with area(e) <= need: the area grows with e (fewer back tokens)
            hi = r
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if area(mid) <= need else (lo, mid)
            e = lo
        back_tokens, back = self.span(e, r)
        taken, k, tau = self.front(cap - back_tokens)
        x = None
        if tau and self.length(k) > short:
            least = self.head(k, tau)
            x = _horizon_for(self.item(k), tau, need - back - taken + least, least)
        if x is None and (tau or need - back - taken > tolerance):
            return self.fill_cutting(b, cap, need, e, short)  # item e: whole, the area is within need, without above
        self.take(b, e, r)
        self.take(b, self.i, k)
        if tau:
            self.cut(b, k, x - tau, x)
        self.i, self.r = k, e
        return True

    def fill_cutting(self, b: int, cap: int, need: float, c: int, short: float) -> bool:
        """``fill`` with the head of back item ``c`` (the back items after it whole, the rest from the front's heads):
        as few of its tokens as bring the area within ``need``."""
        r = self.r
        if c <= self.i or c >= r or self.length(c) <= short:
            return False
        whole_tokens, whole = self.span(c + 1, r)
        most = min(self.length(c) - 1, cap - whole_tokens)

        heads, front_area = self.heads(c), self.front_area()

        def area(head: int) -> int:
            return whole + heads(head) + front_area(cap - whole_tokens - head)

        if most < 1 or area(most) > need:
            return False
        lo, hi = 0, most  # area(lo) > need >= area(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if area(mid) <= need else (mid, hi)
        _, k, tau = self.front(cap - whole_tokens - hi)
        if k > c or (k == c and tau) or (tau and self.length(k) <= short):
            return False
        self.take(b, c + 1, r)
        self.cut(b, c, 0, hi)
        self.take(b, self.i, k)
        if tau:
            self.cut(b, k, 0, tau)
        self.i, self.r = k, c + 1
        return True

    def bins(self) -> List[_Items]:
        """What each bin received: its items given whole (in density order), then its pieces; the columns of all
        bins made at once, each bin's a slice of them."""
        sizes = [len(pieces) for pieces in self.pieces]
        whole = np.bincount(self.owner + 1, minlength=len(sizes) + 1)[1:].tolist()
        index = self.owner.argsort(kind="stable")[len(self.owner) - sum(whole):]
        extra = [p for pieces in self.pieces for p in pieces]
        of_bin = np.concatenate([self.owner[index], [b for b, size in enumerate(sizes) for _ in range(size)]])
        order = of_bin.argsort(kind="stable")  # per bin, its whole items first
        doc, length, area = (np.concatenate([getattr(self.items, f)[index],
                                             np.array([getattr(p, f) for p in extra], dtype=np.int64)])[order]
                             for f in ("doc", "length", "area"))
        out, lo = [], 0
        for count, size, pieces in zip(whole, sizes, self.pieces):
            hi = lo + count + size
            ranges = {**self.items.pieces, **{p.doc: p.ranges for p in pieces}} if pieces else self.items.pieces
            out.append(_Items(doc[lo:hi], length[lo:hi], area[lo:hi], ranges))
            lo = hi
        return out


def _shared(items: _Items, caps: Sequence[int], targets: Sequence[float],
            config: PlacementConfig) -> Optional[List[_Items]]:
    """The items of bins inside one node shared among them in one pass, in bin order, or None where a bin would miss
    its target (``targets[b]``, summing to the items' area) by more than ``config.slack`` (a fraction of it, as a
    bisection inside a node may), or only by cutting an item of at most ``config.short`` of its tokens (or
    ``config.short_tokens``): the caller then bisects.

    Why: inside a node only balance and the node's own rows are at stake (the traffic between nodes is decided by
    the bisections above), and a pure ring's node has many bins, a bisection each a Python pass over its items.
    Here each bin in turn takes the densest items left from the front and the sparsest from the back, whole: from
    the back the most (the fewest front tokens) whose area with the front's stays within the bin's cumulative
    target; the rest of the area from a window of the densest item left (the front's last, cut with the least end
    position: ``_horizon_for``, the rows it moves), its rest going first to the next bin. Where no window makes it
    up, a back item is cut instead: the bin takes its head, as many tokens as bring the area to the target. A bin
    ends above its cumulative target by less than one step of the window (or head) adds, which the next bin's
    target takes back (cumulative targets); every bin is checked against its own. A node of short items only (none
    it may cut) is shared by the counts of its documents of each length instead (``_shared_whole``)."""
    least_short = max(config.short * min((cap for cap in caps if cap), default=0), config.short_tokens)
    if len(items) and int(items.length.max()) <= least_short:
        return _shared_whole(items, caps, targets, config)
    stream = _Stream(items, len(caps))
    wanted = 0.0
    for b, cap in enumerate(caps[:-1]):
        wanted += targets[b]
        short = max(config.short * cap, config.short_tokens)
        if cap and not stream.fill(b, cap, wanted - stream.given, _pairs_slack(config.slack, (targets[b],)), short):
            return None
    stream.take(len(caps) - 1, stream.i, stream.r)
    out = stream.bins()
    within = all(abs(area - t) <= _pairs_slack(config.slack, (t,)) for area, t in zip(_total_areas(out), targets))
    return out if within else None


def _shared_whole(items: _Items, caps: Sequence[int], targets: Sequence[float],
                  config: PlacementConfig) -> Optional[List[_Items]]:
    """The short items of bins inside one node shared among them whole (``whole_shares.share_whole``: exact tokens,
    every bin within ``config.slack`` of its target, as ``_shared``), or None where that finds no split, or some item
    is a piece of a document cut above that is not its head (its area is not its length's): the caller bisects."""
    if items.ranged():
        return None
    bins = share_whole(items.length, caps, targets, [_pairs_slack(config.slack, (t,)) for t in targets],
                       config.whole_lengths)
    if bins is None:
        return None
    order = np.argsort(bins, kind="stable")
    ends = np.cumsum(np.bincount(bins, minlength=len(caps))).tolist()
    return [items.take(order[a:b]) for a, b in zip([0] + ends[:-1], ends)]


def _split(items: Union[_Items, Sequence[_Item]], groups: list, caps: Sequence[int], targets: Sequence[float],
           config: PlacementConfig, node_slack: float, memo: Optional[dict] = None,
           budget: Optional[float] = None, nodes_only: bool = False) -> List[_Items]:
    """Recursive bisection over a tree of bins: ``groups`` is a bin index or a list of subtrees; bisections
    inside a node may miss their targets by ``config.slack`` (a fraction), those between nodes by ``node_slack``
    when it is ``config.slack`` (``"tight"``), else by what is left of a budget (``_node_slack``). A bisection
    between 3 or 4 nodes is chosen with the rows of the one below it (``_lookahead``). The bins of a node are
    first given the node's items in one pass (``_shared``); only where that misses a bin's target are they
    bisected (each half then tried the same way).

    Each side's bin targets are rescaled to the area the side actually received, so a bisection's error
    is shared by all the bins below it instead of landing on the last bin split (a node slightly over its
    target made one of its members several times as far over). ``budget``: how far over its share (a factor)
    the bisections between nodes of this subtree may put a node; ``None`` at the root, ``(1 + node_slack) **
    levels``. ``nodes_only``: stop at the nodes (one ``_Items`` per node; what ``_lookahead`` weighs).

    ``memo``: the bisections of earlier passes of the same placement (``sequence_aware_table`` plans again with
    less slack between nodes) and those ``_lookahead`` weighed, by group. A bisection given the same items and
    targets as before, and the same slack or one it never read (nothing inside a node reads ``node_slack``),
    splits them the same way: its sides are reused instead of planned again, and the groups below it then find
    theirs too (a lookahead's choice reads the budget of the levels below: reused at the same budget only; a
    bisection that cut nothing has nothing to weigh and is reused at any budget)."""
    items = _as_items(items)
    if isinstance(groups, int) or (nodes_only and isinstance(groups[0], int)):
        return [items]
    if len(groups) == 1:
        return _split(items, groups[0], caps, targets, config, node_slack, memo, budget, nodes_only)
    if isinstance(groups[0], int):  # the bins of one node (or a part of one)
        shared = _shared(items, [caps[b] for b in groups], [targets[b] for b in groups], config)
        if shared is not None:
            return shared
    half = len(groups) // 2
    halves = (groups[:half], groups[half:])
    leaves = (_leaves(halves[0]), _leaves(halves[1]))
    between_nodes = not isinstance(groups[0], int)
    rooms = (sum(caps[b] for b in leaves[0]), sum(caps[b] for b in leaves[1]))
    wanted = (sum(targets[b] for b in leaves[0]), sum(targets[b] for b in leaves[1]))
    slack = config.slack
    if between_nodes and node_slack > config.slack:
        levels = _depth(len(groups))
        budget = (1.0 + node_slack) ** levels if budget is None else budget
        slack = _node_slack(budget, levels, config.slack)
    elif between_nodes:
        slack = node_slack
    ahead = (between_nodes and _depth(len(groups)) == 2
             and bool(config.lookahead or config.alternatives or config.head_cuts))
    records = memo.setdefault((tuple(leaves[0]), tuple(leaves[1])), []) if memo is not None else []
    for seen in records:
        if (seen[1] == wanted and (seen[2] == slack or not seen[3]) and seen[5] in (None, budget)
                and _same_items(seen[0], items)):
            sides = seen[4]
            break
    else:
        states: list = []
        sides = _bisect_items(items, rooms, wanted, between_nodes, config, slack, states)
        read = any(state.slack_read for state in states)
        weighed = ahead and len(sides[0]) + len(sides[1]) > len(items)  # a document cut (one item per document)
        if weighed:
            sides = _lookahead(items, sides, halves, rooms, wanted, caps, targets, config, node_slack, memo, budget,
                               slack)
            read = True
        records.append((items, wanted, slack, read, sides, budget if weighed else None))
    scaled, budgets = _rescaled(sides, leaves, wanted, targets, budget)
    return (_split(sides[0], halves[0], caps, scaled, config, node_slack, memo, budgets[0], nodes_only)
            + _split(sides[1], halves[1], caps, scaled, config, node_slack, memo, budgets[1], nodes_only))


def _rescaled(sides: Sequence[_Items], leaves: Sequence[List[int]], wanted: Tuple[float, float],
              targets: Sequence[float], budget: Optional[float]) -> Tuple[List[float], List[Optional[float]]]:
    """The bins' targets rescaled to the area each side of a bisection received, and the budget left to the
    levels between nodes below each side (``_split``)."""
    scaled, budgets = list(targets), [budget, budget]
    for s, (side, bins, side_target) in enumerate(zip(sides, leaves, wanted)):
        if side_target > 0:
            factor = side.total_area() / side_target
            for b in bins:
                scaled[b] = targets[b] * factor
            if budget is not None and factor > 0:
                budgets[s] = budget / factor  # what is left to the levels below: a side under its target has more
    return scaled, budgets


def _lookahead(items: _Items, sides: List[_Items], halves: Tuple[list, list], rooms: Tuple[int, int],
               wanted: Tuple[float, float], caps: Sequence[int], targets: Sequence[float], config: PlacementConfig,
               node_slack: float, memo: Optional[dict], budget: Optional[float], slack: float) -> List[_Items]:
    """The bisection between two groups of nodes (3 or 4 nodes in all) that moves the fewest rows together with
    the bisections between nodes below it, among ``sides`` (which cut one document or more, ``cut``) and candidates
    within its slack whose nodes below hold no more area over their share than the budget or those of ``sides``:
    splits with a second cut (``_reopenings``' ``head_cuts``: a long item's head on one side, its rest on the
    other), the same bisection with the piece each heavy cut gives the side without
    the document's last token held to ``fraction`` x the longest such piece of ``sides`` (one candidate per fraction
    of ``config.lookahead``), and the ``config.alternatives`` cheapest splits of ``_reopened``'s search of distinct
    kinds (which item is cut, which side the heavy ones take).

    ``sides`` cuts at the fewest rows *of this bisection*. That can be a long, sparse piece taking most of a
    side's tokens, so that the level below has little room to take the area of the side's other documents off
    the node holding their last token and cuts them at high horizons; a shorter, denser piece costs a few rows
    here and leaves that room. Or the cut document, of two that fit the rooms alike (pieces of equal positions
    carry equal area whatever the document), is the one whose rest the level below must cut again. Or the side
    holding the longest document's dense tail needs sparse tokens beside it, which the head of another long document
    gives (a second cut here), its rest going whole to one node below (docs/sequence_aware.md, "Recursive
    bisection", step 6)."""
    cut = np.intersect1d(sides[0].doc, sides[1].doc, assume_unique=True)  # (one item per document on a side)
    at = [_among(side.doc, cut) for side in sides]
    ends = [dict(zip(side.doc[a].tolist(), zip(side.ends()[a].tolist(), side.length[a].tolist())))
            for side, a in zip(sides, at)]
    # The longest piece without its document's last token, and the side holding it.
    longest, holder = max((min(ends[0][d], ends[1][d])[1], int(ends[1][d] < ends[0][d])) for d in cut.tolist())
    pairs = _pairs_slack(slack, wanted)
    allowed = max(pairs, max(abs(side.total_area() - w) for side, w in zip(sides, wanted)))

    over = [1.0]  # the most area a node below the first split holds over its share; candidates may hold as much

    def rows(candidate: List[_Items], beat: float = math.inf) -> List[float]:
        """Rows of ``candidate``, then of the bisections between nodes below each side (``[inf]`` once their sum
        reaches ``beat``, or where a node holds more area over its share than ``budget`` and those of ``sides``)."""
        total = [_cut_rows(candidate)]
        scaled, budgets = _rescaled(candidate, [_leaves(h) for h in halves], wanted, targets, budget)
        for side, half, side_budget in zip(candidate, halves, budgets):
            if sum(total) >= beat:
                return [math.inf]
            nodes = _split(side, half, caps, scaled, config, node_slack, memo, side_budget, nodes_only=True)
            shares = [sum(targets[b] for b in _leaves(g)) for g in (half if len(nodes) > 1 else [half])]
            worst = max((n.total_area() / t for n, t in zip(nodes, shares) if t > 0), default=1.0)
            if beat == math.inf:
                over[0] = max(over[0], worst, budget or 1.0)
            elif worst > over[0]:
                return [math.inf]
            total.append(_node_rows(nodes))
        return total

    split = rows(sides)
    best = (sum(split), sides)

    def weigh(candidates: List[List[_Items]]) -> None:
        nonlocal best
        for candidate in candidates:
            if max(abs(side.total_area() - w) for side, w in zip(candidate, wanted)) > allowed:
                continue
            if all(_same_items(a, b) for a, b in zip(candidate, sides)):
                continue
            cost = sum(rows(candidate, best[0]))
            if cost < best[0]:
                best = (cost, candidate)

    # A second cut (a head as sparse filler) answers the same want of room as a shorter piece below: both weighed.
    reopen = len(cut) <= config.reopened - 2
    long_items = np.count_nonzero(items.length >= config.head_cut_share * min(rooms))  # (``_reopenings``' bar)
    if config.head_cuts and reopen and long_items >= 2:
        weigh(_all_joined(*_reopenings(items, sides, cut.tolist(), rooms, wanted, pairs, config, count=0,
                                       head_cuts=config.head_cut_splits)))
    # A shorter piece costs rows here and can only pay below it, on its side: tried where that side's level below
    # moves at least as many rows as this bisection and the piece holds a share of the side's tokens.
    shorter = split[1 + holder] >= split[0] and longest >= config.lookahead_share * rooms[holder]
    weigh([_bisect_items(items, rooms, wanted, True, config, slack, cap=int(fraction * longest))
           for fraction in (config.lookahead if shorter else ())])
    if config.alternatives and reopen:
        weigh(_all_joined(*_reopenings(items, sides, cut.tolist(), rooms, wanted, pairs, config,
                                       count=config.alternatives)))
    return best[1]


def _node_rows(nodes: Sequence[_Items]) -> int:
    """Rows moved between ``nodes`` (one ``_Items`` each; the horizon formula: for every document, the ends of
    its pieces on all of them but the one ending last)."""
    doc = np.concatenate([n.doc for n in nodes])
    end = np.concatenate([n.ends() for n in nodes])
    order = np.lexsort((end, doc))
    doc, end = doc[order], end[order]
    kept = np.zeros(len(doc), dtype=bool)
    kept[:-1] = doc[1:] == doc[:-1]  # not the document's last (largest) end
    return int(end[kept].sum())


def _same_items(a: _Items, b: _Items) -> bool:
    """Whether two groups of items are the same items in the same order (ranges of cut documents included)."""
    if a is b:
        return True
    if len(a) != len(b) or not all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("doc", "length", "area")):
        return False
    keys = set(a.pieces) | set(b.pieces)
    present = a.doc[_among(a.doc, keys)].tolist() if keys else []
    return all(a.pieces.get(d) == b.pieces.get(d) for d in present)


def _node_slack(budget: float, levels: int, floor: float) -> float:
    """The slack of a bisection between nodes with ``levels`` levels between nodes left (its own included): all of
    the ``budget`` but ``floor`` for each level below it (what a bisection needs to place documents whole), and at
    least ``floor``.

    The first bisection's error then bounds what the levels below may add: a side over its target by ``1 + e`` has
    ``budget / (1 + e)`` left, a side under it more (the sides' targets are rescaled), so a member is over its
    share by at most ``budget`` times what the levels inside its node add. Spent first where it is: the two sides
    of the first bisection between two halves of the nodes need the most area moved, and a cut there that the
    slack avoids (or shortens) saves the most rows; levels below spend what their side has left (measured against
    an equal share per level in docs/sequence_aware.md)."""
    return max(floor, budget / (1.0 + floor) ** (levels - 1) - 1.0)


def _leaves(groups: object) -> List[int]:
    if isinstance(groups, int):
        return [groups]
    return [b for g in groups for b in _leaves(g)]



def _check_size(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


def sequence_aware_placement(doc_lengths: Sequence[int], *, ring_size: int, ulysses_size: int,
                             ring_members_per_node: int, tokens_per_rank: int,
                             cost_model: Optional[CostModel] = None,
                             placement: Optional[PlacementConfig] = None) -> List[List[Segment]]:
    """Per CP rank (index ``c = ring_index * ulysses_size + ulysses_index``), its ``(doc_index, doc_start, doc_end)``
    segments in local order.

    Every rank holds exactly ``tokens_per_rank`` tokens except for tail padding on the last
    ranks. Ring member m (CP ranks ``m * ulysses_size ...``) sits on node
    ``m // ring_members_per_node``. ``cost_model`` (a ``CostModel`` or None) is checked but does not change the
    placement: a padded member takes the same attention share as a full one (``_attention_targets``), not more
    in place of its missing tokens' linear work. ``placement`` (default ``PlacementConfig()``): the balance
    targets and knobs. Deterministic: every rank computes the same placement.
    """
    table = sequence_aware_table(doc_lengths, ring_size=ring_size, ulysses_size=ulysses_size,
                                 ring_members_per_node=ring_members_per_node, tokens_per_rank=tokens_per_rank,
                                 cost_model=cost_model, placement=placement)
    return table_segments(table, ring_size * ulysses_size)


def _depth(count: int) -> int:
    """Bisection levels that split ``count`` bins down to single bins."""
    return max(0, count - 1).bit_length()


def _node_slacks(config: PlacementConfig, num_nodes: int, members_per_node: int) -> List[float]:
    """The slacks (fractions of a side's target) the bisections between nodes try, in order, each as the budget
    ``(1 + slack) ** levels`` that ``_split`` shares among the levels between nodes: in ``"traffic"`` mode the
    largest whose compounded error over those levels, times ``config.slack`` per level inside a node, stays
    within ``attention_target`` (a member over its node's share by ``1 + e`` per level on its path), then half
    and a quarter of it; ``config.slack`` last (``"tight"``: only that, at every level)."""
    tight = [config.slack]
    levels = _depth(num_nodes)
    if config.balance == "tight" or levels == 0:
        return tight
    budget = config.attention_target / (1.0 + config.slack) ** _depth(members_per_node)
    widest = budget ** (1.0 / levels) - 1.0
    return [s for s in (widest, widest / 2, widest / 4) if s > config.slack] + tight


def sequence_aware_table(doc_lengths: Sequence[int], *, ring_size: int, ulysses_size: int,
                         ring_members_per_node: int, tokens_per_rank: int,
                         cost_model: Optional[CostModel] = None,
                         placement: Optional[PlacementConfig] = None) -> np.ndarray:
    """``sequence_aware_placement`` as a segment table (``layouts.split_streams``): what ``plan_batch`` uses."""
    _check_size("ring_size", ring_size, 1)
    _check_size("ulysses_size", ulysses_size, 1)
    _check_size("ring_members_per_node", ring_members_per_node, 1)
    _check_size("tokens_per_rank", tokens_per_rank, 0)
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model must be a CostModel or None, got {type(cost_model).__name__}")
    if placement is not None and not isinstance(placement, PlacementConfig):
        raise ValueError(f"placement must be a PlacementConfig or None, got {type(placement).__name__}")
    config = placement or PlacementConfig()
    lengths = _checked_lengths(doc_lengths)
    total = int(lengths.sum())
    member_tokens = ulysses_size * tokens_per_rank
    if total > ring_size * member_tokens:
        raise ValueError(f"tokens_per_rank={tokens_per_rank} is too small: {ring_size * ulysses_size} CP ranks hold "
                         f"{ring_size * member_tokens} tokens but the batch has {total}; need tokens_per_rank >= "
                         f"{-(-total // (ring_size * ulysses_size))}")
    caps = [min(member_tokens, max(0, total - m * member_tokens)) for m in range(ring_size)]
    doc = np.flatnonzero(lengths > 0)
    docs = _Items(doc, lengths[doc], lengths[doc] * (lengths[doc] + 1) // 2, {})
    targets = _attention_targets(caps, docs.total_area(), lengths)
    nodes = [list(range(m, min(m + ring_members_per_node, ring_size)))
             for m in range(0, ring_size, ring_members_per_node)]
    if len(nodes) > config.lookahead_nodes:
        config = dataclasses.replace(config, lookahead=(), alternatives=0, head_cuts=())
    # Planned with the widest slack first; kept when every member's attention is within the target of its own
    # (equal targets without padding: the attention imbalance), else planned again with the next slack (when
    # none meets it, the one closest to it is kept).
    best, memo = None, {}
    for slack in _node_slacks(config, len(nodes), min(ring_members_per_node, ring_size)):
        members = _split(docs, nodes, caps, targets, config, slack, memo)
        worst = max((area / t for area, t in zip(_total_areas(members), targets) if t > 0), default=1.0)
        if best is None or worst < best[0]:
            best = (worst, members)
        if worst <= config.attention_target:
            break
    members = best[1]
    # Each member's stream: its documents in index order (one item each), each item's ranges in order; all members'
    # items as one array (a member's documents are distinct: the order is unique).
    member = np.repeat(np.arange(len(members)), [len(items) for items in members])
    doc, length = (np.concatenate([getattr(items, f) for items in members]) for f in ("doc", "length"))
    ranges = {}  # row in `doc` -> ranges of an item cut above
    orders, first = [], 0
    for items in members:
        if len(doc) > _ONE_SORT:
            orders.append(np.argsort(items.doc) + first)
        for k, _, item_ranges in items.ranged():
            ranges[first + k] = item_ranges
        first += len(items)
    # By member, then document: one sort of (member, document) keys for few items, else one sort per member.
    order = np.concatenate(orders) if orders else np.argsort(member * len(lengths) + doc, kind="stable")
    member, doc, start, end = member[order], doc[order], np.zeros(len(doc), dtype=np.int64), length[order]
    if ranges:  # a row per range
        ranged = np.zeros(len(doc), dtype=bool)
        ranged[list(ranges)] = True
        at = np.flatnonzero(ranged[order])
        cut = [ranges[k] for k in order[at].tolist()]
        count = np.ones(len(doc), dtype=np.int64)
        count[at] = per_item = [len(r) for r in cut]
        first_row = np.cumsum(count) - count
        member, doc, start, end = (np.repeat(a, count) for a in (member, doc, start, end))
        # The rows of the cut items' ranges: each item's first row, then the next ones.
        within = np.arange(sum(per_item)) - np.repeat(np.cumsum(per_item) - per_item, per_item)
        rows = np.repeat(first_row[at], per_item) + within
        start[rows], end[rows] = np.array([r for rs in cut for r in rs], dtype=np.int64).T
    return split_streams(member, doc, start, end, ulysses_size, tokens_per_rank)


#: Items of all members at most this many are put in stream order with one sort (``sequence_aware_table``), more with
#: one sort per member (one sort of many keys is slower than many small ones, of few keys much faster): a speed
#: threshold, the order is the same.
_ONE_SORT = 8192


def _total_areas(groups: Sequence[_Items]) -> List[int]:
    """``[g.total_area() for g in groups]`` from one cumulative sum (exact: int64), without a numpy call per group."""
    sizes = np.array([len(g) for g in groups], dtype=np.int64)
    prefix = np.zeros(int(sizes.sum()) + 1, dtype=np.int64)
    if len(prefix) > 1:
        np.concatenate([g.area for g in groups]).cumsum(out=prefix[1:])
    ends = sizes.cumsum()
    return (prefix[ends] - prefix[ends - sizes]).tolist()


def _checked_lengths(doc_lengths: Sequence[int]) -> np.ndarray:
    """``doc_lengths`` as int64 ``[n]``; ValueError naming the first entry that is not an int >= 0. An integer
    numpy array (what ``plan_batch`` passes) is checked with numpy ops."""
    if isinstance(doc_lengths, np.ndarray) and doc_lengths.dtype.kind in "iu" and doc_lengths.ndim == 1:
        lengths = doc_lengths.astype(np.int64, copy=False)
        if len(lengths) and lengths.min() < 0:
            i = int(np.argmax(lengths < 0))
            raise ValueError(f"doc_lengths[{i}]={int(lengths[i])!r} must be an int >= 0")
        return lengths
    for i, n in enumerate(doc_lengths):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"doc_lengths[{i}]={n!r} must be an int >= 0")
    return np.fromiter(doc_lengths, np.int64, len(doc_lengths))
