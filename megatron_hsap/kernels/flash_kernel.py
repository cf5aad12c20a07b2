"""flash-attn 2 varlen kernels behind the ``AttentionKernel`` interface.

Supported: flash-attn >= 2.6.0, < 3 (``pip install flash-attn``), CUDA, fp16/bf16,
head dims that are multiples of 8 up to 256, GQA natively (h_q a multiple of
h_kv). From 2.6.0 on the varlen functions return the log-sum-exp packed as
``[h, total_q]``, which is this package's layout; later 2.x releases renamed the
backward's ``window_size`` argument to ``window_size_left/right`` (the signature
is inspected, both spellings work). Other versions raise a RuntimeError naming
the supported range when the kernel is built.

Forward uses the public ``flash_attn_varlen_func(..., return_attn_probs=True)``
(it returns ``(out, softmax_lse, S_dmask)`` in every 2.x release). Backward uses
``flash_attn_interface._flash_attn_varlen_backward``, which takes ``out`` and
``softmax_lse`` as inputs: given the *final* (merged) values it yields each
call's exact share of the gradients, the same trick ring attention relies on.
Blocks are turned into varlen passes by ``gpu_common.VarlenPassKernel``.
"""

from __future__ import annotations

import inspect
from typing import Callable, Tuple

import torch

from megatron_hsap.kernels.base import AttentionBlocks
from megatron_hsap.kernels.gpu_common import VarlenPass, VarlenPassKernel, version_tuple

MIN_VERSION = (2, 6, 0)
MAX_VERSION_EXCLUSIVE = (3, 0, 0)


def _takes_argument(fn: Callable, name: str) -> bool:
    """Whether ``fn`` (a function or a ``torch.library.custom_op``, which keeps it in ``_init_fn``) has ``name``."""
    target = getattr(fn, "_init_fn", fn)
    try:
        return name in inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False


class FlashAttentionKernel(VarlenPassKernel):
    """Local attention with flash-attn 2's varlen forward/backward (one call per varlen pass)."""

    name = "flash"
    probe_module = "flash_attn.flash_attn_interface"
    max_head_dim = 256

    def __init__(self) -> None:
        import flash_attn
        from flash_attn import flash_attn_interface

        version = version_tuple(getattr(flash_attn, "__version__", "0"))
        if not MIN_VERSION <= version < MAX_VERSION_EXCLUSIVE:
            raise RuntimeError(f"flash-attn {flash_attn.__version__} is not supported by megatron_hsap's 'flash' "
                               "kernel; install flash-attn>=2.6.0,<3 or use kernel='te' or 'torch'")
        self._varlen_func = flash_attn_interface.flash_attn_varlen_func
        self._varlen_backward = flash_attn_interface._flash_attn_varlen_backward
        # Later 2.x releases split the sliding-window argument of the low-level backward in two.
        self._no_window = ({"window_size_left": -1, "window_size_right": -1}
                           if _takes_argument(self._varlen_backward, "window_size_left")
                           else {"window_size": (-1, -1)})

    @classmethod
    def check_inputs(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: AttentionBlocks) -> None:
        super().check_inputs(q, k, v, blocks)
        if q.device.type != "cuda":
            raise ValueError(f"the 'flash' kernel needs CUDA tensors, got q on {q.device}")

    def _pass_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: VarlenPass,
                      softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
        cu_q, cu_k = p.device_cu_seqlens(q.device)
        with torch.no_grad():
            out, lse, _ = self._varlen_func(q, k, v, cu_q, cu_k, p.max_seqlen_q, p.max_seqlen_k, dropout_p=0.0,
                                            softmax_scale=softmax_scale, causal=p.causal,
                                            return_attn_probs=True)
        if lse.dim() != 2:
            raise RuntimeError(f"flash-attn returned softmax_lse of shape {tuple(lse.shape)}; expected the packed "
                               "[h, total_q] layout of flash-attn>=2.6.0")
        return out, lse

    def _pass_backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, p: VarlenPass,
                       softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cu_q, cu_k = p.device_cu_seqlens(q.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, p.max_seqlen_q, p.max_seqlen_k,
                              0.0, softmax_scale, p.causal, softcap=0.0, alibi_slopes=None, deterministic=False,
                              rng_state=None, **self._no_window)
        return dq, dk, dv
