"""Many short, whole documents shared among the bins of one node in bulk: exact tokens, balanced attention.

A node whose items are all short documents (none the placement may cut, ``PlacementConfig.short``) still needs
each of its ring members filled with exactly its token capacity and an attention area within the slack of its
target. Documents of one length are interchangeable (the same tokens, the same causal area ``l * (l + 1) / 2``), so
a split is an integer matrix, ``counts[b, c]``: how many documents of the ``c``-th distinct length bin ``b`` takes.
Its size is the bins times the distinct lengths, whatever the number of documents, so a node of 10^4-10^5 short
documents is split with a few dozen small numpy operations instead of a bisection per member (each a Python pass
over its items: docs/sequence_aware.md, "Nodes of short documents"):

1. A bin whose target lies beyond the most (or below the least) area its tokens can carry -- its cap filled with
   the longest (shortest) documents -- is out of reach: declined at once. Else every bin takes its proportional
   share of each length (floors); the remainders, longest first, go one each to the bins short of the most tokens.
2. Tokens made exact: the bin with the most tokens over its capacity gives the one with the most under it a
   document, or swaps two of different lengths, moving as many tokens as both need if possible, of the moves that
   do, the one leaving both areas nearest their targets.
3. Areas balanced at fixed tokens: the bin furthest over its target and the one furthest under it exchange one
   or two documents for one or two of as many tokens in all (lengths ``a + b = c + d``, a length 0 standing for
   none: ``(a**2 + b**2 - c**2 - d**2) / 2`` pairs of area move; ``l`` for ``l1 + l2``: ``l1 * l2``), as many times
   as brings them nearest even, while that brings the worse of the two nearer its target: past the tolerance, so a
   node ends about as balanced as its documents allow (an equal area is rarely an integer).

Where a step finds no move (few documents or few distinct lengths), or a bin ends off its tolerance, there is no
split: the caller bisects.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from megatron_hsap.sequence.placement_config import PlacementConfig

__all__ = ["share_whole"]


def share_whole(lengths: np.ndarray, caps: Sequence[int], targets: Sequence[float], tolerances: Sequence[float],
                most_lengths: int = PlacementConfig.whole_lengths) -> Optional[np.ndarray]:
    """The bin of each document, int64 ``[n]``, for whole documents of ``lengths`` (int64 ``[n]``, each >= 1;
    area ``l * (l + 1) / 2`` pairs): bin ``b`` gets exactly ``caps[b]`` tokens and an area within ``tolerances[b]``
    (> 0) of ``targets[b]``. None where the exchanges find none, the lengths do not add up to the capacities, or
    there are more than ``most_lengths`` distinct lengths (``PlacementConfig.whole_lengths``) or one of 2**16 tokens or more (the exchanges' keys exact
    in float64 below it).
    Deterministic: the documents of one length go to the bins in bin order, by position in ``lengths``."""
    caps_all = np.asarray(caps, dtype=np.int64)
    if len(lengths) == 0 or int(lengths.sum()) != int(caps_all.sum()):
        return None
    bins = np.flatnonzero(caps_all > 0)  # the others take nothing
    cap = caps_all[bins]
    target = np.asarray(targets, dtype=np.float64)[bins]
    tolerance = np.asarray(tolerances, dtype=np.float64)[bins]
    per_length = np.bincount(lengths)
    values = np.flatnonzero(per_length)  # the distinct lengths, increasing
    if len(values) > most_lengths or values[-1] >= 1 << 16:
        return None
    available = per_length[values]
    areas = values * (values + 1) // 2
    if not _reachable(cap, target, tolerance, values, available, areas):
        return None
    counts = available[None, :] * cap[:, None] // int(cap.sum())
    needed = cap - counts @ values
    for c in np.flatnonzero(available > counts.sum(axis=0))[::-1].tolist():
        taking = np.argsort(-needed, kind="stable")[:int(available[c] - counts[:, c].sum())]
        counts[taking, c] += 1
        needed[taking] -= values[c]
    over = (counts @ areas).astype(np.float64) - target
    if not _exact_tokens(counts, -needed, over, values, areas, tolerance):
        return None
    if not _balanced_areas(counts, over, values, tolerance):
        return None
    labels = np.repeat(np.tile(bins, len(values)), counts.T.ravel())  # by length, then bin
    order = np.argsort(lengths.astype(np.uint16), kind="stable")  # (a radix sort)
    out = np.empty(len(lengths), dtype=np.int64)
    out[order] = labels
    return out


def _reachable(cap: np.ndarray, target: np.ndarray, tolerance: np.ndarray, values: np.ndarray,
               available: np.ndarray, areas: np.ndarray) -> bool:
    """Whether every bin's target lies within its tolerance of the least and the most area its cap of tokens can
    carry: the shortest or the longest documents, the last one counted in part (bounds for whole documents). Where
    not (a bin holding tail padding, whose share of the attention only documents longer than these reach), no
    exchange gets there: declined at once."""
    tokens = np.concatenate([[0], np.cumsum(values * available)])  # longest last
    area = np.concatenate([[0], np.cumsum(areas * available)]).astype(np.float64)
    least = np.interp(cap, tokens, area)  # (linear between the documents of one length: their area per token)
    most = area[-1] - np.interp(tokens[-1] - cap, tokens, area)
    return bool(np.all((least - tolerance <= target) & (target <= most + tolerance)))


def _worse(over_a: np.ndarray, tolerance_a: float, over_b: np.ndarray, tolerance_b: float) -> np.ndarray:
    """The larger of two bins' area errors, each in its tolerance (arrays of candidate moves)."""
    return np.maximum(np.abs(over_a) / tolerance_a, np.abs(over_b) / tolerance_b)


def _exact_tokens(counts: np.ndarray, surplus: np.ndarray, over: np.ndarray, values: np.ndarray, areas: np.ndarray,
                  tolerance: np.ndarray) -> bool:
    """Step 2: ``counts`` changed so that no bin's ``surplus`` (tokens over its capacity, summing to 0) is left;
    ``surplus`` and ``over`` (area over the target) kept up to date. False where no move is left."""
    # A move: the giver's document of length values[c] for the taker's of values[d] (d = 0: none).
    lengths_back = np.concatenate([[0], values])
    areas_back = np.concatenate([[0], areas]).astype(np.float64)
    moved_tokens = values[:, None] - lengths_back[None, :]
    moved_area = areas[:, None].astype(np.float64) - areas_back[None, :]
    while True:
        giver, taker = int(np.argmax(surplus)), int(np.argmin(surplus))
        gap = min(int(surplus[giver]), -int(surplus[taker]))
        if gap <= 0:
            return True
        has_back = np.concatenate([[True], counts[taker] > 0])
        allowed = (counts[giver] > 0)[:, None] & has_back[None, :] & (moved_tokens > 0) & (moved_tokens <= gap)
        if not allowed.any():
            return False
        allowed &= moved_tokens == moved_tokens[allowed].max()  # the most tokens (all of the gap if possible)
        worst = _worse(over[giver] - moved_area, tolerance[giver], over[taker] + moved_area, tolerance[taker])
        c, d = np.unravel_index(np.argmin(np.where(allowed, worst, np.inf)), allowed.shape)
        counts[giver, c] -= 1
        counts[taker, c] += 1
        if d:
            counts[taker, d - 1] -= 1
            counts[giver, d - 1] += 1
        surplus[giver] -= moved_tokens[c, d]
        surplus[taker] += moved_tokens[c, d]
        over[giver] -= moved_area[c, d]
        over[taker] += moved_area[c, d]


def _balanced_areas(counts: np.ndarray, over: np.ndarray, values: np.ndarray, tolerance: np.ndarray,
                    rounds: int = 32) -> bool:
    """Step 3: ``counts`` changed at fixed tokens, bringing the bins nearer their targets (``over``: area over them,
    kept up to date) while some move brings the worse of the two bins furthest off nearer (at most ``rounds`` plus
    one per bin). True where every bin ends within its tolerance.

    A move: the bin furthest over its target gives a pair (two documents, or one) for a pair of as many tokens of
    the bin furthest under it, ``t`` times over; lengths ``a, b`` for ``c, d`` (``a + b = c + d``) move
    ``(a**2 + b**2 - c**2 - d**2) / 2`` pairs of area. Each round weighs, for every pair the first bin holds, four
    pairs of the second of as many tokens, each ``t`` times (``t`` nearest the wanted move, at least once): the
    two whose area moved is nearest the wanted move (either side of it), and those of the least and the most area."""
    # Pairs (i, j), i <= j, of the lengths and none (index 0: no document, always available), by tokens then area.
    lengths_or_none = np.concatenate([[0], values])
    first, second = np.triu_indices(len(lengths_or_none))
    first, second = first[1:], second[1:]  # not (none, none)
    a, b = lengths_or_none[first], lengths_or_none[second]
    tokens, area = a + b, (a * (a + 1) + b * (b + 1)) // 2
    scale = int(area.max()) + 1
    order = np.lexsort((area, tokens))
    first, second, tokens, area = first[order], second[order], tokens[order], area[order]
    key = (tokens * scale + area).astype(np.float64)  # increasing; exact (below 2**53 for lengths below 2**16)
    same = first == second
    for _ in range(rounds + len(counts)):
        error = over / tolerance
        high, low = int(np.argmax(error)), int(np.argmin(error))
        now = max(error[high], -error[low])
        if now == 0.0:
            break
        # The area that leaves both bins equally far off in their tolerances (their worst the least).
        wanted = (tolerance[low] * over[high] - tolerance[high] * over[low]) / (tolerance[high] + tolerance[low])
        have = [_pairs_held(counts[b], first, second, same) for b in (high, low)]
        gives = np.flatnonzero(have[0])
        takes = np.flatnonzero(have[1])
        if not len(gives) or not len(takes):
            break
        keys = key[takes]
        near = np.searchsorted(keys, key[gives] - wanted)
        group = np.searchsorted(keys, (tokens[gives] * scale).astype(np.float64))
        group_end = np.searchsorted(keys, (tokens[gives] * scale + scale - 1).astype(np.float64), side="right") - 1
        p = np.repeat(gives, 4)
        q = np.clip(np.stack([near - 1, near, group, group_end], axis=1).ravel(), 0, len(takes) - 1)
        q = takes[q]
        unit = (area[p] - area[q]).astype(np.float64)  # from `high` to `low`, per move
        valid = (tokens[p] == tokens[q]) & (unit != 0)
        most = np.minimum(have[0][p], have[1][q])
        times = np.clip(np.rint(wanted / np.where(valid, unit, 1.0)), 1, np.maximum(most, 1))
        moved = times * unit
        worst = np.where(valid, _worse(over[high] - moved, tolerance[high], over[low] + moved, tolerance[low]),
                         np.inf)
        k = int(np.argmin(worst))
        if not worst[k] < now:
            break
        t = int(times[k])
        for b, pair, sign in ((high, p[k], -t), (low, p[k], t), (low, q[k], -t), (high, q[k], t)):
            for c in (first[pair], second[pair]):
                if c:
                    counts[b, c - 1] += sign
        over[high] -= moved[k]
        over[low] += moved[k]
    return bool(np.all(np.abs(over) <= tolerance))


def _pairs_held(counts: np.ndarray, first: np.ndarray, second: np.ndarray, same: np.ndarray) -> np.ndarray:
    """How many times a bin holding ``counts`` documents of each length can give each pair (``first``, ``second``:
    indices into none and the lengths)."""
    held = np.concatenate([[1 << 40], counts])
    times = np.minimum(held[first], held[second])
    times[same] = held[first[same]] // 2
    return times
