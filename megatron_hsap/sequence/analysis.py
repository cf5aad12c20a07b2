"""Lower bounds on the inter-node key/value traffic of any placement: what ``tools/plan_report.py`` and the tests
measure plans against. Analysis only: planning and training never import this module (a test checks it).

docs/sequence_aware.md ("Lower bound on inter-node traffic") has the argument.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import Counter
from typing import List, Optional, Sequence, Tuple

import numpy as np

from megatron_hsap.sequence.cost_model import causal_area

__all__ = ["fewest_rows_two_nodes", "inter_node_rows_lower_bound", "two_node_rows_lower_bound"]


def _rows_for_area(area: float) -> int:
    """Smallest ``h`` with ``causal_area(0, h) >= area``: the fewest leading key rows carrying that much area."""
    if area <= 0:
        return 0
    h = max(0, int(math.isqrt(int(2 * area))) - 1)
    while causal_area(0, h) < area:
        h += 1
    return h


def inter_node_rows_lower_bound(doc_lengths: Sequence[int], num_nodes: int, imbalance: float = 1.0,
                                node_tokens: Optional[int] = None, *, charged_candidates: int = 4,
                                paired_candidates: int = 3, shares: int = 8) -> int:
    """Key/value rows that must cross nodes in any placement whose nodes each hold at most ``imbalance`` times
    the mean causal attention area and, when ``node_tokens`` is given, at most ``node_tokens`` tokens
    (``None``: capacity-free, so it bounds every layout whatever its token counts).

    A split document moves, summed over every holder but the one with its last token (N), that holder's last
    position + 1 (its horizon). Sort those holders by horizon: h_1 >= h_2 >= ... For each k, the document's
    tokens off N and holders 1..k-1 lie below h_k. Capacity-free, they carry at most its causal prefix
    area while N and each of the k-1 holders keep at most the node cap ``A``, so
    ``h_k >= rows_for(area - k * A)``. With token capacities (``_capacity_horizon``), those k nodes also
    hold at least ``total - (n - k) * node_tokens`` tokens, the ones not from the document carrying at least
    the least area that many tokens of the other documents can carry (the sparsest positions), and the
    document's tokens off them are at most the densest ``s`` below ``h_k``. Rows >= sum_k of the bounds.

    With token capacities, terms ``h_k`` of the largest documents are also charged for the other documents their
    ``k`` nodes must take (``_charged_horizons``): a document partly on them moves rows of its own, which no other
    term counts. Several terms may charge the same document, so term ``j`` counts a share ``theta_j`` of those
    rows, the shares summing to at most 1 (in eighths: a small knapsack over the terms that gain). A share is
    worth more than its fraction of the full charge (the bound is concave in it: a few sparse tokens are what
    the nodes miss most). A candidate whose own terms are all 0 is a document other terms may charge, so its
    charged term counts its own horizon at the same share too. Two large documents' nodes compete for the same
    sparse tokens, which separate terms each count in full: one term of each of two documents is also bounded
    jointly, on the union of their node sets (its size unknown: the least over the possible sizes), and the
    best such pair joins the knapsack in place of its two terms.

    The search's sizes: ``charged_candidates``, the largest documents whose horizons are charged; of those,
    the first ``paired_candidates`` are paired; ``shares``: the charges are shared in steps of ``1 / shares``
    (each only tightens the bound: 0, 0 and 1 give the bound without charges, without pairs and with whole charges).
    """
    lengths = [int(n) for n in doc_lengths]
    _check_counts((("charged_candidates", charged_candidates, 0), ("paired_candidates", paired_candidates, 0),
                   ("shares", shares, 1)))
    _check_bound_arguments(lengths, num_nodes, imbalance, node_tokens)
    areas = [causal_area(0, n) for n in lengths]
    cap = imbalance * sum(areas) / num_nodes
    sparsest = _Sparsest(lengths) if node_tokens is not None else None
    rows, terms = 0, []
    for d, area in enumerate(areas):
        terms.append([])
        for k in range(1, num_nodes):
            free = _rows_for_area(area - k * cap)
            if sparsest is not None:
                free = max(free, _capacity_horizon(d, k, lengths, num_nodes, node_tokens, k * cap, sparsest))
            rows += free
            terms[d].append(free)
    if sparsest is None or num_nodes < 2:
        return rows
    return rows + _charges(lengths, areas, terms, num_nodes, node_tokens, cap, charged_candidates=charged_candidates,
                           paired_candidates=paired_candidates, shares=shares)


def _check_counts(counts: Sequence[Tuple[str, int, int]]) -> None:
    """ValueError naming the first (name, value, least) whose value is not an int >= least."""
    for name, value, least in counts:
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name}={value!r} must be an int >= {least}")


def _check_bound_arguments(lengths: Sequence[int], num_nodes: int, imbalance: float,
                           node_tokens: Optional[int]) -> None:
    """The bounds' common arguments: ValueError naming the first bad one."""
    if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes!r} must be a positive int")
    if not imbalance >= 1.0:
        raise ValueError(f"imbalance={imbalance!r} must be >= 1.0")
    if node_tokens is not None and (not isinstance(node_tokens, int) or node_tokens * num_nodes < sum(lengths)):
        raise ValueError(f"node_tokens={node_tokens!r} must be an int with num_nodes * node_tokens >= "
                         f"{sum(lengths)} (the batch's tokens)")


def _charges(lengths: Sequence[int], areas: Sequence[int], terms: List[List[int]], num_nodes: int, node_tokens: int,
             cap: float, *, charged_candidates: int, paired_candidates: int, shares: int) -> int:
    """The rows ``inter_node_rows_lower_bound`` adds by charging the largest documents' terms (``terms[d][k-1]``:
    document d's term for k nodes) for the other documents their nodes must take, singly and in one pair."""
    candidates = [d for d in sorted(range(len(lengths)), key=areas.__getitem__, reverse=True)[:charged_candidates]
                  if areas[d] > cap / 4]
    # Documents whose rows some term counts may join the nodes free of charge (their rows are counted already).
    counted = [d for d in range(len(lengths)) if any(terms[d])]
    total = sum(lengths)

    def need(m: int) -> int:  # the least tokens of m nodes
        return total - (num_nodes - m) * node_tokens

    singles = {}  # (d, k) -> gain at each share u / shares of the charges
    for d in candidates:
        for k in range(1, num_nodes):  # every k: a term the capacity bound leaves at 0 may still be charged
            lows, unions = (terms[d][k - 1],), [(need(k), k * cap)]
            if any(terms[d]):
                gains = _charged_gains((d,), lows, unions, lengths, counted, 33, shares)
            else:  # other terms may charge d's rows too: then its own horizon can count only its share
                whole = _charged_horizons((d,), lows, lengths, counted, need(k), k * cap)
                gains = [whole * u // shares for u in range(shares + 1)] if whole > 0 else None
            if gains:
                singles[d, k] = gains
    best = _best_shares(list(singles.values()), shares)
    # Two documents whose nodes must both take sparse tokens compete for them: one term of each, jointly, on the
    # union of their node sets (m nodes, not known: the least over m). At most one pair, its two horizons then not
    # charged alone.
    paired = [d for d in candidates[:paired_candidates] if any(terms[d])]
    for a, b in itertools.combinations(paired, 2):
        for ka, kb in ((ka, kb) for ka in range(1, num_nodes) for kb in range(1, num_nodes - ka + 1)):
            unions = [(need(m), m * cap) for m in range(max(ka, kb), ka + kb + 1)]
            gains = _charged_gains((a, b), (terms[a][ka - 1], terms[b][kb - 1]), unions, lengths, counted, 17, shares)
            if gains:
                rest = [g for key, g in singles.items() if key not in ((a, ka), (b, kb))]
                best = max(best, _best_shares(rest + [gains], shares))
    return best


def _charged_gains(docs: Tuple[int, ...], lows: Tuple[int, ...], unions: Sequence[Tuple[int, float]],
                   lengths: Sequence[int], counted: Sequence[int], points: int, shares: int) -> Optional[List[int]]:
    """Gains of ``_charged_horizons`` over the uncharged terms ``lows`` at each share ``u / shares`` of the charges,
    the least over the possible node sets ``unions`` (least tokens, most area); None when the full share gains
    nothing (a smaller one gains no more)."""
    def gain(share: float) -> int:
        return max(0, min(_charged_horizons(docs, lows, lengths, counted, tokens, area, share, points)
                          for tokens, area in unions) - sum(lows))

    whole = gain(1.0)
    return [0] + [gain(u / shares) for u in range(1, shares)] + [whole] if whole else None


def _best_shares(gains: List[List[int]], shares: int) -> int:
    """The largest total gain of terms with gains at each share ``u / shares``, the shares summing to at most 1."""
    best = [0] * (shares + 1)
    for gain in gains:
        best = [max(best[s - u] + gain[u] for u in range(s + 1)) for s in range(shares + 1)]
    return best[shares]


def _charged_horizons(docs: Tuple[int, ...], lows: Tuple[int, ...], lengths: Sequence[int], counted: Sequence[int],
                      need: int, cap: float, share: float = 1.0, points: int = 33) -> int:
    """A lower bound on the sum of one horizon ``h`` of each document in ``docs`` plus ``share`` of the rows of the
    uncounted documents partly on the nodes U whose least tokens and most area are ``need`` and ``cap``: for one
    document d and its ``h_k``, U is made of d's last-token holder and its holders 1..k-1; for two, the union of
    such sets (``lows``: known lower bounds on the horizons).

    U holds every position of d from ``h_k = x`` on (the other holders' horizons are at most ``x``), ``s <= x`` of
    its positions below (area at least ``s (s + 1) / 2``), and ``t_e`` tokens of each other document e (area at
    least ``t_e (t_e + 1) / 2``; the whole document carries exactly its area). A document e partly on U
    (``0 < t_e < L_e``) with its last token off U moves at least ``t_e`` rows (U's holders' horizons add up to
    that much). With its last token on U, its ``q = L_e - t_e`` positions off U lie below the largest horizon
    ``r`` of their holders, so e moves ``r >= q`` rows and U keeps at least its area less ``q (2 r - q + 1) / 2``;
    for any prices that costs no less than e whole on U or off U (the price is linear in ``r``, then concave
    in ``q``: its minimum is at the ends), so each document's options are none, whole, or a head of ``t_e``
    tokens moving ``t_e`` rows. Priced at ``share`` per row instead of 1, both arguments hold unchanged.

    For given horizons x, the fewest charged rows C(x) of that relaxation is bounded below by Lagrangian duality
    (any area price ``lam`` and token reward ``mu`` give a bound; a grid of them is tried, each document's
    best ``t`` in closed form). C does not increase with any x (moving position x into the ``s`` tokens keeps
    the tokens and does not add area), so over a partition of each horizon's range into ``points`` points,
    ``sum x + C(x)`` is at least the cell's lower corner plus C at its upper corner: the least over the cells
    is a bound (the least cell partitioned again)."""
    inside = set(docs)
    others = Counter(n for e, n in enumerate(lengths) if e not in inside and n)
    free = Counter(lengths[e] for e in counted if e not in inside and lengths[e])
    sizes = np.array(sorted(others), dtype=np.float64)
    charged = np.array([others[n] - free.get(int(n), 0) for n in sizes], dtype=np.float64)
    uncharged = np.array([free.get(int(n), 0) for n in sizes], dtype=np.float64)
    mus = np.array([0.5, 0.9, 1.0, 1.05, 1.2, 1.5, 2.0, 3.0, 5.0, 10.0])
    mus = np.unique(np.concatenate([mus, share * mus]))  # a share of the rows: rewards on its scale too
    scales = np.geomspace(1.0, max(float(max(lengths[d] for d in docs)), 2.0) * 2, 24)
    mu = np.repeat(mus, len(scales))[:, None]
    lam = (2 * np.repeat(mus, len(scales)) / np.tile(scales, len(mus)))[:, None]

    def least(limit: np.ndarray, charge: bool) -> np.ndarray:
        """min over a document's options (none, a head of real t tokens, whole) of share x its rows + lam area - mu
        tokens, per (lam, mu) and size: the head's convex quadratic at its vertex clipped to [0, limit]."""
        def value(lo: np.ndarray, hi: np.ndarray, slope: float) -> np.ndarray:
            t = np.clip((mu + slope - lam / 2) / lam, lo, hi)
            return lam * t * (t + 1) / 2 - (mu + slope) * t
        if not charge:
            return value(0 * limit, limit, 0.0)
        return np.minimum(value(0 * limit, limit, -share), lam * limit * (limit + 1) / 2 - mu * limit)

    base = ((least(sizes, True) * charged).sum(axis=1) + (least(sizes, False) * uncharged).sum(axis=1)
            - lam[:, 0] * cap + mu[:, 0] * need)

    def own(d: int, x: np.ndarray) -> np.ndarray:
        """d's part of the dual at horizons x: its head below x (uncharged), its tail from x on."""
        length, x = lengths[d], x.astype(np.float64)
        return least(x, False) + lam * ((length - x) * (x + length + 1) / 2) - mu * (length - x)

    def cells(grids: List[np.ndarray]) -> np.ndarray:
        dual, low, n = base.reshape((-1,) + (1,) * len(docs)), 0, len(docs)
        for k, (d, grid) in enumerate(zip(docs, grids)):
            shape = [1] * n
            shape[k] = len(grid) - 1
            dual = dual + own(d, grid[1:]).reshape([-1] + shape)
            low = low + grid[:-1].reshape(shape)
        return low + np.maximum(dual.max(axis=0), 0.0)

    def partition(lo: int, hi: int) -> np.ndarray:
        grid = np.unique(np.linspace(lo, hi, points).astype(np.int64))
        return grid if len(grid) > 1 else np.array([lo, hi], dtype=np.int64)

    grids = [partition(low, lengths[d]) for d, low in zip(docs, lows)]
    values = cells(grids)
    least_cell = np.unravel_index(int(np.argmin(values)), values.shape)
    values[least_cell] = cells([partition(int(g[i]), int(g[i + 1])) for g, i in zip(grids, least_cell)]).min()
    return int(math.ceil(float(values.min()) - 1e-6))


class _Sparsest:
    """The least causal area ``r`` tokens of a batch can carry, leaving one document out: the ``r`` smallest
    (position + 1) values over the other documents (a token's area is its position + 1)."""

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = sorted(lengths)
        self.count, self.sums = [0], [0]
        for n in self.lengths:
            self.count.append(self.count[-1] + n)
            self.sums.append(self.sums[-1] + n * (n + 1) // 2)

    def _upto(self, v: int, skip: int) -> Tuple[int, int]:
        """(count, sum) of the values <= v, document of length ``skip`` left out."""
        i = bisect.bisect_right(self.lengths, v)
        wide = len(self.lengths) - i
        count, total = self.count[i] + wide * v, self.sums[i] + wide * v * (v + 1) // 2
        m = min(skip, v)
        return count - m, total - m * (m + 1) // 2

    def least(self, r: int, skip: int) -> float:
        if r <= 0:
            return 0.0
        if r > self.count[-1] - skip:
            return math.inf
        lo, hi = 0, self.lengths[-1]  # largest v with at most r values <= v
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._upto(mid, skip)[0] <= r else (lo, mid - 1)
        count, total = self._upto(lo, skip)
        return float(total + (r - count) * (lo + 1))


def _capacity_horizon(d: int, k: int, lengths: Sequence[int], num_nodes: int, node_tokens: int, cap: float,
                      sparsest: _Sparsest) -> int:
    """Smallest h_k (docstring of ``inter_node_rows_lower_bound``) such that some count ``s`` of document d's
    tokens off k nodes holding at most ``cap`` area fits: area - densest(s below h) + least(others) <= cap.
    The left side is convex in ``s`` (a concave area removed, a convex least area added): its minimum is
    where its increment turns non-negative, a bisection; it decreases with h: a bisection again."""
    length = lengths[d]
    area = causal_area(0, length)
    base = sum(lengths) - (num_nodes - k) * node_tokens - length  # other tokens on the k nodes when s = 0

    def excess(h: int) -> float:
        lo, hi = max(0, length - k * node_tokens), min(length, h, (num_nodes - k) * node_tokens)
        if lo > hi:
            return math.inf

        def f(s: int) -> float:
            return area - s * (2 * h - s + 1) / 2 + sparsest.least(base + s, length) - cap

        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if f(mid + 1) >= f(mid) else (mid + 1, hi)
        return f(lo)

    if excess(0) <= 0:
        return 0
    lo, hi = 0, length
    if excess(hi) > 0:
        return length  # no placement meets these caps: any count bounds its (empty) set; keep it finite
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if excess(mid) <= 0 else (mid, hi)
    return hi


def fewest_rows_two_nodes(doc_lengths: Sequence[int], node_tokens: int, imbalance: float = 1.0) -> Optional[int]:
    """The exact fewest key/value rows crossing between two nodes over every placement whose nodes hold at most
    ``node_tokens`` tokens and at most ``imbalance`` times the mean causal attention area; None when none does.
    For small batches (the work grows with the tokens times the area): the yardstick of ``tools/plan_report.py
    --exact``.

    With two nodes a document is whole on one node, or one node (the one without its last token) holds a set S
    of its positions and moves ``max(S) + 1`` rows (the horizon formula). For a horizon x and |S| = t the area
    of S (a position's area is its position + 1) takes every integer between x + t (t - 1) / 2 (the lowest
    positions) and x + (t - 1)(2x - t) / 2 (the highest below x - 1): a dynamic programme over the documents,
    the least rows per (tokens, area) of the first node, each option a range-minimum over an area window."""
    lengths = [int(n) for n in doc_lengths if n]
    total_tokens = sum(lengths)
    total_area = sum(causal_area(0, n) for n in lengths)
    if node_tokens * 2 < total_tokens:
        return None
    inf = np.iinfo(np.int64).max // 4
    best = np.full((node_tokens + 1, total_area + 1), inf, dtype=np.int64)  # [tokens on node 0, its area]
    best[0, 0] = 0
    for n in lengths:
        area_n = causal_area(0, n)
        # Sparse table of range minima along the area axis: levels[k][:, a] = min(best[:, a : a + 2**k]).
        levels = [best]
        while (1 << len(levels)) <= total_area + 1:
            half = 1 << (len(levels) - 1)
            prev = levels[-1]
            nxt = prev.copy()
            nxt[:, :-half] = np.minimum(prev[:, :-half], prev[:, half:])
            levels.append(nxt)

        def window_min(lo: int, hi: int) -> np.ndarray:
            """For every area a: min(best[:, a - hi .. a - lo]) (inf where the window is empty)."""
            out = np.full_like(best, inf)
            start = max(0, lo)  # target a >= lo, window start a - hi (clipped at 0)
            a = np.arange(start, total_area + 1)
            first = a - hi
            clipped = np.maximum(first, 0)
            last = a - lo  # inclusive
            span = last - clipped + 1
            ks = np.floor(np.log2(np.maximum(span, 1))).astype(np.int64)
            for kk in np.unique(ks):
                sel = ks == kk
                table = levels[int(kk)]
                left = table[:, clipped[sel]]
                right = table[:, last[sel] - (1 << int(kk)) + 1]
                out[:, a[sel]] = np.minimum(left, right)
            return out

        new = best.copy()  # whole on node 1
        if n <= node_tokens:  # whole on node 0
            new[n:, area_n:] = np.minimum(new[n:, area_n:], best[:node_tokens + 1 - n, :total_area + 1 - area_n])
        for x in range(1, n):
            for t in range(1, x + 1):
                lo, hi = x + t * (t - 1) // 2, x + (t - 1) * (2 * x - t) // 2
                for tokens, a_lo, a_hi in ((t, lo, hi), (n - t, area_n - hi, area_n - lo)):  # node 0 holds S / the rest
                    if tokens > node_tokens:
                        continue
                    moved = window_min(a_lo, a_hi)
                    shifted = np.full_like(best, inf)
                    shifted[tokens:] = moved[:node_tokens + 1 - tokens] + x
                    np.minimum(new, shifted, out=new)
        best = new
    cap = imbalance * total_area / 2
    lo_tokens = total_tokens - node_tokens
    areas = np.arange(total_area + 1)
    ok = (areas <= cap + 1e-9) & (total_area - areas <= cap + 1e-9)
    rows = best[max(0, lo_tokens):min(node_tokens, total_tokens) + 1][:, ok]
    value = int(rows.min()) if rows.size else inf
    return None if value >= inf else value


# ---- two nodes: a relaxation that enumerates the largest documents -------------------------------------------------

#: How a document of ``two_node_rows_lower_bound``'s enumeration is placed: whole on node 0 or 1, or cut, the part
#: without its last token (horizon x: max position + 1) on node 0 or on node 1.
WHOLE_0, WHOLE_1, CUT_0, CUT_1 = range(4)


def two_node_rows_lower_bound(doc_lengths: Sequence[int], node_tokens: Optional[int], imbalance: float = 1.0, *,
                              enumerated: int = 4, gap: float = 1e-3, max_boxes: int = 2000) -> int:
    """Key/value rows that must cross between two nodes in any placement whose nodes hold at most ``node_tokens``
    tokens (``None``: any counts) and at most ``imbalance`` times the mean causal attention area: a relaxation of
    the exact structure of ``fewest_rows_two_nodes`` for batches far too large for its table (tokens x area),
    tight where a few long documents decide the traffic (the bimodal mix: ``inter_node_rows_lower_bound``'s
    per-document terms are 0 where every placement must cut one of three documents, no two of which fit a node).

    Exact structure: a document is whole on one node, or the node without its last token holds a set S of its
    positions and it moves x = max(S) + 1 rows. Relaxed, every step only enlarging what a node may hold or
    lowering what it costs:

    - the ``enumerated`` longest documents are placed each of four ways (``WHOLE_0`` .. ``CUT_1``; the nodes are
      interchangeable, so the longest one's last token is on node 1); a cut one's part S of horizon <= x holds
      any real t in [0, x] tokens and any area between the sparsest and the densest t positions below x,
      t (t + 1) / 2 and t (2x - t + 1) / 2: every real S of horizon <= x is in it, and it grows with x;
    - the other documents are fluid: node 0 takes any fraction of each of their positions at no cost (every real
      placement of them is one such choice, and their rows count >= 0).

    For given ways and horizons, node 0's (tokens, area) ranges over a sum of convex sets; it misses the box of
    allowed (tokens, area) only if some line separates the two: the support function of a sum is the sum of the
    parts' (closed forms, ``_TwoNodeRelaxation``). Every (way, horizons) is called feasible unless one of the
    directions tried separates: a missed direction only lowers the bound. Then a branch and bound over boxes
    of horizons per way (``_least_horizons``): a box can hold a feasible point only if its upper corner is
    feasible, and its horizons sum to at least its lower corner's, raised to the tokens node 0 must gain or shed
    through cut parts (a part of horizon x holds at most x tokens). The least value taken from the queue bounds
    every box left in it, and the boxes dropped hold no feasible point, so it bounds the optimum; it is returned
    once within ``gap`` of the least sum of horizons found feasible (a lower corner), or after ``max_boxes``
    boxes (each only tightens the bound). No placement within the caps: the batch's tokens (any count bounds
    an empty set; kept finite).
    """
    lengths = sorted((int(n) for n in doc_lengths if n), reverse=True)
    _check_counts((("enumerated", enumerated, 1), ("max_boxes", max_boxes, 1)))
    if not 0.0 <= gap < 1.0:
        raise ValueError(f"gap={gap!r} must be in [0, 1)")
    _check_bound_arguments(lengths, 2, imbalance, node_tokens)
    if not lengths:
        return 0
    relaxation = _TwoNodeRelaxation(lengths, sum(lengths) if node_tokens is None else node_tokens, imbalance,
                                    enumerated)
    cut_lengths = relaxation.cut_lengths
    ways = np.array([w for w in itertools.product(range(4), repeat=len(cut_lengths)) if w[0] in (WHOLE_1, CUT_0)],
                    dtype=np.int64)
    ways = ways[~((ways >= CUT_0) & (cut_lengths < 2)).any(axis=1)]  # a one-token document cannot be cut
    cut = ways >= CUT_0
    rows = _least_horizons(relaxation, ways, cut.astype(np.int64), np.where(cut, cut_lengths - 1, 0), gap,
                           max_boxes)
    return sum(lengths) if rows is None else rows


class _TwoNodeRelaxation:
    """``two_node_rows_lower_bound``'s relaxation: which ways and horizons node 0's (tokens, area) may meet the
    allowed box with. ``cut_lengths``: the enumerated documents' lengths, longest first."""

    def __init__(self, lengths: Sequence[int], node_tokens: int, imbalance: float, enumerated: int) -> None:
        self.cut_lengths = np.array(lengths[:enumerated], dtype=np.int64)
        self._lengths = self.cut_lengths.astype(np.float64)
        self._areas = self._lengths * (self._lengths + 1) / 2
        self._fluid = np.array(sorted(lengths[enumerated:]), dtype=np.float64)
        self._fluid_tokens = np.concatenate([[0.0], np.cumsum(self._fluid)])
        self._fluid_areas = np.concatenate([[0.0], np.cumsum(self._fluid * (self._fluid + 1) / 2)])
        self.total = sum(lengths)
        self.total_area = sum(causal_area(0, n) for n in lengths)
        cap = imbalance * self.total_area / 2
        self.tokens = (self.total - node_tokens, node_tokens)  # node 0's allowed tokens, area
        self.area = (self.total_area - cap, cap)
        # Token prices in area units (a token's area is its position + 1: 1 .. the longest document), both signs.
        prices = np.geomspace(0.25, 8.0 * lengths[0], 300)
        self._prices = np.concatenate([-prices[::-1], [0.0], prices])

    def least_sum(self, way: np.ndarray, low: np.ndarray) -> int:
        """A lower bound on the horizons' sum over a box with lower corner ``low`` (one row per document) from the
        tokens alone: node 0 holds at most its whole documents, the fluid ones and x of each ``CUT_0`` part, at
        least its documents less x of each ``CUT_1`` part."""
        held = int(self.cut_lengths[(way == WHOLE_0) | (way == CUT_1)].sum())
        gain = self.tokens[0] - held - int(self._fluid_tokens[-1])
        shed = held - self.tokens[1]
        return max(int(low[way == CUT_0].sum()), gain) + max(int(low[way == CUT_1].sum()), shed)

    def feasible(self, ways: np.ndarray, horizons: np.ndarray) -> np.ndarray:
        """[n] bool: no direction tried separates node 0's (tokens, area) set from the allowed box, for each row
        of ``ways`` and ``horizons`` ([n, enumerated]: a way and, for a cut, the horizon of each document).
        Directions (token price mu, area sign lam): lam = 0 (the token counts alone) and +-1 with mu a grid."""
        held = (ways == WHOLE_0) | (ways == CUT_1)
        tokens, area = held @ self._lengths, held @ self._areas
        fits = np.ones(len(ways), dtype=bool)
        for lam, prices in ((0.0, np.array([1.0, -1.0])), (1.0, self._prices), (-1.0, self._prices)):
            mu = prices[None, :]
            support = mu * tokens[:, None] + lam * area[:, None] + self._fluid_support(mu, lam)
            for d in range(ways.shape[1]):
                x = horizons[:, d:d + 1].astype(np.float64)
                support = support + np.where(ways[:, d:d + 1] == CUT_0, _cut_support(mu, lam, x), 0.0)
                support = support + np.where(ways[:, d:d + 1] == CUT_1, _cut_support(-mu, -lam, x), 0.0)
            least = np.minimum(mu * self.tokens[0], mu * self.tokens[1]) + lam * self.area[0 if lam > 0 else 1]
            # A direction separates only beyond rounding (float64 sums of terms up to mu x tokens and the area).
            tolerance = 1e-10 * (np.abs(mu) * self.total + abs(lam) * self.total_area) + 1e-6
            fits &= (support + tolerance >= least).all(axis=1)
        return fits

    def _fluid_support(self, mu: np.ndarray, lam: float) -> np.ndarray:
        """max of mu tokens + lam area over the fluid documents' fractions on node 0: the sum over their positions
        of max(0, mu + lam v), v = position + 1."""
        if lam == 0:
            return np.maximum(mu, 0.0) * self._fluid_tokens[-1]
        if lam < 0:
            return self._below(mu)
        return mu * self._fluid_tokens[-1] + self._fluid_areas[-1] + self._below(-mu)

    def _below(self, c: np.ndarray) -> np.ndarray:
        """The sum over the fluid positions with v < c of c - v: the first min(L, ceil(c) - 1) of each."""
        m = np.maximum(np.ceil(c) - 1, 0.0)
        i = np.searchsorted(self._fluid, m, side="right")  # documents no longer than m: all their positions
        rest = len(self._fluid) - i
        return c * self._fluid_tokens[i] - self._fluid_areas[i] + rest * (m * c - m * (m + 1) / 2)


def _cut_support(mu: np.ndarray, lam: float, x: np.ndarray) -> np.ndarray:
    """max of mu t + lam a over a cut part of horizon <= x (t in [0, x], a between t (t + 1) / 2 and
    t (2x - t + 1) / 2): for lam = +-1 a concave quadratic in t at its vertex clipped to [0, x]."""
    if lam == 0:
        return np.maximum(mu * x, 0.0)
    slope = mu + (x + 0.5 if lam > 0 else -0.5)  # d/dt of mu t + lam a at t = 0, the quadratic's -t^2/2 aside
    t = np.clip(slope, 0.0, x)
    return t * (slope - t / 2)


def _least_horizons(relaxation: _TwoNodeRelaxation, ways: np.ndarray, low: np.ndarray, high: np.ndarray, gap: float,
                    max_boxes: int) -> Optional[int]:
    """The branch and bound of ``two_node_rows_lower_bound`` from one box [low, high] of horizons per way (the
    arrays' rows: [n, enumerated] each); None when no box is feasible."""
    queue: List[Tuple[int, int, np.ndarray, np.ndarray, np.ndarray]] = []
    order = itertools.count()
    best = math.inf  # the least sum of horizons known feasible

    def push(ways: np.ndarray, low: np.ndarray, high: np.ndarray) -> None:
        nonlocal best
        fits, reached = relaxation.feasible(ways, high), relaxation.feasible(ways, low)
        for way, lo, hi, exact in zip(ways[fits], low[fits], high[fits], reached[fits]):
            if exact:  # its lower corner is feasible: the box's least sum, reached
                hi = lo
                best = min(best, int(lo.sum()))
            heapq.heappush(queue, (relaxation.least_sum(way, lo), next(order), way, lo, hi))

    push(ways, low, high)
    for _ in range(max_boxes):
        if not queue:
            return None
        value, _, way, lo, hi = heapq.heappop(queue)
        if value >= (1 - gap) * best or not (hi > lo).any():
            return value
        d = int(np.argmax(hi - lo))  # split the widest horizon range in 16
        edges = np.unique(np.linspace(lo[d], hi[d] + 1, 17).astype(np.int64))
        lows, highs = np.repeat(lo[None], len(edges) - 1, axis=0), np.repeat(hi[None], len(edges) - 1, axis=0)
        lows[:, d], highs[:, d] = edges[:-1], edges[1:] - 1
        push(np.repeat(way[None], len(lows), axis=0), lows, highs)
    return queue[0][0] if queue else None
