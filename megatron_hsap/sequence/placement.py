"""Sequence-aware placement: which tokens of which documents each CP rank holds.

Inside a ring member (one Ulysses group) the all-to-all gathers all of the member's
tokens for each head group, so only a member's total cost matters; between members
(and above all between nodes) every split document costs key/value traffic. The
placement therefore works top-down on the hierarchy -- nodes, then the members of
each node -- with the same cost-balancing partition at each level, and finally cuts
each member's token stream into equal contiguous parts for its Ulysses ranks.

The partition of one level (docs/sequence_aware.md has the full argument):

1. Every bin (node or member) has an exact token capacity (only the last ones hold
   tail padding) and an attention target that makes its cost (causal mask area +
   ``CostModel.linear_weight`` per token) equal to every other bin's: full bins get
   equal areas, a padded bin a little more.
2. Items (whole documents, or at the member level the node's pieces) are taken in
   decreasing area. A bin's *deficit* is its target minus its area minus what its
   remaining room will cost when filled at the density of the light items (each under
   1 % of a bin's target) not placed yet; an item's *excess* is its area minus that
   density times its length. An item denser than the filler goes to the bin with the
   largest deficit, a sparser one to the smallest; within a small band of that choice,
   to the fullest bin (best fit, so the last short documents fill the rooms exactly).
3. When the excess overshoots the chosen bin's deficit by more than the tolerance, the
   item is cut: a piece that exactly fills the deficit is peeled off -- the tail (dense,
   few tokens) when the bin takes at least half of the item's excess, the head
   otherwise, so the bin holding the tail needs as few earlier keys as possible -- and
   the rest is placed the same way. Documents are cut only where the cost requires it,
   into few contiguous pieces.
4. A heavy item longer than every room is either peeled or dealt in zigzag pairs
   (TE-style: 2k chunks, bin j keeps chunks j and 2k-1-j) over k bins; every option is
   tried with the heavy items still to come and the one leaving the least irreparable
   imbalance wins. Zigzag pairs balance a document that spans everything exactly.
5. A light item that fits no room fills the largest room and the rest goes on; at the
   end such cuts are undone where a whole item of the same length can be swapped in.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from megatron_hsap.sequence.cost_model import CostModel, causal_area

__all__ = ["sequence_aware_placement"]

Segment = Tuple[int, int, int]  # (doc_index, doc_start, doc_end)
Ranges = Tuple[Tuple[int, int], ...]  # disjoint, increasing in-document ranges of one document

# A document is cut only when the best bin would overshoot its attention target by more than this fraction
# of the mean target.
_TOLERANCE = 0.005
# Items whose area is at least this fraction of a bin's target are placed by deficit, the rest is filler.
_HEAVY = 0.01


class _Item:
    """Some tokens of one document (``ranges``, increasing), seen as one stream of ``length`` tokens."""

    __slots__ = ("doc", "ranges", "length", "area")

    def __init__(self, doc: int, ranges: Ranges) -> None:
        self.doc = doc
        self.ranges = ranges
        self.length = sum(e - s for s, e in ranges)
        self.area = sum(causal_area(s, e) for s, e in ranges)

    def area_before(self, offset: int) -> int:
        """Causal area of the first ``offset`` tokens of the stream."""
        area = 0
        for s, e in self.ranges:
            if offset <= 0:
                break
            take = min(e - s, offset)
            area += causal_area(s, s + take)
            offset -= take
        return area

    def sub(self, lo: int, hi: int) -> Ranges:
        """Ranges of stream offsets ``[lo, hi)``."""
        out, pos = [], 0
        for s, e in self.ranges:
            a, b = max(lo, pos), min(hi, pos + e - s)
            if b > a:
                out.append((s + a - pos, s + b - pos))
            pos += e - s
        return tuple(out)


class _Bins:
    """Token capacity, cost target and content of the bins (nodes or members) of one level."""

    def __init__(self, caps: Sequence[int], total_area: int, weight: float, max_density: int, spread: bool) -> None:
        self.room = list(caps)
        self.area = [0] * len(caps)
        self.target = _attention_targets(caps, total_area, weight, max_density)
        mean = total_area / max(1, sum(1 for c in caps if c > 0))
        self.tol = _TOLERANCE * mean  # overshoot allowed before a document is cut
        self.items: List[List[_Item]] = [[] for _ in caps]
        self.heavy = _HEAVY * mean
        self.pack_only = False  # set while the items left are too light to matter for cost
        self.spread = spread  # see _partition

    def copy(self) -> "_Bins":
        other = object.__new__(_Bins)
        other.adopt(self)
        return other

    def adopt(self, other: "_Bins") -> None:
        self.room, self.area, self.target, self.tol = list(other.room), list(other.area), other.target, other.tol
        self.items, self.heavy, self.pack_only = [list(i) for i in other.items], other.heavy, other.pack_only
        self.spread = other.spread

    def error(self, rho: float) -> float:
        """Largest imbalance that later items cannot repair: a projected excess over target (remaining room
        filled at density rho), or a shortfall of a bin that is already full."""
        deficits = [self.deficit(b, rho) for b in range(len(self.room))]
        return max(-d if room else abs(d) for d, room in zip(deficits, self.room))

    def deficit(self, b: int, rho: float) -> float:
        return self.target[b] - self.area[b] - rho * self.room[b]

    def put(self, b: int, item: _Item) -> None:
        if item.length:
            self.items[b].append(item)
            self.room[b] -= item.length
            self.area[b] += item.area


def _attention_targets(caps: Sequence[int], total_area: int, weight: float, max_density: int) -> List[float]:
    """Attention area per bin that makes attention + linear cost equal on every bin (water-filling).

    Full bins get equal areas; a bin with tail padding gets more attention in place of the
    linear work of its missing tokens, but never more than ``max_density`` pairs per token.
    """
    def fill(level: float) -> List[float]:
        return [min(max(level - weight * c, 0.0), float(max_density * c)) for c in caps]

    lo, hi = 0.0, float(total_area) + weight * max(caps)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(fill(mid)) < total_area else (lo, mid)
    return fill(hi)


def _excess(area: float, length: int, rho: float) -> float:
    """Cost beyond what the same number of average tokens would cost (the linear term cancels)."""
    return area - rho * length


def _peel(item: _Item, budget: float, room: int, rho: float, tail: bool) -> Tuple[int, int]:
    """Stream offsets ``[lo, hi)`` of the largest tail (or head) piece of ``item`` within ``room`` tokens
    whose excess does not exceed ``budget`` (binary search; excess is monotone where density > rho)."""
    n, total = item.length, item.area
    if tail:
        lo, hi = max(0, n - room), n  # find the smallest start x with excess(tail from x) <= budget

        def ok(x: int) -> bool:
            return _excess(total - item.area_before(x), n - x, rho) <= budget

        if ok(lo):
            return lo, n
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        return hi, n
    lo, hi = 0, min(n, room)  # find the largest end y with excess(head up to y) <= budget

    def ok_head(y: int) -> bool:
        return _excess(item.area_before(y), y, rho) <= budget

    if ok_head(hi):
        return 0, hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok_head(mid) else (lo, mid)
    return 0, lo


def _zigzag(item: _Item, bins: _Bins, rho: float, k: int) -> bool:
    """Deal ``item`` in zigzag chunk pairs over the ``k`` bins with the largest deficits (False if they lack room)."""
    chosen = sorted((b for b in range(len(bins.room)) if bins.room[b] > 0),
                    key=lambda b: (-bins.deficit(b, rho), b))[:k]
    n = item.length
    if len(chosen) < k or min(bins.room[b] for b in chosen) < -(-n // k):
        return False
    shares = [n // k + (1 if j < n % k else 0) for j in range(k)]
    head, tail_end = 0, n
    for j, (b, share) in enumerate(zip(chosen, shares)):
        h = share // 2 if j % 2 == 0 else share - share // 2  # alternate the odd token: no drift of the middle
        t = share - h
        bins.put(b, _Item(item.doc, item.sub(head, head + h) + item.sub(tail_end - t, tail_end)))
        head, tail_end = head + h, tail_end - t
    return True


def _partition(items: List[_Item], caps: Sequence[int], weight: float, spread: bool) -> List[List[_Item]]:
    """Assign ``items`` (cut where needed) to bins of exact token capacities ``caps``, balancing cost.

    spread: the bins are nodes that will be partitioned again, so short documents are spread over them
    (each node keeps some to fill its members exactly) rather than packed best-fit.
    """
    if len(caps) == 1:
        return [items]
    items = sorted(items, key=lambda it: (-it.area, -it.length, it.doc, it.ranges))
    bins = _Bins(caps, sum(it.area for it in items), weight, max((it.ranges[-1][1] for it in items), default=0),
                 spread)
    # rho[i]: area per token of the light items after item i (each under _HEAVY of a bin's target) -- what the
    # remaining room will be filled with. Heavy items are placed explicitly by deficit; counting them in the
    # filler would make every bin look fuller than it will be.
    # tail_area[i]: area of items i, i+1, ...: once it is within the tolerance, cost no longer matters and
    # the remaining items are packed best-fit only.
    rho, tail_area = [0.0] * len(items), [0] * len(items)
    area_after = tokens_after = total_after = 0
    for i in range(len(items) - 1, -1, -1):
        rho[i] = area_after / tokens_after if tokens_after else 0.0
        total_after += items[i].area
        tail_area[i] = total_after
        if items[i].area < bins.heavy:
            area_after += items[i].area
            tokens_after += items[i].length
    num_heavy = sum(1 for it in items if it.area >= bins.heavy)  # a prefix: items are sorted by area
    for i, item in enumerate(items):
        bins.pack_only = tail_area[i] <= bins.tol
        _place(item, bins, rho[i], items[i + 1:num_heavy])
    _mend_light_cuts(bins)
    return bins.items


def _mend_light_cuts(bins: _Bins) -> None:
    """Undo cuts of light documents that only filled leftover room: in one of the bins holding a piece, find
    whole light items as long as each of the other pieces and swap them (token counts stay exact)."""
    where: dict = {}
    for b, bin_items in enumerate(bins.items):
        for it in bin_items:
            where.setdefault(it.doc, []).append((b, it))
    for doc in sorted(where):
        pieces = where[doc]
        if len(pieces) < 2 or sum(it.area for _, it in pieces) >= bins.heavy:
            continue
        for home, _ in sorted(pieces, key=lambda p: (-p[1].length, p[0])):
            swaps, used = [], set()
            for b, piece in pieces:
                if b == home:
                    continue
                swap = next((x for x in bins.items[home] if id(x) not in used and x.length == piece.length
                             and x.area < bins.heavy and len(where[x.doc]) == 1), None)
                if swap is None:
                    break
                used.add(id(swap))
                swaps.append((b, piece, swap))
            else:
                for b, piece, swap in swaps:
                    bins.items[home].remove(swap)
                    bins.items[b].remove(piece)
                    bins.items[home].append(piece)
                    bins.items[b].append(swap)
                    bins.area[home] += piece.area - swap.area
                    bins.area[b] += swap.area - piece.area
                    where[swap.doc] = [(b, swap)]
                where[doc] = [(home, piece) for _, piece in pieces]
                break


def _place(item: _Item, bins: _Bins, rho: float, later: Optional[Sequence[_Item]] = None) -> None:
    """Place one item. A heavy one longer than every room is either peeled or dealt in zigzag pairs over k
    bins: each option is tried together with the ``later`` heavy items (placed by peeling only), and the one
    that leaves the smallest irreparable imbalance wins (ties: peeling, then fewer bins, i.e. less traffic).
    ``later=None`` (inside such a trial) skips the search."""
    if later is None or item.length <= max(bins.room) or item.area < bins.heavy:
        _peel_into(item, bins, rho)
        return
    unit = max(bins.tol, 1e-9)
    best = None
    for k in range(1, len(bins.room) + 1):
        trial = bins.copy()
        if k == 1:
            _peel_into(item, trial, rho)
        elif not _zigzag(item, trial, rho, k):
            continue
        probe = trial.copy()
        for other in later:
            _place(other, probe, rho)
        key = (round(probe.error(rho) / unit), k)
        if best is None or key < best[0]:
            best = (key, trial)
    bins.adopt(best[1])


def _peel_into(item: _Item, bins: _Bins, rho: float) -> None:
    """Place ``item`` whole in the bin with the largest deficit, or peel off pieces that fill deficits (or rooms)."""
    nbins = len(bins.room)
    while item.length:
        n = item.length
        excess = _excess(item.area, n, rho)
        fits = [b for b in range(nbins) if bins.room[b] >= n]
        if fits:
            # An item denser than the filler goes where cost is missing most, a sparser one where it is in
            # excess; up to a band (the tolerance, or a light item's own weight), the fullest such bin: best
            # fit keeps rooms whole, so the last short documents fill them exactly instead of being cut.
            sign = 1.0 if excess >= 0 else -1.0
            band = 0.0 if bins.spread else max(bins.tol, bins.heavy if item.area < bins.heavy else 0.0)
            top = max(sign * bins.deficit(c, rho) for c in fits) - band
            if bins.pack_only and not bins.spread:
                top = float("-inf")
            b = min((c for c in fits if sign * bins.deficit(c, rho) >= top), key=lambda c: (bins.room[c], c))
            exact = [c for c in fits if bins.room[c] == n and excess <= bins.deficit(c, rho) + bins.tol]
            if exact:
                b = exact[0]
            budget = bins.deficit(b, rho)
            if excess <= budget + bins.tol or budget <= bins.tol:
                bins.put(b, item)
                return
            lo, hi = _peel(item, budget, bins.room[b], rho, tail=budget >= excess / 2)
            if hi <= lo:  # even one token overshoots the budget: the item goes whole
                bins.put(b, item)
                return
        else:
            b = max((c for c in range(nbins) if bins.room[c] > 0), key=lambda c: (bins.deficit(c, rho), -c))
            budget = bins.deficit(b, rho)
            lo, hi = 0, 0
            if item.area >= bins.heavy and budget > bins.tol:  # a heavy item: a piece that fills the deficit
                lo, hi = _peel(item, budget, bins.room[b], rho, tail=budget >= excess / 2)
            if hi <= lo:  # fill the largest room with the head or the tail, whichever suits its deficit best
                b = max((c for c in range(nbins) if bins.room[c] > 0),
                        key=lambda c: (bins.room[c], bins.deficit(c, rho), -c))
                room, budget = bins.room[b], bins.deficit(b, rho)
                head = _excess(item.area_before(room), room, rho)
                tail = _excess(item.area - item.area_before(n - room), room, rho)
                lo, hi = (n - room, n) if abs(budget - tail) < abs(budget - head) else (0, room)
        bins.put(b, _Item(item.doc, item.sub(lo, hi)))
        item = _Item(item.doc, item.sub(0, lo) + item.sub(hi, n))


def _merged(items: List[_Item]) -> List[_Item]:
    """One item per document with adjacent ranges merged, in document order (few, contiguous segments)."""
    by_doc: dict = {}
    for it in items:
        by_doc.setdefault(it.doc, []).append(it)
    out = []
    for doc in sorted(by_doc):
        if len(by_doc[doc]) == 1 and len(by_doc[doc][0].ranges) == 1:
            out.append(by_doc[doc][0])
            continue
        ranges: List[List[int]] = []
        for s, e in sorted(r for it in by_doc[doc] for r in it.ranges):
            if ranges and ranges[-1][1] == s:
                ranges[-1][1] = e
            else:
                ranges.append([s, e])
        out.append(_Item(doc, tuple((s, e) for s, e in ranges)))
    return out


def _check_size(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


def sequence_aware_placement(doc_lengths: Sequence[int], *, ring_size: int, ulysses_size: int,
                             ring_members_per_node: int, tokens_per_rank: int,
                             cost_model: Optional[CostModel] = None) -> List[List[Segment]]:
    """Per CP rank (index ``c = ring_index * ulysses_size + ulysses_index``), its ``(doc_index, doc_start, doc_end)``
    segments in local order.

    Every rank holds exactly ``tokens_per_rank`` tokens except for tail padding on the last
    ranks. Ring member m (CP ranks ``m * ulysses_size ...``) sits on node
    ``m // ring_members_per_node``. Deterministic: every rank computes the same placement.
    """
    _check_size("ring_size", ring_size, 1)
    _check_size("ulysses_size", ulysses_size, 1)
    _check_size("ring_members_per_node", ring_members_per_node, 1)
    _check_size("tokens_per_rank", tokens_per_rank, 0)
    for i, n in enumerate(doc_lengths):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"doc_lengths[{i}]={n!r} must be an int >= 0")
    total = sum(doc_lengths)
    member_tokens = ulysses_size * tokens_per_rank
    if total > ring_size * member_tokens:
        raise ValueError(f"tokens_per_rank={tokens_per_rank} is too small: {ring_size * ulysses_size} CP ranks hold "
                         f"{ring_size * member_tokens} tokens but the batch has {total}; need tokens_per_rank >= "
                         f"{-(-total // (ring_size * ulysses_size))}")
    weight = (cost_model or CostModel()).linear_weight
    member_caps = [min(member_tokens, max(0, total - m * member_tokens)) for m in range(ring_size)]
    nodes = [list(range(m, min(m + ring_members_per_node, ring_size)))
             for m in range(0, ring_size, ring_members_per_node)]
    docs = [_Item(d, ((0, n),)) for d, n in enumerate(doc_lengths) if n > 0]
    per_node = _partition(docs, [sum(member_caps[m] for m in node) for node in nodes], weight,
                          spread=ring_members_per_node > 1)
    members: List[List[_Item]] = []
    for node, node_items in zip(nodes, per_node):
        members.extend(_partition(_merged(node_items) if len(node) > 1 else node_items,
                                  [member_caps[m] for m in node], weight, spread=False))

    out: List[List[Segment]] = []
    for items in members:
        stream = [(it.doc, s, e) for it in _merged(items) for s, e in it.ranges]
        pos = 0
        for _ in range(ulysses_size):
            rank: List[Segment] = []
            need = tokens_per_rank
            while need and pos < len(stream):
                doc, s, e = stream[pos]
                take = min(need, e - s)
                rank.append((doc, s, s + take))
                need -= take
                if s + take == e:
                    pos += 1
                else:
                    stream[pos] = (doc, s + take, e)
            out.append(rank)
    return out
