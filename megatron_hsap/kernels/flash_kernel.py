"""flash-attn 2 varlen kernels behind the ``AttentionKernel`` interface.

Supported releases: flash-attn 2.6.0 to 2.8.3 (``pip install flash-attn``), every
release whose signatures were read from flash-attn's public source; CUDA,
fp16/bf16, head dims that are multiples of 8 up to 256, GQA natively (h_q a
multiple of h_kv). Since 2.6.0 the varlen functions return the log-sum-exp
packed as ``[h, total_q]``, this package's layout.

Forward uses the public ``flash_attn_varlen_func(..., return_attn_probs=True)``
(``(out, softmax_lse, S_dmask)``; its signature is the same from 2.6.0 to 2.8.3).
Backward uses ``flash_attn_interface._flash_attn_varlen_backward``, which takes
``out`` and ``softmax_lse`` as inputs: given the *final* (merged) values it
yields each call's exact share of the gradients, the trick ring attention relies
on. That private function drifted: 2.6.x takes ``window_size=(l, r)`` and returns
``(dq, dk, dv, softmax_d)``; 2.7.0 split it into ``window_size_left/right``,
wrapped it in a ``torch.library.custom_op`` (``torch.ops.flash_attn``; the
module attribute keeps the Python function in ``_init_fn``) and returns only
``softmax_d``; 2.7.4 added ``zero_tensors=False``. The keyword arguments are
built from the installed signature and dq/dk/dv are the buffers passed in (filled
in place by every release), so all of these work. A release below 2.6.0 or from
3 on, or one with a parameter not reviewed here, raises a RuntimeError naming it
when the kernel is built (``gpu_common.accepted_keywords``); the transcribed
signatures the tests check against are ``tests/library_signatures.py``.
Sliding windows: each pass's ``window_size`` (flash-attn's bottom-right convention since
2.3, the same as ``AttentionBlocks.windows``) goes to the forward and the backward.
Blocks are turned into varlen passes by ``gpu_common.VarlenPassKernel``.
"""

from __future__ import annotations

from typing import Tuple

import torch

from megatron_hsap.kernels.base import AttentionBlocks
from megatron_hsap.kernels.gpu_common import VarlenPass, VarlenPassKernel, accepted_keywords, version_tuple

MIN_VERSION = (2, 6, 0)
MAX_VERSION_EXCLUSIVE = (3, 0, 0)
NEWEST_VERIFIED = (2, 8, 3)  # the newest release whose signatures were read (tests/library_signatures.py)

FWD_PASSED = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
              "softmax_scale", "causal", "window_size", "return_attn_probs")
FWD_DEFAULTS_OK = ("softcap", "alibi_slopes", "deterministic", "block_table")
BWD_PASSED = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k",
              "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal", "window_size",
              "window_size_left", "window_size_right", "softcap", "alibi_slopes", "deterministic", "rng_state")
BWD_DEFAULTS_OK = ("zero_tensors",)


class FlashAttentionKernel(VarlenPassKernel):
    """Local attention with flash-attn 2's varlen forward/backward (one call per varlen pass)."""

    name = "flash"
    probe_module = "flash_attn.flash_attn_interface"
    max_head_dim = 256

    def __init__(self) -> None:
        import flash_attn
        from flash_attn import flash_attn_interface

        label = f"flash-attn {getattr(flash_attn, '__version__', '?')}"
        version = version_tuple(getattr(flash_attn, "__version__", "0"))
        hint = (f"install flash-attn>=2.6.0,<3 (signatures verified up to {'.'.join(map(str, NEWEST_VERIFIED))}) "
                "or use kernel='te' or 'torch'")
        if not MIN_VERSION <= version < MAX_VERSION_EXCLUSIVE:
            raise RuntimeError(f"{label} is not supported by megatron_hsap's 'flash' kernel; {hint}")
        self._varlen_func = flash_attn_interface.flash_attn_varlen_func
        self._varlen_backward = flash_attn_interface._flash_attn_varlen_backward
        try:
            self._fwd_keywords = accepted_keywords(self._varlen_func, FWD_PASSED, FWD_DEFAULTS_OK,
                                                   f"{label} flash_attn_varlen_func")
            self._bwd_keywords = accepted_keywords(self._varlen_backward, BWD_PASSED, BWD_DEFAULTS_OK,
                                                   f"{label} _flash_attn_varlen_backward")
        except RuntimeError as err:
            raise RuntimeError(f"{err}; {hint}") from None

    @classmethod
    def check_inputs(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: AttentionBlocks) -> None:
        super().check_inputs(q, k, v, blocks)
        if q.device.type != "cuda":
            raise ValueError(f"the 'flash' kernel needs CUDA tensors, got q on {q.device}")

    def _pass_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: VarlenPass,
                      softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
        cu_q, cu_k = p.device_cu_seqlens(q.device)
        values = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=p.max_seqlen_q,
                      max_seqlen_k=p.max_seqlen_k, dropout_p=0.0, softmax_scale=softmax_scale, causal=p.causal,
                      window_size=p.window, return_attn_probs=True)
        with torch.no_grad():
            out, lse, _ = self._varlen_func(**{n: values[n] for n in self._fwd_keywords})
        if lse.dim() != 2:
            raise RuntimeError(f"flash-attn returned softmax_lse of shape {tuple(lse.shape)}; expected the packed "
                               "[h, total_q] layout of flash-attn>=2.6.0")
        return out, lse

    def _pass_backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, p: VarlenPass,
                       softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cu_q, cu_k = p.device_cu_seqlens(q.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        values = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu_q,
                      cu_seqlens_k=cu_k, max_seqlen_q=p.max_seqlen_q, max_seqlen_k=p.max_seqlen_k, dropout_p=0.0,
                      softmax_scale=softmax_scale, causal=p.causal, window_size=p.window, window_size_left=p.window[0],
                      window_size_right=p.window[1], softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None)
        self._varlen_backward(**{n: values[n] for n in self._bwd_keywords})
        return dq, dk, dv
