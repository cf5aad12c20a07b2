"""TransformerEngine fused (cuDNN) attention behind the ``AttentionKernel`` interface.

Uses the low-level ``transformer_engine.pytorch.cpp_extensions.fused_attn``
functions ``fused_attn_fwd`` / ``fused_attn_bwd`` with ``qkv_layout="thd_thd_thd"``
(packed tokens with cu_seqlens, the padded offsets equal to the plain ones) and
the ``F16_arbitrary_seqlen`` backend, as TE's own context-parallel code does.

Supported: TransformerEngine >= 2.0, < 3 (the 2.x signature with ``fake_dtype``;
``pip install transformer-engine[pytorch]``), CUDA with cuDNN, fp16/bf16, head
dims that are multiples of 8 up to 128 (a conservative bound every cuDNN 9
release accepts for both passes), GQA natively. Other versions raise a
RuntimeError naming the supported range when the kernel is built.

Softmax statistics: with ``is_training=True`` the forward returns
``aux_ctx_tensors = [stats, rng_state, ...]`` where ``stats`` is the natural-log
softmax denominator of the scaled scores (float32), laid out ``[t, h, 1]``
("packed", cuDNN >= 9.6) or ``[b, h, max_seqlen_q, 1]`` (older cuDNN). Both are
mapped to this package's ``[h, t]`` LSE, and the backward hands the *final*
(merged) LSE back in the same layout, which gives each call its exact share of
the gradients (the ring-attention trick). Causal blocks use the
``padding_causal_bottom_right`` mask, the same alignment as base.py.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Tuple

import torch

from megatron_hsap.kernels.base import AttentionBlocks
from megatron_hsap.kernels.gpu_common import VarlenPass, VarlenPassKernel, version_tuple

MIN_VERSION = (2, 0, 0)
MAX_VERSION_EXCLUSIVE = (3, 0, 0)
PACKED_STATS_CUDNN = (9, 6, 0)


@lru_cache(maxsize=256)
def _padded_stats_index(p: VarlenPass, max_seqlen_q: int, device: torch.device) -> torch.Tensor:
    """Positions of the pass's packed query rows in a ``[b * max_seqlen_q]`` padded row space."""
    cu = p.cu_seqlens_q
    index = torch.cat([torch.arange(i * max_seqlen_q, i * max_seqlen_q + cu[i + 1] - cu[i], dtype=torch.int64)
                       for i in range(len(cu) - 1)])
    return index.to(device, non_blocking=True)


def stats_to_lse(stats: torch.Tensor, p: VarlenPass, packed: bool) -> torch.Tensor:
    """TE's softmax stats of one pass -> lse ``[h, n_q]`` float32.

    stats: ``[t, h, 1]`` when ``packed`` (cuDNN >= 9.6), else ``[b, h, max_seqlen_q, 1]``.
    """
    n_q = p.cu_seqlens_q[-1]
    if packed:
        if stats.dim() != 3 or stats.shape[0] < n_q:
            raise RuntimeError(f"TE returned softmax stats of shape {tuple(stats.shape)}; expected [t, h, 1]")
        return stats[:n_q, :, 0].t().float().contiguous()
    if stats.dim() != 4:
        raise RuntimeError(f"TE returned softmax stats of shape {tuple(stats.shape)}; expected [b, h, s, 1]")
    b, h, s, _ = stats.shape
    rows = stats[..., 0].permute(1, 0, 2).reshape(h, b * s)
    return rows.index_select(1, _padded_stats_index(p, s, stats.device)).float()


def lse_to_stats(lse: torch.Tensor, p: VarlenPass, packed: bool) -> torch.Tensor:
    """Inverse of ``stats_to_lse``: lse ``[h, n_q]`` -> the stats layout TE's backward reads."""
    if packed:
        return lse.t().contiguous().unsqueeze(-1)
    h, s, b = lse.shape[0], p.max_seqlen_q, len(p.q_segments)
    rows = torch.zeros((h, b * s), dtype=torch.float32, device=lse.device)
    rows.index_copy_(1, _padded_stats_index(p, s, lse.device), lse.float())
    return rows.view(h, b, s).permute(1, 0, 2).contiguous().unsqueeze(-1)


class TEAttentionKernel(VarlenPassKernel):
    """Local attention with TransformerEngine's fused THD attention (one call per varlen pass)."""

    name = "te"
    probe_module = "transformer_engine.pytorch.cpp_extensions.fused_attn"
    max_head_dim = 128

    def __init__(self) -> None:
        import transformer_engine
        from transformer_engine.pytorch.constants import TE_DType
        from transformer_engine.pytorch.cpp_extensions import fused_attn
        from transformer_engine.pytorch.utils import get_cudnn_version

        version = version_tuple(getattr(transformer_engine, "__version__", "0"))
        if not (MIN_VERSION <= version < MAX_VERSION_EXCLUSIVE
                and "fake_dtype" in inspect.signature(fused_attn.fused_attn_fwd).parameters):
            raise RuntimeError(f"TransformerEngine {getattr(transformer_engine, '__version__', '?')} is not supported "
                               "by megatron_hsap's 'te' kernel; install transformer-engine[pytorch]>=2.0,<3 or use "
                               "kernel='flash' or 'torch'")
        self._fwd, self._bwd = fused_attn.fused_attn_fwd, fused_attn.fused_attn_bwd
        self._backend = fused_attn.FusedAttnBackend["F16_arbitrary_seqlen"]
        self._te_dtype = TE_DType
        self._packed_stats = tuple(get_cudnn_version()) >= PACKED_STATS_CUDNN

    @classmethod
    def check_inputs(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: AttentionBlocks) -> None:
        super().check_inputs(q, k, v, blocks)
        if q.device.type != "cuda":
            raise ValueError(f"the 'te' kernel needs CUDA tensors, got q on {q.device}")

    def _common_kwargs(self, p: VarlenPass, q: torch.Tensor, softmax_scale: float) -> dict:
        """Keyword arguments shared by fused_attn_fwd/bwd (keywords keep the calls valid across 2.x
        releases that added parameters)."""
        cu_q, cu_k = p.device_cu_seqlens(q.device)
        return dict(max_seqlen_q=p.max_seqlen_q, max_seqlen_kv=p.max_seqlen_k, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k,
                    cu_seqlens_q_padded=cu_q, cu_seqlens_kv_padded=cu_k, fake_dtype=q.dtype,
                    fused_attention_backend=self._backend, attn_scale=softmax_scale, dropout=0.0,
                    qkv_layout="thd_thd_thd", attn_bias_type="no_bias",
                    attn_mask_type="padding_causal_bottom_right" if p.causal else "padding")

    def _pass_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: VarlenPass,
                      softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
        result = self._fwd(is_training=True, q=q, k=k, v=v, **self._common_kwargs(p, q, softmax_scale))
        out, aux = result[0], result[1]
        return out, stats_to_lse(aux[0], p, self._packed_stats)

    def _pass_backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, p: VarlenPass,
                       softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)  # unused without dropout
        aux = [lse_to_stats(lse, p, self._packed_stats), rng_state]
        grads = self._bwd(q=q, k=k, v=v, o=out, d_o=dout, dqkv_dtype=self._te_dtype[q.dtype], aux_ctx_tensors=aux,
                          **self._common_kwargs(p, q, softmax_scale))
        return grads[0], grads[1], grads[2]
