"""PyTorch's own fused varlen flash attention behind the ``AttentionKernel`` interface.

Every CUDA build of PyTorch carries flash-attention 2 kernels (the ones behind
``scaled_dot_product_attention``); this kernel calls their variable-length form, so a
machine without flash-attn or TransformerEngine still runs a fused kernel. CUDA, fp16/bf16,
head dims that are multiples of 8 up to 256, GQA natively (the kernel maps query head j to
KV head ``j // (h_q // h_kv)``, as base.py does), sliding windows in flash-attn's
bottom-right convention (that of ``AttentionBlocks.windows``).

Forward: the public ``torch.nn.attention.varlen.varlen_attn(..., return_aux=AuxRequest(lse=True),
scale=, window_size=, enable_gqa=True)`` where the installed release has all of those
(PyTorch >= 2.12; 2.9 has only ``is_causal``/``return_aux``, 2.10 adds ``scale`` and
``window_size`` but not ``enable_gqa``), else the operator it wraps,
``torch.ops.aten._flash_attention_forward`` (query, key, value, cum_seq_q/k, max_q/k,
dropout_p, is_causal, return_debug_mask, then keyword-only scale and window sizes), which
returns ``(out, logsumexp [h, t], rng_state, unused, debug_mask)``. A causal pass is
``window_size=(left, 0)`` (``(-1, 0)`` = plain causal) for the public function and
``is_causal=True`` plus the window for the operator. ``varlen_attn_out`` (PyTorch 2.13) writes
into a caller's buffer; each pass here returns a fresh output that the pass merge consumes, so
it has nothing to offer yet.

Backward: ``torch.ops.aten._flash_attention_backward`` in every release (the public function
has only autograd, which would use its own out/lse): it takes ``out`` and ``logsumexp`` as
inputs, so given the *final* (merged) values it yields each call's exact share of the
gradients, the trick ring attention relies on (as the flash-attn kernel). Without dropout its
``rng_state``/``unused`` inputs are not read; it gets zeros / an empty tensor, as PyTorch's own
varlen backward passes.

The keyword arguments are built from the installed signature / operator schema
(``gpu_common.accepted_keywords``): a release with a parameter not reviewed here is a
RuntimeError naming it when the kernel is built. The transcribed signatures the tests check
against are in ``tests/library_signatures.py`` (``TORCH_RELEASES``). Blocks become varlen passes
in ``gpu_common.VarlenPassKernel``.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional, Tuple

import torch

from megatron_hsap.kernels.base import AttentionBlocks
from megatron_hsap.kernels.gpu_common import VarlenPass, VarlenPassKernel, accepted_keywords, signature_parameters

MIN_CAPABILITY = (8, 0)  # PyTorch's flash kernels: Ampere and newer

PUBLIC_PASSED = ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "return_aux", "scale",
                 "window_size", "enable_gqa")
PUBLIC_DEFAULTS_OK = ("is_causal", "seqused_k", "block_table", "num_splits")
#: what the public function must take for this kernel to use it (else the operator)
PUBLIC_NEEDED = ("return_aux", "scale", "window_size", "enable_gqa")
FWD_PASSED = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
              "return_debug_mask", "scale", "window_size_left", "window_size_right")
FWD_DEFAULTS_OK = ("seqused_k", "alibi_slopes", "block_table", "num_splits")
BWD_PASSED = ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
              "dropout_p", "is_causal", "rng_state", "unused", "scale", "window_size_left", "window_size_right")
BWD_DEFAULTS_OK = ()


def _installed_varlen_module() -> Optional[Any]:
    try:
        return importlib.import_module("torch.nn.attention.varlen")
    except ImportError:  # PyTorch < 2.9
        return None


def torch_window(p: VarlenPass) -> Tuple[int, int]:
    """A pass's causal flag and window as one flash window ``(left, right)``: causal caps ``right`` at 0."""
    left, right = p.window
    if p.causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


class TorchFlashAttentionKernel(VarlenPassKernel):
    """Local attention with PyTorch's fused varlen flash attention (one call per varlen pass)."""

    name = "torch_flash"
    max_head_dim = 256

    def __init__(self, varlen: Optional[Any] = None, aten: Optional[Any] = None) -> None:
        """``varlen`` / ``aten``: the ``torch.nn.attention.varlen`` module and the ``torch.ops.aten`` namespace
        (the installed ones by default; the tests pass stand-ins with transcribed signatures)."""
        varlen = _installed_varlen_module() if varlen is None else varlen
        aten = torch.ops.aten if aten is None else aten
        label = f"PyTorch {torch.__version__}"
        hint = "use kernel='torch', or 'flash'/'te' where installed"
        try:
            self._fwd_op, self._bwd_op = aten._flash_attention_forward, aten._flash_attention_backward
            self._fwd_keywords = accepted_keywords(self._fwd_op, FWD_PASSED, FWD_DEFAULTS_OK,
                                                   f"{label} aten._flash_attention_forward")
            self._bwd_keywords = accepted_keywords(self._bwd_op, BWD_PASSED, BWD_DEFAULTS_OK,
                                                   f"{label} aten._flash_attention_backward")
            self._public, self._public_keywords, self._aux = None, frozenset(), None
            public = getattr(varlen, "varlen_attn", None)
            if public is not None and set(PUBLIC_NEEDED) <= set(signature_parameters(public)):
                self._public_keywords = accepted_keywords(public, PUBLIC_PASSED, PUBLIC_DEFAULTS_OK,
                                                          f"{label} varlen_attn")
                self._public, self._aux = public, varlen.AuxRequest(lse=True)
        except AttributeError as err:
            raise RuntimeError(f"{label} has no fused varlen attention operator ({err}); {hint}") from None
        except RuntimeError as err:
            raise RuntimeError(f"{err}; {hint}") from None
        if not {"window_size_left", "window_size_right"} <= self._fwd_keywords | self._bwd_keywords:
            raise RuntimeError(f"{label}: aten._flash_attention_forward/backward take no window sizes; {hint}")

    @classmethod
    def is_available(cls) -> bool:
        """True on a CUDA device of compute capability >= 8.0 with a PyTorch built with flash attention."""
        try:
            return (torch.cuda.is_available() and torch.backends.cuda.is_flash_attention_available()
                    and torch.cuda.get_device_capability() >= MIN_CAPABILITY)
        except Exception:  # a broken CUDA setup just means "not available"
            return False

    @classmethod
    def check_inputs(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: AttentionBlocks) -> None:
        super().check_inputs(q, k, v, blocks)
        if q.device.type != "cuda":
            raise ValueError(f"the 'torch_flash' kernel needs CUDA tensors, got q on {q.device}")

    @property
    def uses_public_api(self) -> bool:
        """Whether the forward goes through ``torch.nn.attention.varlen.varlen_attn`` (else the aten operator)."""
        return self._public is not None

    def _pass_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: VarlenPass,
                      softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
        cu_q, cu_k = p.device_cu_seqlens(q.device)
        left, right = torch_window(p)
        with torch.no_grad():  # the backward is this kernel's own (with the merged out/lse)
            if self._public is not None:
                values = dict(query=q, key=k, value=v, cu_seq_q=cu_q, cu_seq_k=cu_k, max_q=p.max_seqlen_q,
                              max_k=p.max_seqlen_k, return_aux=self._aux, scale=softmax_scale,
                              window_size=(left, right), enable_gqa=True)
                out, lse = self._public(**{n: values[n] for n in self._public_keywords})
            else:
                values = dict(query=q, key=k, value=v, cum_seq_q=cu_q, cum_seq_k=cu_k, max_q=p.max_seqlen_q,
                              max_k=p.max_seqlen_k, dropout_p=0.0, is_causal=p.causal, return_debug_mask=False,
                              scale=softmax_scale, window_size_left=left, window_size_right=right)
                out, lse = self._fwd_op(**{n: values[n] for n in self._fwd_keywords})[:2]
        if lse.shape != (q.shape[1], q.shape[0]):
            raise RuntimeError(f"PyTorch's varlen flash attention returned a logsumexp of shape {tuple(lse.shape)}; "
                               f"expected [h, total_q] = {(q.shape[1], q.shape[0])}")
        return out, lse

    def _pass_backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, p: VarlenPass,
                       softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cu_q, cu_k = p.device_cu_seqlens(q.device)
        left, right = torch_window(p)
        values = dict(grad_out=dout, query=q, key=k, value=v, out=out, logsumexp=lse, cum_seq_q=cu_q,
                      cum_seq_k=cu_k, max_q=p.max_seqlen_q, max_k=p.max_seqlen_k, dropout_p=0.0,
                      is_causal=p.causal, rng_state=torch.zeros(2, dtype=torch.uint64, device=q.device),
                      unused=torch.empty(0, device=q.device), scale=softmax_scale, window_size_left=left,
                      window_size_right=right)
        dq, dk, dv = self._bwd_op(**{n: values[n] for n in self._bwd_keywords})
        return dq, dk, dv
