"""TransformerEngine fused (cuDNN) attention behind the ``AttentionKernel`` interface.

Uses the low-level ``transformer_engine.pytorch.cpp_extensions.fused_attn``
functions ``fused_attn_fwd`` / ``fused_attn_bwd`` with ``qkv_layout="thd_thd_thd"``
(packed tokens with cu_seqlens, the padded offsets equal to the plain ones) and
the ``F16_arbitrary_seqlen`` backend, as TE's own context-parallel code does.

Supported releases: TransformerEngine 2.0 to 2.20, every release whose
signatures were read from TE's public source (``pip install
transformer-engine[pytorch]``); CUDA with cuDNN, fp16/bf16, head dims that are
multiples of 8 up to 128, GQA natively. The keyword arguments are built from the
*installed* signatures: ``o_format``/``do_format="thd"`` and
``dqkv_layout="thd_thd_thd"`` where they exist (TE >= 2.15, whose defaults are
``sbhd``), ``dqkv_dtype`` only where it exists (TE < 2.15). A release whose
functions have a parameter not reviewed here, or older than 2.0, raises a
RuntimeError naming it when the kernel is built (see
``gpu_common.accepted_keywords``); the transcribed signatures the tests check
against are ``tests/library_signatures.py``.

Backend support is TE's to decide, so it is asked, not assumed: TE's
``get_fused_attn_backend`` query (positional, 14 to 19 arguments depending on
the release; from 2.20 one ``FusedAttentionParams`` object, answered with
``(backend, reject message)``, the message quoted when a call falls back) is run once when the kernel is built for a representative shape
(bf16, MHA, head dim 128, causal, 4096 tokens) -- on a device where even that
has no fused backend (THD needs sm90+ and cuDNN >= 9.1; cuDNN 9.10.0/9.10.1 are
excluded) building the kernel is a RuntimeError with the reason, which
``get_kernel("auto")`` turns into a fall-back to flash-attn, then torch_flash, then torch -- and
once per distinct pass shape (dtype, heads, KV heads, head dim, mask, max
lengths; GQA + THD needs cuDNN >= 9.6, a bottom-right causal mask cuDNN >= 9.6
with lengths a multiple of 64, or TE >= 2.2 with cuDNN >= 9.7). A call with a pass TE does not
support is delegated whole (forward and backward alike, same blocks, same
decision) to the flash kernel if it is available, else torch_flash where it runs, else the torch kernel, with
one warning on rank 0 per shape class; so is every call with a sliding window (its
alignment on TE's THD masks is not verified yet). Causal passes whose segments are square use
the top-left ``padding_causal`` mask (the same mask there, accepted by older
cuDNN); others ``padding_causal_bottom_right``, the alignment of base.py.

Softmax statistics: with ``is_training=True`` the forward returns
``aux_ctx_tensors = [stats, rng_state, ...]`` where ``stats`` is the natural-log
softmax denominator of the scaled scores (float32), laid out ``[t, h, 1]``
("ragged", cuDNN >= 9.6 except sm120) or ``[b, h, max_seqlen_q, 1]``. The layout
is read from the forward's result; both are mapped to this package's ``[h, t]``
LSE, and the backward hands the *final* (merged) LSE back in the layout the
forward produced, which gives each call its exact share of the gradients.
"""

from __future__ import annotations

import importlib
import logging
import re
from functools import lru_cache
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron_hsap.kernels.base import UNBOUNDED, AttentionBlocks, AttentionKernel
from megatron_hsap.kernels.gpu_common import (VarlenPass, VarlenPassKernel, accepted_keywords, cached_device_index,
                                              split_into_passes, version_tuple, warn_once_on_rank0)

MIN_VERSION = (2, 0, 0)
NEWEST_VERIFIED = (2, 20)  # the newest release whose signatures were read (tests/library_signatures.py)
RAGGED_STATS_CUDNN = (9, 6, 0)
PROBE_SHAPE = dict(h_q=8, h_kv=8, head_dim=128, max_seqlen_q=4096, max_seqlen_kv=4096)
PACKAGE_HINT = ("transformer-engine[pytorch]>=2.0 (signatures verified up to "
                + ".".join(map(str, NEWEST_VERIFIED)) + ")")

# What this kernel passes to fused_attn_fwd / fused_attn_bwd (each only where the installed function has it)
# and the parameters it leaves at their defaults, reviewed in every release from 2.0 to 2.20.
FWD_PASSED = ("is_training", "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v",
              "fake_dtype", "fused_attention_backend", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "attn_scale",
              "dropout", "qkv_layout", "o_format", "attn_bias_type", "attn_mask_type")
FWD_DEFAULTS_OK = ("attn_bias", "page_table_k", "page_table_v", "s_quantizer", "o_quantizer", "fast_zero_fill",
                   "qkv_scale_inv_format", "softmax_type", "window_size", "bottom_right_diagonal", "rng_gen",
                   "softmax_offset", "return_max_logit", "cuda_graph")
BWD_PASSED = ("max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v", "o", "d_o",
              "fake_dtype", "dqkv_dtype", "aux_ctx_tensors", "fused_attention_backend", "cu_seqlens_q_padded",
              "cu_seqlens_kv_padded", "attn_scale", "dropout", "qkv_layout", "o_format", "do_format", "dqkv_layout",
              "attn_bias_type", "attn_mask_type")
BWD_DEFAULTS_OK = ("s_quantizer", "dp_quantizer", "dqkv_quantizer", "fast_zero_fill", "qkv_scale_inv_format",
                   "do_scale_inv_format", "softmax_type", "window_size", "bottom_right_diagonal", "deterministic",
                   "cuda_graph")

# tex.get_fused_attn_backend is a pybind11 function with positional arguments only; its arity by release.
_QUERY_BASE = ["q_dtype", "kv_dtype", "qkv_layout", "bias_type", "attn_mask_type", "p_dropout", "num_attn_heads",
               "num_gqa_groups", "max_seqlen_q", "max_seqlen_kv", "head_dim_qk", "head_dim_v",
               "window_size_left", "window_size_right"]
QUERY_ARGUMENTS: Dict[int, List[str]] = {
    14: _QUERY_BASE,                                                  # 2.0 - 2.4
    15: ["is_training"] + _QUERY_BASE,                                # 2.5 - 2.7
    16: ["is_training"] + _QUERY_BASE[:5] + ["softmax_type"] + _QUERY_BASE[5:],  # 2.8
    17: ["is_training"] + _QUERY_BASE[:5] + ["softmax_type"] + _QUERY_BASE[5:] + ["return_max_logit"],  # 2.9
}
QUERY_ARGUMENTS[18] = QUERY_ARGUMENTS[17] + ["cuda_graph"]            # 2.10 - 2.11
QUERY_ARGUMENTS[19] = QUERY_ARGUMENTS[18] + ["deterministic"]         # 2.12 - 2.19
QUERY_ARGUMENTS[1] = ["params"]  # 2.20: one FusedAttentionParams, answered with (backend, message)
_QUERY_ARITY_BY_VERSION = ((2, 20, 1), (2, 12, 19), (2, 10, 18), (2, 9, 17), (2, 8, 16), (2, 5, 15), (2, 0, 14))
#: FusedAttentionParams fields (2.20) this kernel sets; the others, reviewed, keep their defaults (paged KV,
#: bias shapes, FP8 scaling and scale-inverse formats, the softmax scale, which the query does not depend on here)
PARAMS_PASSED = ("is_training", "deterministic", "cuda_graph", "return_max_logit", "attn_mask_type", "bias_type",
                 "window_size_left", "window_size_right", "bottom_right_diagonal", "softmax_type", "dropout",
                 "qkv_dtype", "o_dtype", "do_dtype", "dqkv_dtype", "qkv_layout", "o_format", "do_format",
                 "dqkv_layout", "batch_size", "num_attn_heads", "num_gqa_groups", "head_dim_qk", "head_dim_v",
                 "max_seqlen_q", "max_seqlen_kv", "num_tokens_q", "num_tokens_kv")
PARAMS_DEFAULTS_OK = ("scaling_mode", "attn_scale", "qkv_scale_inv_format", "do_scale_inv_format", "num_pages_k",
                      "num_pages_v", "page_size_k", "page_size_v", "max_pages_per_seq_k", "max_pages_per_seq_v",
                      "bias_batch_size", "bias_num_heads", "bias_seqlen_q", "bias_seqlen_kv")
PARAMS_MODULE = "transformer_engine.pytorch.attention.dot_product_attention.utils"

_log = logging.getLogger(__name__)


def query_arity(query: Callable, version: Tuple[int, ...]) -> int:
    """Number of positional arguments of ``tex.get_fused_attn_backend``: read from its pybind11 docstring
    (``get_fused_attn_backend(arg0: bool, ...)``), else from the release table."""
    numbers = [int(n) for n in re.findall(r"\barg(\d+):", (getattr(query, "__doc__", None) or "").split("\n")[0])]
    if numbers:
        return max(numbers) + 1
    return next(arity for major, minor, arity in _QUERY_ARITY_BY_VERSION if version[:2] >= (major, minor))


def _padded_stats_index(p: VarlenPass, max_seqlen_q: int, device: torch.device) -> torch.Tensor:
    """Positions of the pass's packed query rows in a ``[b * max_seqlen_q]`` padded row space."""
    cu = p.cu_seqlens_q

    def build() -> torch.Tensor:
        return torch.cat([torch.arange(i * max_seqlen_q, i * max_seqlen_q + cu[i + 1] - cu[i], dtype=torch.int64)
                          for i in range(len(cu) - 1)])
    return cached_device_index(("te-stats", cu, max_seqlen_q), device, build)


def stats_to_lse(stats: torch.Tensor, p: VarlenPass) -> torch.Tensor:
    """TE's softmax stats of one pass -> lse ``[h, n_q]`` float32.

    stats: ``[t, h, 1]`` (ragged, cuDNN >= 9.6) or ``[b, h, max_seqlen_q, 1]`` (padded).
    """
    n_q = p.cu_seqlens_q[-1]
    if stats.dim() == 3 and stats.shape[0] >= n_q:
        return stats[:n_q, :, 0].t().float().contiguous()
    if stats.dim() != 4:
        raise RuntimeError(f"TE returned softmax stats of shape {tuple(stats.shape)}; expected [t, h, 1] "
                           "or [b, h, s, 1]")
    b, h, s, _ = stats.shape
    rows = stats[..., 0].permute(1, 0, 2).reshape(h, b * s)
    return rows.index_select(1, _padded_stats_index(p, s, stats.device)).float()


def lse_to_stats(lse: torch.Tensor, p: VarlenPass, ragged: bool) -> torch.Tensor:
    """Inverse of ``stats_to_lse``: lse ``[h, n_q]`` -> the stats layout TE's backward reads."""
    if ragged:
        return lse.t().contiguous().unsqueeze(-1)
    h, s, b = lse.shape[0], p.max_seqlen_q, len(p.q_segments)
    rows = torch.zeros((h, b * s), dtype=torch.float32, device=lse.device)
    rows.index_copy_(1, _padded_stats_index(p, s, lse.device), lse.float())
    return rows.view(h, b, s).permute(1, 0, 2).contiguous().unsqueeze(-1)


def mask_type(p: VarlenPass) -> str:
    """TE mask of a pass: no mask inside a sequence, or causal (top-left = bottom-right when square)."""
    if not p.causal:
        return "padding"
    square = all(qe - qs == ke - ks for (qs, qe), (ks, ke) in zip(p.q_segments, p.k_segments))
    return "padding_causal" if square else "padding_causal_bottom_right"


class TEAttentionKernel(VarlenPassKernel):
    """Local attention with TransformerEngine's fused THD attention (one call per varlen pass)."""

    name = "te"
    probe_module = "transformer_engine.pytorch.cpp_extensions.fused_attn"
    max_head_dim = 128

    def __init__(self) -> None:
        import transformer_engine
        from transformer_engine.pytorch import constants, utils
        fused_attn = importlib.import_module(self.probe_module)

        label = f"TransformerEngine {getattr(transformer_engine, '__version__', '?')}"
        version = version_tuple(getattr(transformer_engine, "__version__", "0"))
        hint = f"install {PACKAGE_HINT} or use kernel='flash' or 'torch'"
        if version < MIN_VERSION:
            raise RuntimeError(f"{label} is not supported by megatron_hsap's 'te' kernel; {hint}")
        try:
            self._fwd_keywords = accepted_keywords(fused_attn.fused_attn_fwd, FWD_PASSED, FWD_DEFAULTS_OK,
                                                   f"{label} fused_attn_fwd")
            self._bwd_keywords = accepted_keywords(fused_attn.fused_attn_bwd, BWD_PASSED, BWD_DEFAULTS_OK,
                                                   f"{label} fused_attn_bwd")
            arity = query_arity(fused_attn.tex.get_fused_attn_backend, version)
            if arity not in QUERY_ARGUMENTS:
                raise RuntimeError(f"{label} get_fused_attn_backend takes {arity} arguments, a layout new to "
                                   "megatron_hsap")
            self._query, self._query_names = fused_attn.tex.get_fused_attn_backend, QUERY_ARGUMENTS[arity]
            if self._query_names == ["params"]:
                self._params_cls = importlib.import_module(PARAMS_MODULE).FusedAttentionParams
                self._params_keywords = accepted_keywords(self._params_cls, PARAMS_PASSED, PARAMS_DEFAULTS_OK,
                                                          f"{label} FusedAttentionParams")
            self._backend = fused_attn.FusedAttnBackend["F16_arbitrary_seqlen"]
            self._te_dtype = constants.TE_DType
            capability = tuple(utils.get_device_compute_capability())
            cudnn = tuple(utils.get_cudnn_version())
        except (AttributeError, KeyError, ImportError) as err:  # a module layout this package does not know
            raise RuntimeError(f"{label}: {type(err).__name__} {err} while reading its fused attention API; "
                               f"{hint}") from None
        except RuntimeError as err:
            raise RuntimeError(f"{err}; {hint}") from None
        self._fused_attn = fused_attn
        self._label = label
        self._device = f"sm{capability[0]}{capability[1]}, cuDNN {'.'.join(map(str, cudnn))}"
        # the forward's result decides; this is TE's rule for the backward-only case
        self._ragged_stats = cudnn >= RAGGED_STATS_CUDNN and capability != (12, 0)
        self._supported = lru_cache(maxsize=4096)(self._query_supported)
        self._fallback_kernel: Optional[AttentionKernel] = None
        #: calls (forward or backward) delegated to the fallback kernel; reports show it next to TE's figures
        self.fallback_calls = 0
        try:
            supported, reason = self._supported(torch.bfloat16, causal_mask="padding_causal", **PROBE_SHAPE)
        except (TypeError, ValueError) as err:  # pybind11 rejects the arguments: a query layout new to us
            raise RuntimeError(f"{label}: get_fused_attn_backend rejected its arguments ({err}); {hint}") from None
        if not supported:
            raise RuntimeError(f"{label}: no fused THD attention backend on this device ({self._device}; TE needs "
                               f"sm90+ and cuDNN >= 9.1, not 9.10.0/9.10.1){reason}; use kernel='flash' or 'torch'")

    def _query_supported(self, dtype: torch.dtype, h_q: int, h_kv: int, head_dim: int, causal_mask: str,
                         max_seqlen_q: int, max_seqlen_kv: int) -> Tuple[bool, str]:
        """TE's own answer (``get_fused_attn_backend``) for one pass shape: whether it is the arbitrary-seqlen
        backend, and TE's reason when it is not (``": <message>"`` from 2.20 on, else empty)."""
        fa = self._fused_attn
        if self._query_names == ["params"]:
            return self._query_params(dtype, h_q, h_kv, head_dim, causal_mask, max_seqlen_q, max_seqlen_kv)
        values = dict(is_training=True, q_dtype=self._te_dtype[dtype], kv_dtype=self._te_dtype[dtype],
                      qkv_layout=fa.QKVLayout["thd_thd_thd"], bias_type=fa.AttnBiasType["no_bias"],
                      attn_mask_type=fa.AttnMaskType[causal_mask], p_dropout=0.0, num_attn_heads=h_q,
                      num_gqa_groups=h_kv, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
                      head_dim_qk=head_dim, head_dim_v=head_dim, window_size_left=-1, window_size_right=-1,
                      return_max_logit=False, cuda_graph=False, deterministic=False)
        if "softmax_type" in self._query_names:
            values["softmax_type"] = fa.SoftmaxType["vanilla"]
        return self._query(*(values[name] for name in self._query_names)) == self._backend, ""

    def _query_params(self, dtype: torch.dtype, h_q: int, h_kv: int, head_dim: int, causal_mask: str,
                      max_seqlen_q: int, max_seqlen_kv: int) -> Tuple[bool, str]:
        """The 2.20 query: one FusedAttentionParams for a THD pass of this shape (one sequence of the longest
        lengths stands for the batch), answered with (backend, message)."""
        fa, te_dtype = self._fused_attn, self._te_dtype[dtype]
        values = dict(is_training=True, deterministic=False, cuda_graph=False, return_max_logit=False,
                      attn_mask_type=fa.AttnMaskType[causal_mask], bias_type=fa.AttnBiasType["no_bias"],
                      window_size_left=-1, window_size_right=-1,
                      bottom_right_diagonal=causal_mask == "padding_causal_bottom_right",
                      softmax_type=fa.SoftmaxType["vanilla"], dropout=0.0, qkv_dtype=te_dtype, o_dtype=te_dtype,
                      do_dtype=te_dtype, dqkv_dtype=te_dtype, qkv_layout=fa.QKVLayout["thd_thd_thd"],
                      o_format=fa.QKVFormat["thd"], do_format=fa.QKVFormat["thd"],
                      dqkv_layout=fa.QKVLayout["thd_thd_thd"], batch_size=1, num_attn_heads=h_q,
                      num_gqa_groups=h_kv, head_dim_qk=head_dim, head_dim_v=head_dim, max_seqlen_q=max_seqlen_q,
                      max_seqlen_kv=max_seqlen_kv, num_tokens_q=max_seqlen_q, num_tokens_kv=max_seqlen_kv)
        backend, message = self._query(self._params_cls(**{n: values[n] for n in self._params_keywords}))
        return backend == self._backend, (f": {message}" if message else "")

    def _unsupported_pass(self, q: torch.Tensor, k: torch.Tensor, blocks: AttentionBlocks) -> Optional[dict]:
        """The first pass shape TE has no fused backend for, else None. Sliding-window passes are not sent to
        TE: the window alignment of its THD masks has not been verified on a GPU here."""
        for p in split_into_passes(blocks):
            if p.window != UNBOUNDED:
                return dict(window_size=p.window, dtype=q.dtype)
            shape = dict(h_q=q.shape[1], h_kv=k.shape[1], head_dim=q.shape[2], causal_mask=mask_type(p),
                         max_seqlen_q=p.max_seqlen_q, max_seqlen_kv=p.max_seqlen_k)
            supported, reason = self._supported(q.dtype, **shape)
            if not supported:
                return dict(shape, dtype=q.dtype, reason=reason)
        return None

    def _fallback(self, shape: dict) -> AttentionKernel:
        """flash-attn if it is there, else PyTorch's fused varlen kernel where it runs, else torch; announced on
        rank 0 once per shape class (lengths aside, which change with every batch) with TE's reason if it gave one."""
        if self._fallback_kernel is None:
            from megatron_hsap.kernels.flash_kernel import FlashAttentionKernel
            from megatron_hsap.kernels.torch_flash_kernel import TorchFlashAttentionKernel
            from megatron_hsap.kernels.torch_kernel import TorchAttentionKernel
            available = [cls for cls in (FlashAttentionKernel, TorchFlashAttentionKernel) if cls.is_available()]
            self._fallback_kernel = available[0]() if available else TorchAttentionKernel()
        self.fallback_calls += 1
        shape = dict(shape)
        reason = shape.pop("reason", "")
        described = ", ".join(f"{key}={value}" for key, value in shape.items())
        warn_once_on_rank0(_log, f"megatron_hsap: {self._label} has no fused attention backend for {described} "
                                 f"({self._device}{reason}); such calls use the {self._fallback_kernel.name!r} kernel",
                           key=("te-fallback",) + tuple(v for k, v in shape.items() if not k.startswith("max_")))
        return self._fallback_kernel

    @classmethod
    def check_inputs(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: AttentionBlocks) -> None:
        super().check_inputs(q, k, v, blocks)
        if q.device.type != "cuda":
            raise ValueError(f"the 'te' kernel needs CUDA tensors, got q on {q.device}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: AttentionBlocks,
                softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
        """As ``VarlenPassKernel.forward``; delegated whole to the fallback kernel when a pass is unsupported."""
        self.check_inputs(q, k, v, blocks)
        unsupported = self._unsupported_pass(q, k, blocks)
        if unsupported is not None:
            return self._fallback(unsupported).forward(q, k, v, blocks, softmax_scale)
        return super().forward(q, k, v, blocks, softmax_scale)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, blocks: AttentionBlocks,
                 softmax_scale: float, grad_dtype: Optional[torch.dtype] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As ``VarlenPassKernel.backward``; the same delegation decision as the forward of these blocks."""
        self.check_inputs(q, k, v, blocks)
        unsupported = self._unsupported_pass(q, k, blocks)
        if unsupported is not None:
            return self._fallback(unsupported).backward(dout, q, k, v, out, lse, blocks, softmax_scale, grad_dtype)
        return super().backward(dout, q, k, v, out, lse, blocks, softmax_scale, grad_dtype)

    def _common_values(self, p: VarlenPass, q: torch.Tensor, softmax_scale: float) -> dict:
        """Arguments shared by fused_attn_fwd/bwd; the caller keeps those the installed function takes."""
        cu_q, cu_k = p.device_cu_seqlens(q.device)
        return dict(max_seqlen_q=p.max_seqlen_q, max_seqlen_kv=p.max_seqlen_k, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k,
                    cu_seqlens_q_padded=cu_q, cu_seqlens_kv_padded=cu_k, fake_dtype=q.dtype,
                    fused_attention_backend=self._backend, attn_scale=softmax_scale, dropout=0.0,
                    qkv_layout="thd_thd_thd", o_format="thd", attn_bias_type="no_bias", attn_mask_type=mask_type(p))

    def _pass_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: VarlenPass,
                      softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
        values = dict(self._common_values(p, q, softmax_scale), is_training=True, q=q, k=k, v=v)
        out, aux = self._fused_attn.fused_attn_fwd(**{n: values[n] for n in self._fwd_keywords})[:2]
        self._ragged_stats = aux[0].dim() == 3
        return out, stats_to_lse(aux[0], p)

    def _pass_backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, p: VarlenPass,
                       softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)  # unused without dropout
        values = dict(self._common_values(p, q, softmax_scale), q=q, k=k, v=v, o=out, d_o=dout,
                      aux_ctx_tensors=[lse_to_stats(lse, p, self._ragged_stats), rng_state],
                      dqkv_dtype=self._te_dtype[q.dtype], do_format="thd", dqkv_layout="thd_thd_thd")
        grads = self._fused_attn.fused_attn_bwd(**{n: values[n] for n in self._bwd_keywords})
        return grads[0], grads[1], grads[2]
