"""Independent dense float64 attention: the ground truth every distributed test compares with.

It builds the full ``[t_q, t_k]`` mask and does one softmax, sharing no code with
``megatron_hsap`` (only the document-length sampler is imported, for one hard case),
so a bug in the package cannot hide in its own reference. Gradients come from autograd.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                      scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dense attention in float64 with a ``[t_q, t_k]`` bool mask (True = attended).

    q ``[t_q, h_q, d]``, k/v ``[t_k, h_kv, d]`` (GQA by repeating K/V heads).
    Returns out ``[t_q, h_q, d]`` float64 (0 on rows that see no key) and lse ``[h_q, t_q]`` float64 (-inf there).
    """
    h_q, h_kv = q.shape[1], k.shape[1]
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"h_q={h_q} must be a multiple of h_kv={h_kv}")
    q64, k64, v64 = q.double(), k.double(), v.double()
    k64 = k64.repeat_interleave(h_q // h_kv, dim=1)
    v64 = v64.repeat_interleave(h_q // h_kv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q64, k64) * scale
    has_key = visible.any(dim=1)  # [t_q]
    # rows without keys get a harmless all-zero score row and are zeroed after the softmax (no NaN in grads)
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(~has_key[:, None], 0.0)
    probs = torch.softmax(scores, dim=-1) * has_key[:, None]
    out = torch.einsum("hqk,khd->qhd", probs, v64)
    lse = torch.logsumexp(scores, dim=-1).masked_fill(~has_key, float("-inf"))
    return out, lse


def document_mask(cu_seqlens: torch.Tensor, total: int, causal: bool,
                  valid: Optional[torch.Tensor] = None,
                  window_size: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """``[total, total]`` bool mask of a packed batch: same document (and key <= query if causal).

    cu_seqlens: non-decreasing ``[num_docs + 1]`` starting at 0; tokens past its last entry
    and tokens with ``valid`` False belong to no document and attend nothing.
    window_size ``(left, right)``: query i also needs ``i - left <= key <= i + right`` (-1 = unlimited).
    """
    cu = [int(x) for x in cu_seqlens.tolist()]
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > total:
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end <= {total}, got {cu}")
    doc = torch.full((total,), -1, dtype=torch.int64)
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        doc[a:b] = i
    if valid is not None:
        doc = doc.masked_fill(~valid.to(torch.bool).cpu(), -1)
    mask = (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0)
    if causal:
        mask &= torch.ones(total, total, dtype=torch.bool).tril()
    if window_size is not None:
        mask &= _window_mask(total, total, 0, window_size)
    return mask


def _window_mask(t_q: int, t_k: int, offset: int, window_size: Tuple[int, int]) -> torch.Tensor:
    """``[t_q, t_k]``: True where ``-left <= key - query - offset <= right`` (a side of -1 is unlimited)."""
    diff = torch.arange(t_k)[None, :] - torch.arange(t_q)[:, None] - offset
    left, right = window_size
    return (diff >= -left if left >= 0 else True) & (diff <= right if right >= 0 else True)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                    causal: bool = True, softmax_scale: Optional[float] = None,
                    valid: Optional[torch.Tensor] = None,
                    window_size: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """Document-masked attention of a *global* packed batch, float64.

    q ``[T, h_q, d]``, k/v ``[T, h_kv, d]``: all ranks' tokens in global order.
    valid: optional bool ``[T]``; False tokens (padding) attend nothing and give zero output.
    window_size: optional sliding window ``(left, right)`` (see ``document_mask``).
    Returns out ``[T, h_q, d]`` float64; differentiable w.r.t. q, k, v.
    """
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    mask = document_mask(cu_seqlens, q.shape[0], causal, valid, window_size).to(q.device)
    return _masked_attention(q, k, v, mask, softmax_scale)[0]


def blocks_mask(blocks: Iterable[tuple], t_q: int, t_k: int) -> torch.Tensor:
    """``[t_q, t_k]`` bool mask of (q_start, q_end, k_start, k_end, causal[, (left, right)]) blocks, causal ones
    and windows bottom-right aligned (flash-attn's convention)."""
    windows = getattr(blocks, "windows", ())  # an AttentionBlocks with sliding windows
    if windows:
        blocks = [tuple(block) + (window,) for block, window in zip(blocks, windows)]
    mask = torch.zeros(t_q, t_k, dtype=torch.bool)
    for block in blocks:
        qs, qe, ks, ke, causal = block[:5]
        rows = torch.arange(qs, qe)[:, None]
        cols = torch.arange(ks, ke)[None, :]
        sub = torch.ones(qe - qs, ke - ks, dtype=torch.bool)
        if causal:  # key b (in block) visible from row a iff b <= a + sk - sq, i.e. col - row <= ke - qe
            sub = (cols - rows) <= (ke - qe)
        if len(block) > 5:
            sub = sub & _window_mask(qe - qs, ke - ks, (ke - ks) - (qe - qs), block[5])
        if (mask[qs:qe, ks:ke] & sub).any():
            raise ValueError("blocks overlap: a query row has two blocks covering the same key")
        mask[qs:qe, ks:ke] |= sub
    return mask


def dense_attention_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           blocks: Iterable[tuple],
                           scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dense float64 version of the kernel contract: q ``[t_q, h_q, d]``, k/v ``[t_k, h_kv, d]``.

    Returns out ``[t_q, h_q, d]`` and lse ``[h_q, t_q]`` (both float64, differentiable).
    """
    mask = blocks_mask(blocks, q.shape[0], k.shape[0]).to(q.device)
    return _masked_attention(q, k, v, mask, scale)


def _fill(lengths: List[int], total: int) -> List[int]:
    """Append one document so the lengths sum to ``total``."""
    rest = total - sum(lengths)
    if rest < 0:
        raise AssertionError(f"hard case lengths {lengths} exceed total {total}")
    return lengths + [rest] if rest else lengths


def _cycle(pattern: List[int], total: int) -> List[int]:
    """Repeat ``pattern`` until the lengths sum to ``total``, cutting the last document."""
    lengths: List[int] = []
    while sum(lengths) < total:
        lengths.append(min(pattern[len(lengths) % len(pattern)], total - sum(lengths)))
    return lengths


def _long_tail(total: int, seed: int, shrink: int = 64) -> List[int]:
    """Lengths from the shipped corpus histogram, shrunk ``shrink``-fold so the dense reference stays small."""
    from megatron_hsap.sequence.doc_lengths import sample_doc_lengths

    lengths: List[int] = []
    for n in sample_doc_lengths(total * shrink, seed=seed):
        n = min(max(1, round(n / shrink)), total - sum(lengths))
        if n == 0:
            break
        lengths.append(n)
    return _fill(lengths, total)


def hard_cases(cp_size: int) -> Dict[str, List[int]]:
    """Named document-length lists covering the hard cases of packed batches for a CP group of ``cp_size`` ranks.

    Positions are described for equal contiguous shards of ``s = 48`` tokens per rank
    (total ``48 * max(cp_size, 2)`` unless stated); zigzag chunks of a document are
    ``len / (2 * cp_size)`` long. Totals stay <= ~400 tokens so the float64 reference is fast.
    """
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    c, s = max(cp_size, 2), 48
    total = s * c
    short = [3, 1, 7, 2, 5, 4, 6, 1, 2, 9]
    several = [s // 2, min(2, c - 1) * s + s // 4, 5]  # the second document crosses two shard edges
    return {
        "single_document": [total],
        "only_short": _cycle(short, total),
        "one_long_many_short": [total // 2] + _cycle(short, total - total // 2),
        "crosses_one_boundary": _fill([s // 2, s], total),
        "crosses_several_boundaries": several + _cycle([s], total - sum(several)),
        "crosses_all_boundaries": [s // 4, total - s // 2, s // 4],
        "boundaries_on_shard_edges": [s] * c,
        "boundaries_on_zigzag_chunk_edges": [s // 2] * (2 * c),
        "length_one_and_zero": _fill([1, 0, 1, 1, 0, 0, 2, 1, 0, 3] * 2, total),
        "not_divisible_by_2c": _fill([2 * c + 1, 4 * c - 1, 3, 6 * c + 5, 2 * c - 1], total),
        "total_not_divisible_by_c": _fill([s + 1, s // 3], total + 1),
        "long_tail_sampled": _long_tail(total, seed=c),
    }
