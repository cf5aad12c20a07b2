"""Pure-PyTorch blockwise attention with online softmax: the kernel every CPU test runs.

It implements ``AttentionKernel`` (see ``base.py``) on any device. Each block is
cut into query x key tiles, so live memory is bounded by the tile size instead of
``t_q x t_k``; tiles that causality hides entirely are never computed. Runs of
small consecutive blocks (packed batches of short documents) are fused into one
masked tile, so per-block Python overhead does not dominate. Windowed blocks (sliding
windows, ``AttentionBlocks.windows``) mask the band inside each tile the same way. The tile schedule of
an ``AttentionBlocks`` is cached, so forward and backward (and every layer using
the same plan) build it once.

Internal layout: q is held as ``[h_kv, t_q * g, d]`` with rows ordered (token,
query head inside the KV group), so grouped-query attention is a plain batched
matmul against K/V ``[h_kv, t_k, d]``: K/V are never repeated.

Precision: running max, sum and accumulator are float32 for fp16/bf16/fp32 inputs
and float64 for float64 inputs; the LSE is returned in that accumulation dtype
(float32, or float64 for float64 inputs so fp64 checks can reach 1e-10).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from megatron_hsap.kernels.base import AttentionBlocks, check_kernel_inputs

#: Query rows (tokens) per tile; the row count inside a tile is TILE_Q * (h_q // h_kv).
TILE_Q = 256
#: Key rows per tile.
TILE_K = 512
#: Consecutive blocks are fused into one masked tile while their union spans at most this many query rows ...
FUSE_Q = 64
#: ... and at most this many key rows.
FUSE_K = 128
#: Tile schedules kept per (blocks, device).
_SCHEDULE_CACHE_SIZE = 32

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class _Tile:
    """Query rows [q0, q1) x key rows [k0, k1); ``hidden`` [q1-q0, k1-k0] is True where masked (None = all visible)."""

    q0: int
    q1: int
    k0: int
    k1: int
    hidden: Optional[torch.Tensor]


def _band_hidden(rows: int, cols: int, lo: Optional[int], hi: Optional[int]) -> torch.Tensor:
    """Bool [rows, cols]: True where col - row lies outside [lo, hi] (the keys a row may not see)."""
    hidden = torch.zeros(rows, cols, dtype=torch.bool)
    if hi is not None:
        hidden |= torch.ones(rows, cols, dtype=torch.bool).triu_(hi + 1)
    if lo is not None:
        hidden |= torch.ones(rows, cols, dtype=torch.bool).tril_(lo - 1)
    return hidden


def _block_tiles(qs: int, qe: int, ks: int, ke: int, lo: Optional[int], hi: Optional[int],
                 shared: Dict[Tuple[int, int, Optional[int], Optional[int]], torch.Tensor]) -> List[_Tile]:
    """Cut one block (key j visible from row i iff lo <= j - i <= hi) into TILE_Q x TILE_K tiles, dropping
    tiles the band hides entirely; partly visible tiles of equal geometry share one mask."""
    tiles = []
    for q0 in range(qs, qe, TILE_Q):
        q1 = min(q0 + TILE_Q, qe)
        for k0 in range(ks, ke, TILE_K):
            k1 = min(k0 + TILE_K, ke)
            least, most = k0 - (q1 - 1), k1 - 1 - q0  # smallest and largest j - i in the tile
            if (hi is not None and least > hi) or (lo is not None and most < lo):
                continue
            if (hi is None or most <= hi) and (lo is None or least >= lo):
                tiles.append(_Tile(q0, q1, k0, k1, None))
                continue
            key = (q1 - q0, k1 - k0, None if lo is None else lo - (k0 - q0), None if hi is None else hi - (k0 - q0))
            if key not in shared:
                shared[key] = _band_hidden(*key)
            tiles.append(_Tile(q0, q1, k0, k1, shared[key]))
    return tiles


Band = Tuple[int, int, int, int, Optional[int], Optional[int]]  # (q_start, q_end, k_start, k_end, lo, hi)


def _fused_tile(group: List[Band]) -> _Tile:
    """One masked tile covering several small blocks (their key ranges per row never overlap)."""
    q0, q1 = min(b[0] for b in group), max(b[1] for b in group)
    k0, k1 = min(b[2] for b in group), max(b[3] for b in group)
    hidden = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
    for qs, qe, ks, ke, lo, hi in group:
        shift = ks - qs  # j - i = (b - a) + shift in block coordinates a, b
        hidden[qs - q0:qe - q0, ks - k0:ke - k0] = _band_hidden(qe - qs, ke - ks, None if lo is None else lo - shift,
                                                                None if hi is None else hi - shift)
    return _Tile(q0, q1, k0, k1, hidden)


def _build_schedule(blocks: AttentionBlocks) -> List[_Tile]:
    """Tiles for all blocks: small consecutive blocks fused, large ones tiled (masks on CPU)."""
    tiles: List[_Tile] = []
    shared: Dict[Tuple[int, int, Optional[int], Optional[int]], torch.Tensor] = {}
    group: List[Band] = []

    def flush() -> None:
        if len(group) == 1:
            tiles.extend(_block_tiles(*group[0], shared))
        elif group:
            tiles.append(_fused_tile(group))
        group.clear()

    for block in blocks.bands():
        qs, qe, ks, ke, _, _ = block
        if qe - qs > FUSE_Q or ke - ks > FUSE_K:
            flush()
            tiles.extend(_block_tiles(*block, shared))
            continue
        if group:
            span_q = max(qe, max(b[1] for b in group)) - min(qs, min(b[0] for b in group))
            span_k = max(ke, max(b[3] for b in group)) - min(ks, min(b[2] for b in group))
            if span_q > FUSE_Q or span_k > FUSE_K:
                flush()
        group.append(block)
    flush()
    return tiles


_schedules: "OrderedDict[Tuple[AttentionBlocks, torch.device], List[_Tile]]" = OrderedDict()


def _schedule(blocks: AttentionBlocks, device: torch.device) -> List[_Tile]:
    """Cached tile schedule with masks already on ``device`` (LRU over recent block structures)."""
    key = (blocks, device)
    if key in _schedules:
        _schedules.move_to_end(key)
        return _schedules[key]
    moved: Dict[int, torch.Tensor] = {}  # masks shared by several tiles are copied once
    tiles = []
    for tile in _build_schedule(blocks):
        hidden = tile.hidden
        if hidden is not None and hidden.device != device:
            if id(tile.hidden) not in moved:
                moved[id(tile.hidden)] = hidden.to(device)
            hidden = moved[id(tile.hidden)]
        tiles.append(_Tile(tile.q0, tile.q1, tile.k0, tile.k1, hidden))
    _schedules[key] = tiles
    if len(_schedules) > _SCHEDULE_CACHE_SIZE:
        _schedules.popitem(last=False)
    return tiles


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped_rows(x: torch.Tensor, h_kv: int, dtype: torch.dtype) -> torch.Tensor:
    """``[t, h_q, d]`` -> contiguous ``[h_kv, t * g, d]`` (rows ordered token-major, then query head in group)."""
    t, h_q, d = x.shape
    return x.to(dtype).view(t, h_kv, h_q // h_kv, d).transpose(0, 1).reshape(h_kv, t * (h_q // h_kv), d)


def _ungroup_rows(x: torch.Tensor, t: int, h_q: int) -> torch.Tensor:
    """Inverse of ``_grouped_rows`` for ``[h_kv, t * g, d]`` -> ``[t, h_q, d]``."""
    h_kv, _, d = x.shape
    return x.view(h_kv, t, h_q // h_kv, d).transpose(0, 1).reshape(t, h_q, d)


def _heads_major(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[t, h, d]`` -> contiguous ``[h, t, d]`` in ``dtype``."""
    return x.to(dtype).transpose(0, 1).contiguous()


def _lse_to_rows(lse: torch.Tensor, h_kv: int) -> torch.Tensor:
    """LSE ``[h_q, t]`` -> ``[h_kv, t * g]`` matching ``_grouped_rows``."""
    h_q, t = lse.shape
    return lse.view(h_kv, h_q // h_kv, t).transpose(1, 2).reshape(h_kv, t * (h_q // h_kv))


def _rows_to_lse(rows: torch.Tensor, t: int, h_q: int) -> torch.Tensor:
    """Inverse of ``_lse_to_rows``."""
    h_kv = rows.shape[0]
    return rows.view(h_kv, t, h_q // h_kv).transpose(1, 2).reshape(h_q, t)


def _scores(q_rows: torch.Tensor, k_t: torch.Tensor, hidden: Optional[torch.Tensor], g: int) -> torch.Tensor:
    """Scaled scores ``[h_kv, tq * g, tk]`` of one tile with masked entries set to -inf."""
    s = torch.bmm(q_rows, k_t.transpose(1, 2))
    if hidden is not None:
        h_kv, n, tk = s.shape
        s.view(h_kv, n // g, g, tk).masked_fill_(hidden[None, :, None, :], float("-inf"))
    return s


class TorchAttentionKernel:
    """Blockwise online-softmax attention in plain PyTorch (CPU or GPU); see the module docstring."""

    name = "torch"

    @classmethod
    def is_available(cls) -> bool:
        """Always available: needs nothing beyond torch."""
        return True

    @torch.no_grad()
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: AttentionBlocks,
                softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
        """Attention of q ``[t_q, h_q, d]`` over k/v ``[t_k, h_kv, d]`` (this rank's tokens) for ``blocks``.

        Returns out ``[t_q, h_q, d]`` in q's dtype and lse ``[h_q, t_q]`` in the accumulation
        dtype (float32; float64 for float64 inputs); rows no block covers give 0 and -inf.
        """
        check_kernel_inputs(q, k, v, blocks, SUPPORTED_DTYPES)
        t_q, h_q, d = q.shape
        h_kv = k.shape[1]
        g = h_q // h_kv
        acc_dtype = _accum_dtype(q.dtype)
        q_rows = _grouped_rows(q, h_kv, acc_dtype) * softmax_scale  # may be a view of q: no in-place
        k_h, v_h = _heads_major(k, acc_dtype), _heads_major(v, acc_dtype)
        acc = torch.zeros(h_kv, t_q * g, d, dtype=acc_dtype, device=q.device)
        row_max = torch.full((h_kv, t_q * g), float("-inf"), dtype=acc_dtype, device=q.device)
        row_sum = torch.zeros(h_kv, t_q * g, dtype=acc_dtype, device=q.device)
        for tile in _schedule(blocks, q.device):
            r0, r1 = tile.q0 * g, tile.q1 * g
            p = _scores(q_rows[:, r0:r1], k_h[:, tile.k0:tile.k1], tile.hidden, g)
            old_max = row_max[:, r0:r1]
            new_max = torch.maximum(old_max, p.amax(dim=-1))
            safe_max = new_max.masked_fill(new_max == float("-inf"), 0.0)  # rows that saw no key yet: exp() stays 0
            p.sub_(safe_max.unsqueeze(-1)).exp_()
            rescale = (old_max - safe_max).exp_()
            row_sum[:, r0:r1].mul_(rescale).add_(p.sum(dim=-1))
            acc[:, r0:r1].mul_(rescale.unsqueeze(-1)).baddbmm_(p, v_h[:, tile.k0:tile.k1])
            old_max.copy_(new_max)
        # a covered row's sum is >= 1 (its maximum contributes exp(0)); uncovered rows have acc 0, lse -inf
        acc.div_(row_sum.clamp_min(1.0).unsqueeze(-1))
        lse_rows = row_max + row_sum.log()
        return _ungroup_rows(acc, t_q, h_q).to(q.dtype), _rows_to_lse(lse_rows, t_q, h_q)

    @torch.no_grad()
    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, blocks: AttentionBlocks,
                 softmax_scale: float, grad_dtype: Optional[torch.dtype] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of this call's blocks given the rows' *final* out/dout ``[t_q, h_q, d]`` and lse ``[h_q, t_q]``.

        Returns dq ``[t_q, h_q, d]``, dk/dv ``[t_k, h_kv, d]`` in float32 (float64 for float64
        inputs; ``grad_dtype`` when given); rows with lse -inf contribute nothing.
        """
        check_kernel_inputs(q, k, v, blocks, SUPPORTED_DTYPES)
        t_q, h_q, d = q.shape
        t_k, h_kv, _ = k.shape
        for name, t, shape in (("dout", dout, q.shape), ("out", out, q.shape), ("lse", lse, (h_q, t_q))):
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
        g = h_q // h_kv
        acc_dtype = _accum_dtype(q.dtype)
        q_rows = _grouped_rows(q, h_kv, acc_dtype) * softmax_scale  # may be a view of q: no in-place
        do_rows = _grouped_rows(dout, h_kv, acc_dtype)
        k_h, v_h = _heads_major(k, acc_dtype), _heads_major(v, acc_dtype)
        delta = (do_rows * _grouped_rows(out, h_kv, acc_dtype)).sum(dim=-1)
        lse_rows = _lse_to_rows(lse.to(acc_dtype), h_kv)
        lse_rows = lse_rows.masked_fill(lse_rows == float("-inf"), float("inf"))  # exp(s - inf) = 0: no NaN
        dq = torch.zeros_like(q_rows)
        dk = torch.zeros_like(k_h)
        dv = torch.zeros_like(v_h)
        for tile in _schedule(blocks, q.device):
            r0, r1 = tile.q0 * g, tile.q1 * g
            q_t, do_t = q_rows[:, r0:r1], do_rows[:, r0:r1]
            k_t, v_t = k_h[:, tile.k0:tile.k1], v_h[:, tile.k0:tile.k1]
            p = _scores(q_t, k_t, tile.hidden, g).sub_(lse_rows[:, r0:r1].unsqueeze(-1)).exp_()
            dv[:, tile.k0:tile.k1].baddbmm_(p.transpose(1, 2), do_t)
            ds = torch.bmm(do_t, v_t.transpose(1, 2)).sub_(delta[:, r0:r1].unsqueeze(-1)).mul_(p)
            dq[:, r0:r1].baddbmm_(ds, k_t)
            dk[:, tile.k0:tile.k1].baddbmm_(ds.transpose(1, 2), q_t)  # q_t is pre-scaled
        dq.mul_(softmax_scale)
        dtype = grad_dtype or acc_dtype
        dk, dv = (g.transpose(0, 1).to(dtype, memory_format=torch.contiguous_format) for g in (dk, dv))
        return _ungroup_rows(dq, t_q, h_q).to(dtype), dk, dv
