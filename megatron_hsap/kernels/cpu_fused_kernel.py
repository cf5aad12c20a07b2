"""Attention on CPU with PyTorch's fused flash-attention operator (the one behind SDPA on CPU).

``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` computes softmax attention
in one C++ call and returns the log-sum-exp; its ``_backward`` takes ``out`` and ``logsumexp``
as inputs and forms ``P = exp(scale * q k^T - lse)`` and ``D = rowsum(dout * out)`` from them.
Given the *final* out/lse of rows that several calls merged, it therefore yields exactly each
call's share of the gradients, which is what ``AttentionKernel.backward`` promises. The
operator takes ``[b, h, s, d]`` tensors of any strides (a ``[t, h, d]`` slice is a view),
supports GQA natively with this package's convention (query head j uses KV head ``j // g``),
float32/float64 natively, and returns ``out`` laid out ``[b, s, h, d]`` in memory and the LSE
in the input dtype (float32 for half inputs).

Mapping blocks onto the operator (the schedule is built once per ``AttentionBlocks`` and cached):

- its ``is_causal`` is top-left aligned, which equals this package's bottom-right alignment only
  for square blocks. A causal block with ``sq < sk`` becomes a full piece over its first
  ``sk - sq`` keys plus a square causal piece over the last ``sq``; with ``sq > sk`` its first
  ``sq - sk`` rows see no key and the last ``sk`` rows form a square causal piece. A sliding-window
  band (``AttentionBlocks.windows``) is cut into row chunks as tall as the band is wide; each chunk
  is a causal piece on its upper edge and, on its lower edge, a causal square computed on the rows
  and keys in reverse order (an index copy of O(rows) against the O(rows^2) work of the piece).
  Pieces over the same rows are merged with the LSE, exactly like ring steps; no mask tensor is
  ever built, so the operator skips hidden tiles itself.
- pieces of equal shape (a packed batch of equal-length documents, zigzag chunks) are stacked
  along the operator's batch dimension, so thousands of short documents cost a handful of calls
  (one per distinct shape), not one call each. Pieces stacked together have disjoint query rows,
  so their results are written or merged with one index operation.

Precision: float16/bfloat16 inputs are computed in float32 (the operator's half-precision
backward is several times slower on CPUs without native bf16 arithmetic, and float32 merges are
more accurate); float64 stays float64, so fp64 checks reach 1e-12.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import torch

from megatron_hsap.kernels.base import AttentionBlocks, check_kernel_inputs, merge_partial_attention_

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Schedules kept per block structure (forward and backward of every layer share one).
_SCHEDULE_CACHE_SIZE = 32

Rows = Union[slice, torch.Tensor]


def _operators():
    """The fused forward/backward operators, or None where this torch build lacks them."""
    aten = torch.ops.aten
    try:
        return (aten._scaled_dot_product_flash_attention_for_cpu,
                aten._scaled_dot_product_flash_attention_for_cpu_backward)
    except (AttributeError, RuntimeError):
        return None


@dataclass(frozen=True)
class _Batch:
    """One operator call: pieces ``q[qs:qs+sq]`` x ``k[ks:ks+sk]`` for each (qs, ks), stacked on dim 0.

    ``q_rows``/``k_rows`` index the stacked rows (a slice for a single unflipped piece); ``flip`` pieces
    are given to the operator in reverse row order (see ``_pieces``); ``fresh`` is True when no earlier
    batch of the schedule wrote these query rows, so results are stored, not merged.
    """

    causal: bool
    flip: bool
    sq: int
    sk: int
    count: int
    q_rows: Rows
    k_rows: Rows
    fresh: bool


FULL, CAUSAL, FLIPPED = 0, 1, 2  # piece kinds: no mask, square causal, square causal on reversed rows
Piece = Tuple[int, int, int, int, int]  # (q_start, k_start, sq, sk, kind)


def _upper(r0: int, r1: int, c0: int, c1: int, hi: int) -> List[Piece]:
    """Pieces of rows [r0, r1) x keys [c0, c1) where key j is visible from row i iff j - i <= hi."""
    r0, c1 = max(r0, c0 - hi), min(c1, r1 + hi)  # drop rows that see no key and keys no row sees
    if r0 >= r1 or c0 >= c1:
        return []
    split = min(r1, max(r0, c1 - hi))  # rows from here see every key
    pieces = [(split, c0, r1 - split, c1 - c0, FULL)] if split < r1 else []
    if split > r0:  # rows [r0, split) x keys [c0, split + hi): bottom-right causal, at least as wide as tall
        sq, ke = split - r0, split + hi
        if ke - c0 > sq:
            pieces.append((r0, c0, sq, ke - c0 - sq, FULL))
        pieces.append((r0, ke - sq, sq, sq, CAUSAL))
    return pieces


def _lower(r0: int, r1: int, c0: int, c1: int, lo: int) -> List[Piece]:
    """Pieces of rows [r0, r1) x keys [c0, c1) where key j is visible from row i iff j - i >= lo: the
    ``_upper`` pieces of the mirrored region (i -> -i, j -> -j), whose causal squares run on reversed rows."""
    return [(1 - qs - sq, 1 - ks - sk, sq, sk, FLIPPED if kind == CAUSAL else kind)
            for qs, ks, sq, sk, kind in _upper(1 - r1, 1 - r0, 1 - c1, 1 - c0, -lo)]


def _pieces(blocks: AttentionBlocks) -> List[Piece]:
    """Blocks as pieces the operator computes: full, square causal (its top-left alignment) or square causal
    on reversed rows (a band's lower edge). A causal block becomes a full piece over the keys every row
    sees plus a causal square; a windowed band is cut into row chunks as tall as the band is wide, each a
    lower-edge square (reversed) and an upper-edge causal block, so no piece needs a mask tensor."""
    pieces: List[Piece] = []
    for qs, qe, ks, ke, lo, hi in blocks.bands():
        if qe <= qs or ke <= ks:
            continue
        if lo is None and hi is None:
            pieces.append((qs, ks, qe - qs, ke - ks, FULL))
        elif lo is None:
            pieces += _upper(qs, qe, ks, ke, hi)
        elif hi is None:
            pieces += _lower(qs, qe, ks, ke, lo)
        else:
            chunk = max(1, hi - lo + 1)
            for a0 in range(qs, qe, chunk):
                a1 = min(qe, a0 + chunk)
                edge = min(ke, max(ks, a1 - 1 + lo))  # keys below it: lower edge; from it on: upper edge
                pieces += _lower(a0, a1, ks, edge, lo) + _upper(a0, a1, edge, ke, hi)
    return pieces


def _rows(starts: List[int], length: int, flip: bool = False) -> Rows:
    """The rows of pieces starting at ``starts`` (each ``length`` long, reversed if ``flip``), stacked in order."""
    if len(starts) == 1 and not flip:
        return slice(starts[0], starts[0] + length)
    steps = torch.arange(length - 1, -1, -1) if flip else torch.arange(length)
    return (torch.tensor(starts, dtype=torch.int64)[:, None] + steps).reshape(-1)


def _build_schedule(blocks: AttentionBlocks) -> List[_Batch]:
    """Group pieces by (kind, sq, sk) into batches with pairwise disjoint query rows."""
    groups: Dict[Tuple[int, int, int], List[List[Tuple[int, int]]]] = {}
    sorted_starts: Dict[Tuple[int, int, int], List[List[int]]] = {}
    for qs, ks, sq, sk, kind in _pieces(blocks):
        key = (kind, sq, sk)
        batches, starts = groups.setdefault(key, []), sorted_starts.setdefault(key, [])
        for members, taken in zip(batches, starts):  # first batch whose pieces do not overlap q[qs:qs+sq]
            i = bisect.bisect_left(taken, qs)
            if (i == len(taken) or taken[i] >= qs + sq) and (i == 0 or taken[i - 1] + sq <= qs):
                members.append((qs, ks))
                taken.insert(i, qs)
                break
        else:
            batches.append([(qs, ks)])
            starts.append([qs])
    schedule = []
    written = torch.zeros(max(blocks.q_ends, default=0), dtype=torch.bool)  # query rows of earlier batches
    for (kind, sq, sk), batches in groups.items():
        flip = kind == FLIPPED
        for members in batches:
            q_rows = _rows([qs for qs, _ in members], sq, flip)
            fresh = not bool(written[q_rows].any())
            written[q_rows] = True
            schedule.append(_Batch(kind != FULL, flip, sq, sk, len(members), q_rows,
                                   _rows([ks for _, ks in members], sk, flip), fresh))
    return schedule


_schedules: "OrderedDict[AttentionBlocks, List[_Batch]]" = OrderedDict()


def _schedule(blocks: AttentionBlocks) -> List[_Batch]:
    """Cached ``_build_schedule`` (LRU over recent block structures)."""
    if blocks in _schedules:
        _schedules.move_to_end(blocks)
        return _schedules[blocks]
    schedule = _schedules[blocks] = _build_schedule(blocks)
    if len(_schedules) > _SCHEDULE_CACHE_SIZE:
        _schedules.popitem(last=False)
    return schedule


def _take(x: torch.Tensor, rows: Rows, dim: int = 0) -> torch.Tensor:
    if isinstance(rows, slice):
        return x.narrow(dim, rows.start, rows.stop - rows.start)
    return x.index_select(dim, rows)


def _stacked(x: torch.Tensor, rows: Rows, count: int) -> torch.Tensor:
    """Rows of ``x`` ``[t, h, d]`` as the operator's ``[count, h, s, d]`` (a view for one piece)."""
    taken = _take(x, rows)
    return taken.view(count, -1, *x.shape[1:]).transpose(1, 2)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """Operator result ``[count, h, s, d]`` back to rows ``[count * s, h, d]``."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _store(dst: torch.Tensor, rows: Rows, value: torch.Tensor, dim: int = 0) -> None:
    if isinstance(rows, slice):
        dst.narrow(dim, rows.start, rows.stop - rows.start).copy_(value)
    else:
        dst.index_copy_(dim, rows, value)


def _accumulate(dst: torch.Tensor, rows: Rows, value: torch.Tensor) -> None:
    if isinstance(rows, slice):
        dst[rows] += value
    else:
        dst.index_add_(0, rows, value)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class CpuFusedAttentionKernel:
    """``AttentionKernel`` on CPU tensors through PyTorch's fused flash-attention operator (see module doc)."""

    name = "cpu_fused"

    def __init__(self) -> None:
        ops = _operators()
        if ops is None:
            raise RuntimeError("this torch build has no aten._scaled_dot_product_flash_attention_for_cpu; "
                               "use kernel='torch'")
        self._forward_op, self._backward_op = ops

    @classmethod
    def is_available(cls) -> bool:
        """True when this torch build has the fused CPU operators."""
        return _operators() is not None

    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: AttentionBlocks) -> None:
        check_kernel_inputs(q, k, v, blocks, SUPPORTED_DTYPES)
        if q.device.type != "cpu":
            raise ValueError(f"kernel 'cpu_fused' runs on CPU tensors only, got device {q.device}; "
                             "use kernel='torch', 'flash' or 'te' on GPUs")

    @torch.no_grad()
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: AttentionBlocks,
                softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
        """Attention of q ``[t_q, h_q, d]`` over k/v ``[t_k, h_kv, d]`` (this rank's tokens) for ``blocks``.

        Returns out ``[t_q, h_q, d]`` in q's dtype and lse ``[h_q, t_q]`` (float32; float64 for
        float64 inputs); rows no block covers give 0 and -inf.
        """
        self._check(q, k, v, blocks)
        if not all(bool(torch.isfinite(x).all()) for x in (q, k, v)):
            # torch's fused CPU operator returns out 0, lse 0 for a row whose scores hold a NaN, which the
            # merge then hides; the unfused kernel propagates NaN/Inf as dense attention does.
            from megatron_hsap.kernels.torch_kernel import TorchAttentionKernel

            return TorchAttentionKernel().forward(q, k, v, blocks, softmax_scale)
        t_q, h_q, d = q.shape
        out_dtype, dtype = q.dtype, _compute_dtype(q.dtype)
        q, k, v = (x.to(dtype) for x in (q, k, v))
        out = torch.zeros(t_q, h_q, d, dtype=dtype)
        lse = torch.full((h_q, t_q), float("-inf"), dtype=dtype)
        for batch in _schedule(blocks):
            part_out, part_lse = self._forward_op(
                _stacked(q, batch.q_rows, batch.count), _stacked(k, batch.k_rows, batch.count),
                _stacked(v, batch.k_rows, batch.count), 0.0, batch.causal, scale=softmax_scale)
            part_out, part_lse = _flat(part_out), part_lse.transpose(0, 1).reshape(h_q, -1)
            if not batch.fresh:  # fold into the rows' earlier result (a view for slices, a copy for indices)
                merged = _take(out, batch.q_rows)
                part_lse = merge_partial_attention_(merged, _take(lse, batch.q_rows, 1), part_out, part_lse)
                part_out = merged
            _store(out, batch.q_rows, part_out)
            _store(lse, batch.q_rows, part_lse, dim=1)
        return out.to(out_dtype), lse

    @torch.no_grad()
    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, blocks: AttentionBlocks,
                 softmax_scale: float, grad_dtype: Optional[torch.dtype] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of this call's blocks given the rows' *final* out/dout ``[t_q, h_q, d]`` and lse ``[h_q, t_q]``.

        Returns dq ``[t_q, h_q, d]``, dk/dv ``[t_k, h_kv, d]`` in float32 (float64 for float64
        inputs; ``grad_dtype`` when given); rows no block of this call covers get zero gradients.
        """
        self._check(q, k, v, blocks)
        t_q, h_q, d = q.shape
        for name, t, shape in (("dout", dout, q.shape), ("out", out, q.shape), ("lse", lse, (h_q, t_q))):
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
        dtype = _compute_dtype(q.dtype)
        q, k, v, out, dout = (x.to(dtype) for x in (q, k, v, out, dout))
        lse_rows = lse.to(dtype).t()  # [t_q, h_q]: gathered like q's rows
        dq = torch.zeros(q.shape, dtype=dtype)
        dk = torch.zeros(k.shape, dtype=dtype)
        dv = torch.zeros(v.shape, dtype=dtype)
        for batch in _schedule(blocks):
            n = batch.count
            part_lse = _take(lse_rows, batch.q_rows).reshape(n, batch.sq, h_q).transpose(1, 2)
            grads = self._backward_op(
                _stacked(dout, batch.q_rows, n), _stacked(q, batch.q_rows, n), _stacked(k, batch.k_rows, n),
                _stacked(v, batch.k_rows, n), _stacked(out, batch.q_rows, n), part_lse, 0.0, batch.causal,
                scale=softmax_scale)
            for dst, rows, grad in zip((dq, dk, dv), (batch.q_rows, batch.k_rows, batch.k_rows), grads):
                _accumulate(dst, rows, _flat(grad))
        if grad_dtype is not None:
            return dq.to(grad_dtype), dk.to(grad_dtype), dv.to(grad_dtype)
        return dq, dk, dv
