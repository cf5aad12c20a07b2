"""Shared machinery of the varlen GPU kernels (PyTorch's fused varlen attention, flash-attn, TransformerEngine).

The libraries compute packed ``[t, h, d]`` attention over sequences given by
``cu_seqlens``: each query row belongs to at most one sequence per call and a
sequence's query and key rows are contiguous in the packed buffers. An
``AttentionBlocks`` description is more general (several blocks may share query
rows; key ranges may repeat across blocks), so one kernel call becomes several
*passes*:

- a pass holds blocks with pairwise disjoint query ranges, one causal flag and one
  sliding window (``AttentionBlocks.windows``, flash-attn's bottom-right convention);
  the number of passes is the minimum for that constraint (interval partitioning:
  the largest number of blocks of one (flag, window) covering a row);
- q/k/v rows of a pass are gathered into packed buffers (a plain view when the
  pass's segments are already adjacent, as for a packed batch's diagonal blocks);
- pass results are merged with the log-sum-exp in fp32, exactly like the ring
  steps of context-parallel attention (as TransformerEngine's ring attention merges its steps);
- the backward of each pass runs with the *final* out/lse of its rows (the
  libraries accept them as inputs) and its grads are scatter-added in fp32.

Subclasses provide only the per-pass library calls (``_pass_forward`` and
``_pass_backward``) and the head-dim limits of their library.

Also here, for both libraries: the index tensors the passes need on the device
(cu_seqlens, gathered row indices) come from ``device_cache.cached_device_index``
(one byte-bounded LRU cache per process), and ``accepted_keywords``, which builds a library call's keyword
arguments from the installed signature and refuses parameters not reviewed.
"""

from __future__ import annotations

import heapq
import importlib
import inspect
import logging
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Collection, Dict, Hashable, List, Optional, Tuple

import torch

from megatron_hsap.device_cache import cached_device_index
from megatron_hsap.kernels.base import UNBOUNDED, AttentionBlocks, check_kernel_inputs, merge_partial_attention_

Segment = Tuple[int, int]
HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class VarlenPass:
    """One varlen library call: sequence i is ``q[q_segments[i]]`` attending to ``k[k_segments[i]]``.

    Query segments are disjoint and sorted by start; key segments may overlap.
    All entries are Python ints (hashable, so device tensors can be cached).
    """

    causal: bool
    q_segments: Tuple[Segment, ...]
    k_segments: Tuple[Segment, ...]
    window: Tuple[int, int] = UNBOUNDED  # (left, right) of every sequence of the pass, -1 = unbounded

    @property
    def cu_seqlens_q(self) -> Tuple[int, ...]:
        return _prefix_sums(self.q_segments)

    @property
    def cu_seqlens_k(self) -> Tuple[int, ...]:
        return _prefix_sums(self.k_segments)

    @property
    def max_seqlen_q(self) -> int:
        return max(e - s for s, e in self.q_segments)

    @property
    def max_seqlen_k(self) -> int:
        return max(e - s for s, e in self.k_segments)

    @property
    def q_span(self) -> Optional[Segment]:
        """``(start, end)`` when the query segments are adjacent (gather is a view), else None."""
        return _span(self.q_segments)

    @property
    def k_span(self) -> Optional[Segment]:
        """``(start, end)`` when the key segments are adjacent (gather is a view), else None."""
        return _span(self.k_segments)

    def device_cu_seqlens(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """int32 ``[num_seqs + 1]`` cu_seqlens for q and k on ``device`` (cached per pass)."""
        return _int32_tensor(self.cu_seqlens_q, device), _int32_tensor(self.cu_seqlens_k, device)


def version_tuple(version: str) -> Tuple[int, ...]:
    """``"2.7.4.post1"`` -> ``(2, 7, 4)``: the release numbers a supported-version range compares."""
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def _prefix_sums(segments: Tuple[Segment, ...]) -> Tuple[int, ...]:
    out = [0]
    for s, e in segments:
        out.append(out[-1] + e - s)
    return tuple(out)


def _span(segments: Tuple[Segment, ...]) -> Optional[Segment]:
    for (_, end), (start, _) in zip(segments, segments[1:]):
        if end != start:
            return None
    return segments[0][0], segments[-1][1]


def _int32_tensor(values: Tuple[int, ...], device: torch.device) -> torch.Tensor:
    return cached_device_index(("int32", values), device, lambda: torch.tensor(values, dtype=torch.int32))


def _row_index(segments: Tuple[Segment, ...], device: torch.device) -> torch.Tensor:
    return cached_device_index(("rows", segments), device,
                               lambda: torch.cat([torch.arange(s, e, dtype=torch.int64) for s, e in segments]))


def signature_parameters(fn: Callable) -> Dict[str, inspect.Parameter]:
    """Parameters of ``fn`` as installed; a ``torch.library.custom_op`` (flash-attn >= 2.7 wraps its
    low-level functions in one) exposes only ``(*args, **kwargs)`` and keeps the function in ``_init_fn``;
    a ``torch.ops`` operator (``torch.ops.aten._flash_attention_forward``) has its registered schema."""
    schema = getattr(getattr(fn, "default", None), "_schema", None)
    if schema is not None:
        return {a.name: inspect.Parameter(a.name, inspect.Parameter.KEYWORD_ONLY if a.kwarg_only else
                                          inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                          default=a.default_value if a.has_default_value() else inspect.Parameter.empty)
                for a in schema.arguments}
    return dict(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


def accepted_keywords(fn: Callable, passed: Collection[str], defaults_ok: Collection[str], what: str) -> frozenset:
    """Which of the ``passed`` keywords the installed ``fn`` takes, after checking its whole signature.

    Every parameter of ``fn`` must be one this package passes or one it has reviewed and leaves at its
    default (``defaults_ok``, and the installed function must give it a default). Anything else is a
    release this package has not been checked against: a RuntimeError naming the parameters, raised
    when the kernel is built, so a changed default (as TE 2.15's ``o_format``) never runs silently.
    """
    params = signature_parameters(fn)
    problems = [name for name, p in params.items()
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name not in passed
                and not (name in defaults_ok and p.default is not p.empty)]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
        problems.append("*args/**kwargs")
    if problems:
        raise RuntimeError(f"{what}: parameters {problems} are new to megatron_hsap (not verified against "
                           "this release's signature)")
    return frozenset(name for name in passed if name in params)


_ANNOUNCED: set = set()


def warn_once_on_rank0(log: logging.Logger, message: str, key: Optional[Hashable] = None) -> None:
    """Log ``message`` as a warning once per process and ``key`` (default: the message), on global rank 0
    only (or when not distributed)."""
    key = message if key is None else key
    if key in _ANNOUNCED:
        return
    _ANNOUNCED.add(key)
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
            or torch.distributed.get_rank() == 0:
        log.warning(message)


def normalized_blocks(blocks: AttentionBlocks) -> List[Tuple[int, int, int, int, bool, Tuple[int, int]]]:
    """The blocks that attend to something, with causal blocks trimmed to the rows that see a key, and
    each block's window.

    A bottom-right-aligned causal block with more query rows than keys leaves its
    first ``sq - sk`` rows without keys; dropping them gives the same mask (and the same
    window band, which is anchored at the bottom-right corner) and keeps every row of a
    pass non-empty (the libraries disagree on what an empty row returns). Windowed blocks
    come from the schedule trimmed to the rows that see a key.
    """
    out = []
    for i, (qs, qe, ks, ke, causal) in enumerate(blocks):
        sq, sk = qe - qs, ke - ks
        if sq <= 0 or sk <= 0:
            continue
        if causal and sq > sk:
            qs = qe - sk
        out.append((qs, qe, ks, ke, causal, blocks.window(i)))
    return out


@lru_cache(maxsize=256)
def split_into_passes(blocks: AttentionBlocks) -> Tuple[VarlenPass, ...]:
    """The fewest passes with disjoint query ranges and one causal flag and window each (see module doc).

    Greedy interval partitioning per (flag, window): blocks in order of query start go to the
    pass that became free earliest, a new pass only when every pass still overlaps.
    """
    passes: List[VarlenPass] = []
    normalized = normalized_blocks(blocks)
    for causal, window in sorted({(b[4], b[5]) for b in normalized}, key=lambda kw: (not kw[0], kw[1])):
        chosen = sorted(b for b in normalized if b[4] == causal and b[5] == window)
        members: List[List[Tuple[int, int, int, int, bool]]] = []
        free_at: List[Tuple[int, int]] = []  # heap of (last q_end, pass index)
        for block in chosen:
            if free_at and free_at[0][0] <= block[0]:
                _, index = heapq.heappop(free_at)
            else:
                index = len(members)
                members.append([])
            members[index].append(block)
            heapq.heappush(free_at, (block[1], index))
        for group in members:
            passes.append(VarlenPass(causal, tuple((b[0], b[1]) for b in group),
                                     tuple((b[2], b[3]) for b in group), window))
    return tuple(passes)


def _rows(segments: Tuple[Segment, ...], span: Optional[Segment], device: torch.device):
    """A slice when the segments are adjacent, else the int64 index of their rows."""
    return slice(*span) if span is not None else _row_index(segments, device)


def _take(x: torch.Tensor, rows) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def _put(x: torch.Tensor, rows, value: torch.Tensor) -> None:
    if isinstance(rows, slice):
        x[rows] = value
    else:
        x.index_copy_(0, rows, value)


def gather_rows(x: torch.Tensor, segments: Tuple[Segment, ...], span: Optional[Segment]) -> torch.Tensor:
    """Rows ``segments`` of ``x`` (``[t, ...]``, dim 0 = tokens) packed contiguously (no copy when ``span``
    is set and ``x`` is contiguous)."""
    return _take(x, _rows(segments, span, x.device)).contiguous()


def add_rows(dst: torch.Tensor, src: torch.Tensor, segments: Tuple[Segment, ...], span: Optional[Segment]) -> None:
    """``dst[rows] += src`` for the packed rows of ``segments`` (repeated rows accumulate)."""
    rows = _rows(segments, span, dst.device)
    if isinstance(rows, slice):
        dst[rows] += src.to(dst.dtype)
    else:
        dst.index_add_(0, rows, src.to(dst.dtype))


def merge_partial(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                  lse_b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint key sets of the same query rows.

    out_* ``[n, h, d]``, lse_* ``[h, n]`` (natural-log softmax denominators, -inf for
    rows with no keys). Computed in fp32 (fp64 stays fp64); rows empty in both stay
    out 0 / lse -inf instead of NaN.
    """
    dtype = torch.promote_types(out_a.dtype, torch.float32)
    out = out_a.to(dtype, copy=True)
    lse = merge_partial_attention_(out, lse_a.to(dtype), out_b, lse_b.to(dtype))
    return out, lse


class VarlenPassKernel:
    """``AttentionKernel`` built from a library's varlen forward/backward (one call per pass).

    Subclasses set ``name``, ``max_head_dim`` and implement ``_pass_forward`` /
    ``_pass_backward`` on packed buffers; everything about blocks, merging and
    gradient accumulation lives here so both libraries behave identically.
    """

    name: str = "varlen"
    supported_dtypes: Tuple[torch.dtype, ...] = HALF_DTYPES
    max_head_dim: int = 256
    head_dim_multiple: int = 8
    #: module whose successful import (with CUDA usable) means the library is there
    probe_module: str = ""

    @classmethod
    def is_available(cls) -> bool:
        """True when CUDA is usable and ``probe_module`` imports; never raises."""
        try:
            if not torch.cuda.is_available():
                return False
            importlib.import_module(cls.probe_module)
        except Exception:  # a missing or broken install just means "not available"
            return False
        return True

    @classmethod
    def check_inputs(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: AttentionBlocks) -> None:
        """Shape/dtype/bounds checks plus this library's head-dim limits; ValueError naming the argument.

        A classmethod so bad input is reported even where the library is not installed.
        """
        check_kernel_inputs(q, k, v, blocks, cls.supported_dtypes)
        d = q.shape[2]
        if d % cls.head_dim_multiple != 0 or not 0 < d <= cls.max_head_dim:
            raise ValueError(f"head_dim={d} is not supported by the {cls.name!r} kernel; allowed: multiples of "
                             f"{cls.head_dim_multiple} up to {cls.max_head_dim}")

    def _pass_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: VarlenPass,
                      softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
        """One library call on packed buffers: q ``[n_q, h_q, d]``, k/v ``[n_k, h_kv, d]`` with
        ``n_q = p.cu_seqlens_q[-1]``, ``n_k = p.cu_seqlens_k[-1]``.

        Returns out ``[n_q, h_q, d]`` (q dtype) and lse ``[h_q, n_q]`` float32.
        """
        raise NotImplementedError

    def _pass_backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, p: VarlenPass,
                       softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Library backward on packed buffers with the final out/lse of the pass rows (lse ``[h_q, n_q]``,
        +inf marks rows without keys); returns dq, dk, dv shaped like the packed q, k, v."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: AttentionBlocks,
                softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
        """out ``[t_q, h_q, d]`` (q dtype) and lse ``[h_q, t_q]`` float32 for this rank's q/k/v (see base.py)."""
        self.check_inputs(q, k, v, blocks)
        t_q, h_q, _ = q.shape
        passes = split_into_passes(blocks)
        if len(passes) == 1 and passes[0].q_span == (0, t_q):  # one call covers every row: no merge, no copy
            p = passes[0]
            return self._pass_forward(q.contiguous(), gather_rows(k, p.k_segments, p.k_span),
                                      gather_rows(v, p.k_segments, p.k_span), p, softmax_scale)
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        lse_total = torch.full((h_q, t_q), float("-inf"), dtype=acc_dtype, device=q.device)
        out_total = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        for p in passes:
            out_p, lse_p = self._pass_forward(gather_rows(q, p.q_segments, p.q_span),
                                              gather_rows(k, p.k_segments, p.k_span),
                                              gather_rows(v, p.k_segments, p.k_span), p, softmax_scale)
            rows = _rows(p.q_segments, p.q_span, q.device)
            merged_out, merged_lse = merge_partial(_take(out_total, rows), _take(lse_total.t(), rows).t(),
                                                   out_p, lse_p)
            _put(out_total, rows, merged_out)
            _put(lse_total.t(), rows, merged_lse.t())
        return out_total.to(q.dtype), lse_total.to(torch.float32)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, blocks: AttentionBlocks,
                 softmax_scale: float, grad_dtype: Optional[torch.dtype] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dq, dk, dv (float32, or ``grad_dtype``; shaped like q, k, v) of this call's blocks given the *final*
        out/lse (``[t_q, h_q, d]`` / ``[h_q, t_q]``, possibly merged over several calls as in ring attention).
        One pass over every query and key row in ``grad_dtype`` returns the library's gradients as they are."""
        self.check_inputs(q, k, v, blocks)
        if dout.shape != q.shape or out.shape != q.shape or lse.shape != (q.shape[1], q.shape[0]):
            raise ValueError(f"dout/out must be shaped like q {tuple(q.shape)} and lse [h_q, t_q]; got "
                             f"{tuple(dout.shape)}, {tuple(out.shape)}, {tuple(lse.shape)}")
        dout, out = dout.to(q.dtype), out.to(q.dtype)
        # The libraries mark rows without keys with lse=+inf (so exp(s - lse) = 0); ours use -inf.
        lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse).to(torch.float32)
        passes = split_into_passes(blocks)
        if (grad_dtype == q.dtype and len(passes) == 1 and passes[0].q_span == (0, q.shape[0])
                and passes[0].k_span == (0, k.shape[0])):  # the library's gradients are the answer: no fp32 copies
            return self._pass_backward(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                                       out.contiguous(), lse, passes[0], softmax_scale)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for p in passes:
            qseg, qspan, kseg, kspan = p.q_segments, p.q_span, p.k_segments, p.k_span
            lse_p = gather_rows(lse.t(), qseg, qspan).t().contiguous()
            dq_p, dk_p, dv_p = self._pass_backward(
                gather_rows(dout, qseg, qspan), gather_rows(q, qseg, qspan), gather_rows(k, kseg, kspan),
                gather_rows(v, kseg, kspan), gather_rows(out, qseg, qspan), lse_p, p, softmax_scale)
            add_rows(dq, dq_p, qseg, qspan)
            add_rows(dk, dk_p, kseg, kspan)
            add_rows(dv, dv_p, kseg, kspan)
        if grad_dtype is not None:
            return dq.to(grad_dtype), dk.to(grad_dtype), dv.to(grad_dtype)
        return dq, dk, dv

