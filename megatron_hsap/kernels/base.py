"""The local attention kernel interface: one rank, packed tokens, block-sparse mask.

Every distributed algorithm in this package reduces to calls of this interface:
"these query rows attend to these key rows, causally or fully". It mirrors
flash-attn's varlen functions (forward returns the log-sum-exp, backward takes
the *final* output and LSE), so partial results from several calls can be merged
exactly with the LSE and a ring backward can reuse the global softmax statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, Tuple

import torch


@dataclass(frozen=True)
class AttentionBlocks:
    """Which (query-range, key-range) pairs one kernel call computes.

    Block i lets query rows ``q[q_starts[i]:q_ends[i]]`` attend to key rows
    ``k[k_starts[i]:k_ends[i]]``. A causal block is bottom-right aligned like
    flash-attn >= 2.1: with ``sq = q_end - q_start`` and ``sk = k_end - k_start``,
    query row ``a`` (0-based in the block) sees key ``b`` iff ``b <= a + sk - sq``.
    Several blocks may share query rows (their contributions are merged with the
    log-sum-exp); for one query row the key ranges of its blocks must not overlap.
    Query rows covered by no block get output 0 and LSE -inf.
    ``windows`` (empty = none) adds a sliding-window band per block in flash-attn's bottom-right
    convention: with window ``(left, right)`` query row ``a`` sees key ``b`` only if
    ``a + sk - sq - left <= b <= a + sk - sq + right`` (-1 = no bound on that side), on top of
    the causal rule. The schedule emits windowed blocks trimmed to the rows and keys the band
    reaches, so every row of such a block sees at least one key.
    All entries are Python ints so the structure is cheap to build, hash and cache.

    Worked example (1 = attended), one block ``(0, sq, 0, sk)``; the last query row always lines up
    with the last key (bottom-right alignment, as flash-attn's ``causal=True``)::

        causal, sq = 3, sk = 5     causal, sq = 5, sk = 3     causal + window (1, 0), sq = 3, sk = 5
              k0 k1 k2 k3 k4             k0 k1 k2                   k0 k1 k2 k3 k4
          q0   1  1  1  0  0         q0   0  0  0               q0   0  1  1  0  0
          q1   1  1  1  1  0         q1   0  0  0               q1   0  0  1  1  0
          q2   1  1  1  1  1         q2   1  0  0               q2   0  0  0  1  1
                                     q3   1  1  0
                                     q4   1  1  1

    In the middle matrix rows q0 and q1 see no key: their output is 0 and their LSE -inf. With the window
    ``(left, right) = (1, 0)`` query row a sees keys ``a + sk - sq - 1 .. a + sk - sq``.
    (``tests/test_torch_kernel.py`` checks these matrices against the reference mask.)
    """

    q_starts: Tuple[int, ...] = ()
    q_ends: Tuple[int, ...] = ()
    k_starts: Tuple[int, ...] = ()
    k_ends: Tuple[int, ...] = ()
    causal: Tuple[bool, ...] = ()
    windows: Tuple[Tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        n = len(self.q_starts)
        if not (len(self.q_ends) == len(self.k_starts) == len(self.k_ends) == len(self.causal) == n):
            raise ValueError("AttentionBlocks fields must all have the same length")
        if self.windows and len(self.windows) != n:
            raise ValueError("AttentionBlocks.windows must be empty or have one (left, right) per block")

    def __len__(self) -> int:
        return len(self.q_starts)

    @staticmethod
    def from_list(blocks: Sequence[tuple]) -> "AttentionBlocks":
        """Build from ``(q_start, q_end, k_start, k_end, causal)`` tuples, optionally with a sixth entry
        ``(left, right)`` (the block's window, see the class doc); empty blocks are dropped."""
        kept = [b for b in blocks if b[1] > b[0] and b[3] > b[2]]
        if not kept:
            return AttentionBlocks()
        windows = tuple(tuple(b[5]) if len(b) > 5 else UNBOUNDED for b in kept)
        qs, qe, ks, ke, c = zip(*(b[:5] for b in kept))
        return AttentionBlocks(tuple(qs), tuple(qe), tuple(ks), tuple(ke), tuple(bool(x) for x in c),
                               windows if any(w != UNBOUNDED for w in windows) else ())

    def __iter__(self):
        return iter(zip(self.q_starts, self.q_ends, self.k_starts, self.k_ends, self.causal))

    def window(self, i: int) -> Tuple[int, int]:
        """Block ``i``'s window ``(left, right)``; ``(-1, -1)`` when it has none."""
        return self.windows[i] if self.windows else UNBOUNDED

    def bands(self):
        """Per block ``(q_start, q_end, k_start, k_end, lo, hi)``: key ``j`` is visible from query row ``i``
        (buffer indices) iff ``lo <= j - i <= hi``; None = no bound."""
        for i, (qs, qe, ks, ke, causal) in enumerate(self):
            yield (qs, qe, ks, ke) + diagonal_bounds(qe, ke, causal, self.window(i))

    def area(self) -> int:
        """Number of (query, key) pairs that are attended: the mask area FLOPs follow."""
        return sum(band_area(qs, qe, ks, ke, lo, hi) for qs, qe, ks, ke, lo, hi in self.bands())


#: The window of a block without one.
UNBOUNDED = (-1, -1)


def diagonal_bounds(q_end: int, k_end: int, causal: bool,
                    window: Tuple[int, int] = UNBOUNDED) -> Tuple[Optional[int], Optional[int]]:
    """Bounds ``(lo, hi)`` on ``key - query`` (buffer indices, None = unbounded) of a bottom-right-aligned
    block ending at ``q_end`` / ``k_end`` with this causal flag and window (see ``AttentionBlocks``)."""
    offset = k_end - q_end
    left, right = window
    lo = offset - left if left >= 0 else None
    hi = offset + right if right >= 0 else None
    if causal:
        hi = offset if hi is None else min(hi, offset)
    return lo, hi


def band_area(qs: int, qe: int, ks: int, ke: int, lo: Optional[int], hi: Optional[int]) -> int:
    """Pairs (i, j) in ``[qs, qe) x [ks, ke)`` with ``lo <= j - i <= hi`` (None = unbounded), in O(1)."""
    def below(bound: Optional[int]) -> int:  # pairs with j - i <= bound
        if bound is None:
            return max(0, qe - qs) * max(0, ke - ks)
        # row i sees keys [ks, min(ke, i + bound + 1)): sum over rows of a clipped linear function
        total = 0
        first_full = max(qs, ke - bound - 1)  # rows from here see all keys
        if first_full < qe:
            total += (qe - first_full) * (ke - ks)
        top = max(qs, ks - bound)  # rows before this see none
        end = min(qe, first_full)
        if end > top:  # rows [top, end) see i + bound + 1 - ks keys: an arithmetic series
            n = end - top
            total += n * (top + bound + 1 - ks) + n * (n - 1) // 2
        return total
    if lo is None:
        return below(hi)
    return max(0, below(hi) - below(lo - 1))


class AttentionKernel(Protocol):
    """A local attention implementation (torch, flash-attn, TransformerEngine).

    Layouts: q ``[t_q, h_q, d]``, k/v ``[t_k, h_kv, d]`` with ``h_q % h_kv == 0``
    (query head j uses KV head ``j // (h_q // h_kv)``); out ``[t_q, h_q, d]`` in
    q's dtype; lse ``[h_q, t_q]`` float32, float64 for fp64 inputs (natural log of the softmax denominator
    after scaling). All tensors live on this rank and describe this rank's data.
    """

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: AttentionBlocks,
                softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
        ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, blocks: AttentionBlocks,
                 softmax_scale: float, grad_dtype: Optional[torch.dtype] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients for one call, given the *final* out/lse of the rows (which may
        merge several calls). Returns dq, dk, dv in float32 (float64 for fp64), for
        callers that accumulate across calls before casting; a caller that makes this
        one call passes ``grad_dtype`` (its inputs' dtype) and gets them in it, the same
        values, which spares a fused kernel whose one library call covers every row the
        float32 copies of its gradients."""
        ...


def check_kernel_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: AttentionBlocks,
                        supported_dtypes: Optional[Tuple[torch.dtype, ...]] = None) -> None:
    """Validate shapes, dtypes and block bounds; raises ValueError naming the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must have layout [t, h, d], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[2]} and {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"h_q={q.shape[1]} must be a multiple of h_kv={k.shape[1]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if supported_dtypes is not None and q.dtype not in supported_dtypes:
        raise ValueError(f"dtype {q.dtype} is not supported by this kernel; allowed: {supported_dtypes}")
    if not (q.device == k.device == v.device):
        raise ValueError("q, k, v must be on the same device")
    tq, tk = q.shape[0], k.shape[0]
    for qs, qe, ks, ke, _ in blocks:
        if not (0 <= qs <= qe <= tq and 0 <= ks <= ke <= tk):
            raise ValueError(f"attention block q[{qs}:{qe}] k[{ks}:{ke}] is out of bounds for t_q={tq}, t_k={tk}")


def merge_partial_attention_(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor,
                             part_lse: torch.Tensor) -> torch.Tensor:
    """Fold a softmax-normalised partial result over a disjoint key set into ``out``, exactly, in place.

    out ``[t, h, d]`` (the accumulator, float32 or float64) is updated in place; part_out ``[t, h, d]``
    may be in the inputs' dtype; lse/part_lse ``[h, t]``. Returns the merged lse. Rows where one side
    saw no keys (lse = -inf) take the other side unchanged. No temporaries of out's size.
    """
    new_lse = torch.logaddexp(lse, part_lse)
    safe = new_lse.masked_fill(torch.isinf(new_lse), 0.0)
    w_old = (lse - safe).exp_().t().unsqueeze(-1)
    w_new = (part_lse - safe).exp_().t().unsqueeze(-1)
    out.mul_(w_old).addcmul_(part_out, w_new)
    return new_lse
