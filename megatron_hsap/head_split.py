"""How a Ulysses group of P ranks shares one TP rank's H query heads and H_kv KV heads.

Any H and H_kv (H a multiple of H_kv) with any P: Ulysses rank r attends a contiguous range
of query heads, floor(H/P) or ceil(H/P) of them, so concatenating the ranks' outputs in rank
order restores the head order exactly. A rank receives exactly the KV heads its query heads
use (query head q uses KV head q // G, G = H / H_kv): a KV head whose query heads span two
ranks goes to both and its gradient is summed back on the rank that owns its tokens. Which
ranks get the ceil is chosen to send the fewest KV heads (then to need the fewest kernel
calls, see ``gqa_runs``); ties go to the lower ranks. Pure bookkeeping, shared by
``context_parallel_attention``, UPipe's stage schedule and ``BatchPlan.stats``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, Sequence, Tuple

__all__ = ["HeadSplit", "split_heads", "gqa_runs", "check_positive_int", "check_head_chunk_size"]

#: (first query, end query, first KV, end KV), indices local to one rank's heads.
Run = Tuple[int, int, int, int]


def check_positive_int(name: str, value: object) -> int:
    """``value`` if it is a positive int, else a ValueError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return value


def gqa_runs(kv_of_query: Sequence[int]) -> Tuple[Run, ...]:
    """Split query heads (each with the KV head it uses, non-decreasing) into maximal runs that the kernels'
    GQA convention covers: inside a run every KV head serves the same number of adjacent query heads
    (local query i of a run uses local KV i // (queries / KV heads)). E.g. KV [0, 1, 1] -> two runs."""
    runs = []
    start = 0
    kv_start = 0
    for i in range(1, len(kv_of_query) + 1):
        if i < len(kv_of_query) and kv_of_query[i] == kv_of_query[i - 1]:
            continue
        count = i - start  # queries of KV head kv_of_query[i - 1]
        if runs and (runs[-1][1] - runs[-1][0]) // (runs[-1][3] - runs[-1][2]) == count:
            q0, _, k0, k1 = runs[-1]
            runs[-1] = (q0, i, k0, k1 + 1)
        else:
            runs.append((start, i, kv_start, kv_start + 1))
        start, kv_start = i, kv_start + 1
    return tuple(runs)


@dataclass(frozen=True)
class HeadSplit:
    """The split of one TP rank's heads over a Ulysses group (build with ``split_heads``).

    bounds: P + 1 query-head boundaries; Ulysses rank r attends query heads [bounds[r], bounds[r + 1]).
    """

    num_heads_q: int
    num_heads_kv: int
    ulysses_size: int
    bounds: Tuple[int, ...]

    @property
    def group_size(self) -> int:
        """G: query heads per KV head."""
        return self.num_heads_q // self.num_heads_kv

    def query_range(self, rank: int) -> range:
        return range(self.bounds[rank], self.bounds[rank + 1])

    def kv_range(self, rank: int) -> range:
        """The KV heads rank ``rank``'s query heads use (contiguous; empty when it has no query heads)."""
        q = self.query_range(rank)
        return range(q.start // self.group_size, (q.stop - 1) // self.group_size + 1) if len(q) else range(0)

    @property
    def query_counts(self) -> Tuple[int, ...]:
        return tuple(len(self.query_range(r)) for r in range(self.ulysses_size))

    @property
    def kv_counts(self) -> Tuple[int, ...]:
        return tuple(len(self.kv_range(r)) for r in range(self.ulysses_size))

    @property
    def kv_heads_held(self) -> int:
        """KV heads over all ranks of the group (a KV head held by two ranks counts twice)."""
        return sum(self.kv_counts)

    def runs(self, rank: int) -> Tuple[Run, ...]:
        """``gqa_runs`` of rank ``rank``'s query heads (one attention call each)."""
        return gqa_runs([q // self.group_size for q in self.query_range(rank)])


def split_heads(num_heads_q: int, num_heads_kv: int, ulysses_size: int) -> HeadSplit:
    """The ``HeadSplit`` of H = num_heads_q, H_kv = num_heads_kv (per TP rank) over P = ulysses_size.

    Raises ValueError naming the argument unless all three are positive ints and H is a multiple
    of H_kv. H < P is allowed (ranks past H attend no heads).
    """
    h = check_positive_int("num_heads_q", num_heads_q)
    h_kv = check_positive_int("num_heads_kv", num_heads_kv)
    p = check_positive_int("ulysses_size", ulysses_size)
    if h_kv > h:
        raise ValueError(f"num_heads_kv={h_kv} must not exceed num_heads_q={h} (GQA/MQA/MHA only)")
    if h % h_kv != 0:
        raise ValueError(f"num_heads_q={h} must be a multiple of num_heads_kv={h_kv}; allowed num_heads_kv: "
                         f"{[k for k in range(1, h + 1) if h % k == 0]}")
    return _split(h, h_kv, p)


@lru_cache(maxsize=256)
def _split(h: int, h_kv: int, p: int) -> HeadSplit:
    """Dynamic program over ranks: state = ceil-sized ranks placed so far; cost = (KV heads sent, kernel calls)."""
    base, extra = divmod(h, p)
    g = h // h_kv
    best: Dict[int, Tuple[Tuple[int, int], Tuple[int, ...]]] = {0: ((0, 0), ())}
    for rank in range(p):
        nxt: Dict[int, Tuple[Tuple[int, int], Tuple[int, ...]]] = {}
        for ceils, (cost, sizes) in best.items():
            start = rank * base + ceils
            for add in (1, 0):
                left = extra - ceils - add  # ceil-sized ranks still to place, on p - rank - 1 ranks
                if left < 0 or left > p - rank - 1:
                    continue
                end = start + base + add
                kv = gqa_runs([q // g for q in range(start, end)])
                sent = (end - 1) // g - start // g + 1 if end > start else 0
                cand = ((cost[0] + sent, cost[1] + len(kv)), sizes + (base + add,))
                if ceils + add not in nxt or cand[0] < nxt[ceils + add][0]:
                    nxt[ceils + add] = cand
        best = nxt
    bounds = [0]
    for size in best[extra][1]:
        bounds.append(bounds[-1] + size)
    return HeadSplit(h, h_kv, p, tuple(bounds))


def check_head_chunk_size(head_chunk_size: object, num_heads_q: int, ulysses_size: int) -> int:
    """U query heads per UPipe stage: a multiple of the Ulysses size P below H, or H itself (one stage, plain
    Ulysses). Each rank then attends ceil(U / P) of its heads per stage; the last stage may hold fewer."""
    u = check_positive_int("head_chunk_size", head_chunk_size)
    allowed = sorted(set(range(ulysses_size, num_heads_q, ulysses_size)) | {num_heads_q})
    if u not in allowed:
        raise ValueError(f"head_chunk_size={u} must be a multiple of ulysses_size={ulysses_size} below the query "
                         f"heads per TP rank ({num_heads_q}), or all of them; allowed values: {allowed}")
    return u
