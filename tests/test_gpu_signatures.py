"""The flash/TE kernels against fake libraries that carry each supported release's real signatures.

The fakes (``FakeTE(...).install`` / ``install_fake_flash``) take their function signatures from
``tests/library_signatures.py``, transcribed from the libraries' public source per release: a call
the installed release would reject (unknown keyword, missing argument, wrong arity of TE's
positional backend query) is a TypeError here too, and arguments whose meaning changed between
releases are checked (TE >= 2.15 must get ``o_format="thd"``, TE < 2.15 ``dqkv_dtype``). TE's
backend query follows TE's own rules for the fused THD path (sm90+, cuDNN >= 9.1, GQA from 9.6,
bottom-right causal from 9.6 with lengths a multiple of 64 or from 9.7, not 9.10.0/9.10.1), and
the fake refuses to compute what it would not support. The numbers come from the torch kernel on
each packed pass and are checked against the dense fp64 reference of test_gpu_kernels.py.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import logging
import sys
import types
from typing import Callable, Dict, Tuple

import pytest
import torch

from megatron_hsap.kernels import get_kernel, gpu_common
from megatron_hsap.kernels.base import AttentionBlocks
from megatron_hsap.kernels.flash_kernel import FlashAttentionKernel
from megatron_hsap.kernels.gpu_common import VarlenPassKernel, split_into_passes
from megatron_hsap.kernels.te_kernel import PARAMS_MODULE, TEAttentionKernel
from megatron_hsap.kernels.torch_kernel import TorchAttentionKernel
from tests.library_signatures import FLASH_RELEASES, TE_RELEASES
from tests.test_gpu_kernels import dense_attention, dense_grads, dense_mask

TORCH = TorchAttentionKernel()
TE_NAMES = ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.constants",
            "transformer_engine.pytorch.cpp_extensions", "transformer_engine.pytorch.cpp_extensions.fused_attn",
            "transformer_engine.pytorch.utils"]


# ---------------------------------------------------------------- functions with a transcribed signature

def parse_signature(text: str) -> inspect.Signature:
    """``"(a, b=1, *, c=None)"`` -> an ``inspect.Signature`` (defaults are literals in every transcription)."""
    args = ast.parse(f"def f{text}: pass").body[0].args
    positional = args.posonlyargs + args.args
    defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) + \
        [ast.literal_eval(d) for d in args.defaults]
    params = [inspect.Parameter(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d)
              for a, d in zip(positional, defaults)]
    params += [inspect.Parameter(a.arg, inspect.Parameter.KEYWORD_ONLY,
                                 default=inspect.Parameter.empty if d is None else ast.literal_eval(d))
               for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return inspect.Signature(params)


def with_signature(name: str, text: str, body: Callable[..., object]) -> Callable:
    """A function whose signature is ``text``: calls are bound to it (TypeError like the real one on a
    mismatch) and ``body`` gets every argument by name, defaults filled in."""
    signature = parse_signature(text)

    def fn(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return body(**bound.arguments)
    fn.__signature__, fn.__name__ = signature, name
    return fn


class FakeCustomOp:
    """What ``torch.library.custom_op`` leaves in the module (flash-attn >= 2.7): a callable whose own
    signature is ``(*args, **kwargs)``, the Python function kept in ``_init_fn``."""

    def __init__(self, fn: Callable) -> None:
        self._init_fn = fn

    def __call__(self, *args, **kwargs):
        return self._init_fn(*args, **kwargs)


def _seq_blocks(cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool, window=(-1, -1)) -> AttentionBlocks:
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return AttentionBlocks.from_list([(cq[i], cq[i + 1], ck[i], ck[i + 1], causal, tuple(window))
                                      for i in range(len(cq) - 1)])


# ---------------------------------------------------------------- fake TransformerEngine

def te_backend_supported(capability: Tuple[int, int], cudnn: Tuple[int, int, int], h: int, g: int, d: int,
                         mask: str, sq: int, skv: int) -> bool:
    """TE's rules (common/fused_attn/fused_attn.cpp) for F16 arbitrary-seqlen, THD, no bias, no dropout."""
    if capability < (9, 0) or cudnn < (9, 1, 0) or cudnn in ((9, 10, 0), (9, 10, 1)):
        return False
    if h != g and cudnn < (9, 6, 0):
        return False
    if d % 8 or d > 128:
        return False
    if mask == "padding_causal_bottom_right":
        return sq <= skv and (cudnn >= (9, 7, 0) or (cudnn >= (9, 6, 0) and sq % 64 == 0 and skv % 64 == 0))
    return mask in ("padding", "padding_causal")


def _thd_written_as_sbhd(out: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """``out`` ([t, h, d], sequences back to back) stored as TE stores an sbhd output ([max_seqlen, sequences, h,
    d], sequence-major) in a buffer read back as [t, h, d]: what a thd caller gets from TE >= 2.15 without
    o_format='thd'."""
    sbhd = out.new_zeros(max_seqlen, len(cu_seqlens) - 1, *out.shape[1:])
    for i, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        sbhd[:end - start, i] = out[start:end]
    return sbhd.reshape(-1, *out.shape[1:])[:out.shape[0]].contiguous()


class FakeTE:
    """The fake TE of one release on one (capability, cuDNN); counts its fused calls."""

    def __init__(self, release: str, capability: Tuple[int, int], cudnn: Tuple[int, int, int]) -> None:
        self.spec, self.capability, self.cudnn = TE_RELEASES[release], capability, cudnn
        self.release = release
        self.calls = {"fwd": 0, "bwd": 0, "query": 0}
        self.ragged = cudnn >= (9, 6, 0) and capability != (12, 0)

    def query(self, *args):
        names = self.spec["get_fused_attn_backend"].split()
        if len(args) != len(names):  # pybind11: "incompatible function arguments"
            raise TypeError(f"get_fused_attn_backend() takes {len(names)} positional arguments, got {len(args)}")
        if names == ["params"]:  # 2.20: one FusedAttentionParams, answered with (backend, message)
            return self._query_params(args[0])
        a = dict(zip(names, args))
        self.calls["query"] += 1
        assert a["q_dtype"] == a["kv_dtype"] and a["qkv_layout"] == "thd_thd_thd" and a["bias_type"] == "no_bias"
        assert a["p_dropout"] == 0.0 and (a["window_size_left"], a["window_size_right"]) == (-1, -1)
        assert a.get("softmax_type", "vanilla") == "vanilla" and a.get("is_training", True) is True
        ok = te_backend_supported(self.capability, self.cudnn, a["num_attn_heads"], a["num_gqa_groups"],
                                  a["head_dim_qk"], a["attn_mask_type"], a["max_seqlen_q"], a["max_seqlen_kv"])
        return "arbitrary" if ok else "none"

    def _query_params(self, p) -> tuple:
        """TE 2.20's query: every field read by name (TE's C++ side), the THD layout in and out."""
        a = {name: getattr(p, name) for name in self.spec["fused_attention_params"].split()}
        self.calls["query"] += 1
        assert a["qkv_layout"] == a["dqkv_layout"] == "thd_thd_thd" and a["o_format"] == a["do_format"] == "thd"
        assert a["qkv_dtype"] == a["o_dtype"] == a["do_dtype"] == a["dqkv_dtype"] and a["bias_type"] == "no_bias"
        assert a["dropout"] == 0.0 and (a["window_size_left"], a["window_size_right"]) == (-1, -1)
        assert a["softmax_type"] == "vanilla" and a["is_training"] is True
        assert a["bottom_right_diagonal"] == (a["attn_mask_type"] == "padding_causal_bottom_right")
        ok = te_backend_supported(self.capability, self.cudnn, a["num_attn_heads"], a["num_gqa_groups"],
                                  a["head_dim_qk"], a["attn_mask_type"], a["max_seqlen_q"], a["max_seqlen_kv"])
        return ("arbitrary", "") if ok else ("none", "cuDNN rejects this configuration")

    def _blocks(self, a: dict) -> AttentionBlocks:
        """Check the arguments every call shares; the pass's blocks in base.py's (bottom-right) convention."""
        q = a["q"]
        assert a["qkv_layout"] == "thd_thd_thd" and a["fused_attention_backend"] == "arbitrary"
        assert a["fake_dtype"] == q.dtype and a["dropout"] == 0.0 and a["attn_bias_type"] == "no_bias"
        assert torch.equal(a["cu_seqlens_q"], a["cu_seqlens_q_padded"])
        assert torch.equal(a["cu_seqlens_kv"], a["cu_seqlens_kv_padded"])
        lengths_q = (a["cu_seqlens_q"][1:] - a["cu_seqlens_q"][:-1]).tolist()
        lengths_k = (a["cu_seqlens_kv"][1:] - a["cu_seqlens_kv"][:-1]).tolist()
        mask = a["attn_mask_type"]
        if mask == "padding_causal":  # top-left: base.py's bottom-right only where the sequences are square
            assert lengths_q == lengths_k
        if not te_backend_supported(self.capability, self.cudnn, q.shape[1], a["k"].shape[1], q.shape[2], mask,
                                    a["max_seqlen_q"], a["max_seqlen_kv"]):
            raise RuntimeError("cuDNN: no execution plan for this configuration")  # what asking first prevents
        return _seq_blocks(a["cu_seqlens_q"], a["cu_seqlens_kv"], mask != "padding")

    def fwd(self, **a):
        self.calls["fwd"] += 1
        assert a["is_training"]
        blocks = self._blocks(a)
        q = a["q"]
        out, lse = TORCH.forward(q, a["k"], a["v"], blocks, a["attn_scale"])
        # From 2.15 O is written in its own format, o_format (default 'sbhd'); before, in qkv_layout's.
        if a.get("o_format", "sbhd" if "o_format=" in self.spec["fused_attn_fwd"] else "thd") == "sbhd":
            out = _thd_written_as_sbhd(out, a["cu_seqlens_q"], a["max_seqlen_q"])
        if self.ragged:
            stats = lse.t().unsqueeze(-1).contiguous()
        else:
            stats = torch.full((len(blocks), q.shape[1], a["max_seqlen_q"], 1), 123.0)  # padding slots: garbage
            for i, (qs, qe, _, _, _) in enumerate(blocks):
                stats[i, :, :qe - qs, 0] = lse[:, qs:qe]
        return out, [stats, torch.zeros(2, dtype=torch.int64)]

    def bwd(self, **a):
        self.calls["bwd"] += 1
        q = a["q"]
        if "dqkv_dtype" in a:  # up to 2.14
            assert a["dqkv_dtype"] == f"te:{q.dtype}"
        if "dqkv_layout" in a:  # from 2.15
            assert a["o_format"] == "thd", f"TE {self.release}: o_format={a['o_format']!r}"
            assert (a["do_format"], a["dqkv_layout"]) == ("thd", "thd_thd_thd"), (a["do_format"], a["dqkv_layout"])
        blocks = self._blocks(a)
        stats, rng_state = a["aux_ctx_tensors"]
        assert rng_state.shape == (2,)
        if self.ragged:
            assert stats.shape == (q.shape[0], q.shape[1], 1)
            lse = stats[..., 0].t()
        else:
            assert stats.shape == (len(blocks), q.shape[1], a["max_seqlen_q"], 1)
            lse = torch.cat([stats[i, :, :qe - qs, 0] for i, (qs, qe, _, _, _) in enumerate(blocks)], dim=1)
        grads = TORCH.backward(a["d_o"], q, a["k"], a["v"], a["o"], lse, blocks, a["attn_scale"])
        return [g.to(q.dtype) for g in grads] + [None, None]

    def install(self, monkeypatch) -> None:
        te, pt, constants, ext, fused, utils = (types.ModuleType(n) for n in TE_NAMES)
        te.__version__, te.pytorch = self.release + ".0", pt
        pt.constants, pt.cpp_extensions, pt.utils, ext.fused_attn = constants, ext, utils, fused
        constants.TE_DType = {dtype: f"te:{dtype}" for dtype in (torch.float16, torch.bfloat16, torch.float32)}
        utils.get_cudnn_version = lambda: self.cudnn
        utils.get_device_compute_capability = lambda: self.capability
        identity = ["thd_thd_thd", "no_bias", "padding", "padding_causal", "padding_causal_bottom_right", "vanilla"]
        fused.QKVLayout = fused.AttnBiasType = fused.AttnMaskType = {name: name for name in identity}
        if self.spec["softmax_type"]:
            fused.SoftmaxType = {"vanilla": "vanilla"}
        fused.FusedAttnBackend = {"F16_arbitrary_seqlen": "arbitrary", "No_Backend": "none"}
        fused.QKVFormat = {"thd": "thd"}
        if "fused_attention_params" in self.spec:  # 2.20: the query's argument, a dataclass of defaulted fields
            names = self.spec["fused_attention_params"].split()
            params_module = types.ModuleType(PARAMS_MODULE)
            params_module.FusedAttentionParams = dataclasses.make_dataclass(
                "FusedAttentionParams", [(name, object, dataclasses.field(default=None)) for name in names])
            monkeypatch.setitem(sys.modules, PARAMS_MODULE, params_module)
        fused.tex = types.ModuleType("transformer_engine_torch")

        def get_fused_attn_backend(*args):
            return self.query(*args)
        if list(TE_RELEASES).index(self.release) % 2:  # pybind11's docstring, where the kernel may read the arity
            arity = len(self.spec["get_fused_attn_backend"].split())
            get_fused_attn_backend.__doc__ = ("get_fused_attn_backend(" + ", ".join(f"arg{i}: object" for i in
                                              range(arity)) + ") -> object\n\nGet Fused Attention backend\n")
        else:
            get_fused_attn_backend.__doc__ = None
        fused.tex.get_fused_attn_backend = get_fused_attn_backend
        fused.fused_attn_fwd = with_signature("fused_attn_fwd", self.spec["fused_attn_fwd"], self.fwd)
        fused.fused_attn_bwd = with_signature("fused_attn_bwd", self.spec["fused_attn_bwd"], self.bwd)
        for name, module in zip(TE_NAMES, (te, pt, constants, ext, fused, utils)):
            monkeypatch.setitem(sys.modules, name, module)


# ---------------------------------------------------------------- fake flash-attn

def install_fake_flash(monkeypatch, release: str) -> Dict[str, int]:
    spec, calls = FLASH_RELEASES[release], {"fwd": 0, "bwd": 0}

    def varlen_func(**a):
        calls["fwd"] += 1
        assert a["return_attn_probs"] and a["dropout_p"] == 0.0 and not torch.is_grad_enabled()
        assert a["softcap"] == 0.0 and a["alibi_slopes"] is None
        blocks = _seq_blocks(a["cu_seqlens_q"], a["cu_seqlens_k"], a["causal"], a["window_size"])
        out, lse = TORCH.forward(a["q"], a["k"], a["v"], blocks, a["softmax_scale"])
        return out, lse.masked_fill(torch.isneginf(lse), float("inf")), None  # flash marks empty rows +inf

    def varlen_backward(**a):
        calls["bwd"] += 1
        window = a["window_size"] if "window_size" in a else (a["window_size_left"], a["window_size_right"])  # 2.6.x
        assert a["dropout_p"] == 0.0 and a["softcap"] == 0.0 and a["alibi_slopes"] is None
        q, lse = a["q"], a["softmax_lse"]
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous()
        blocks = _seq_blocks(a["cu_seqlens_q"], a["cu_seqlens_k"], a["causal"], window)
        grads = TORCH.backward(a["dout"], q, a["k"], a["v"], a["out"], lse, blocks, a["softmax_scale"])
        for buf, g in zip((a["dq"], a["dk"], a["dv"]), grads):
            buf.copy_(g)
        softmax_d = torch.zeros(q.shape[1], q.shape[0])
        return softmax_d if spec["custom_op"] else (a["dq"], a["dk"], a["dv"], softmax_d)

    flash, iface = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.flash_attn_interface")
    flash.__version__, flash.flash_attn_interface = release, iface
    iface.flash_attn_varlen_func = with_signature("flash_attn_varlen_func", spec["flash_attn_varlen_func"],
                                                  varlen_func)
    backward = with_signature("_flash_attn_varlen_backward", spec["_flash_attn_varlen_backward"], varlen_backward)
    iface._flash_attn_varlen_backward = FakeCustomOp(backward) if spec["custom_op"] else backward
    monkeypatch.setitem(sys.modules, "flash_attn", flash)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
    return calls


# ---------------------------------------------------------------- end to end per release

T, H_Q, H_KV, D, SCALE = 40, 4, 2, 16, 0.25
# two passes: rows 12..30 see two key ranges; 30..40 a non-square causal block (bottom-right mask)
BLOCKS = AttentionBlocks.from_list([(0, 12, 0, 12, True), (12, 30, 12, 30, True), (12, 30, 30, 40, False),
                                    (30, 40, 0, 5, False), (35, 38, 20, 24, True)])


WINDOWED_BLOCKS = AttentionBlocks.from_list([(0, 30, 0, 30, True, (6, -1)), (30, 40, 0, 40, False, (9, 3))])


def _inputs(dtype=torch.float16):
    gen = torch.Generator().manual_seed(9)
    return [torch.randn(T, h, D, generator=gen).to(dtype) for h in (H_Q, H_KV, H_KV, H_Q)]


def check_against_dense(kernel, blocks: AttentionBlocks = BLOCKS) -> None:
    """Forward and backward of ``kernel`` on fp16 inputs against the dense fp64 reference."""
    q, k, v, dout = _inputs()
    out, lse = kernel.forward(q, k, v, blocks, SCALE)
    q64, k64, v64, dout64 = (x.double() for x in (q, k, v, dout))
    mask = dense_mask(blocks, T, T)
    ref_out, ref_lse = dense_attention(q64, k64, v64, mask, SCALE)
    # fp16 inputs: each pass output is rounded to fp16 once (~5e-4 relative) before the fp32 merge
    torch.testing.assert_close(out.double(), ref_out, atol=3e-3, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=0)
    grads = kernel.backward(dout, q, k, v, out, lse, blocks, SCALE)
    for got, ref in zip(grads, dense_grads(q64, k64, v64, mask, SCALE, dout64)):
        assert got.dtype == torch.float32
        # fp16 grads per pass, |grad| ~ 1: measured max |error| 1.6e-3 over the releases and block sets
        torch.testing.assert_close(got.double(), ref, atol=5e-3, rtol=0)


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees its own once-per-process warnings."""
    monkeypatch.setattr(gpu_common, "_ANNOUNCED", set())


@pytest.fixture
def cpu_as_cuda(monkeypatch):
    """Let the kernels run on CPU tensors: everything but their CUDA device check."""
    for cls in (FlashAttentionKernel, TEAttentionKernel):
        monkeypatch.setattr(cls, "check_inputs", classmethod(VarlenPassKernel.check_inputs.__func__))


@pytest.mark.parametrize("release", list(TE_RELEASES))
def test_te_kernel_on_each_release(monkeypatch, cpu_as_cuda, release):
    # alternate ragged ([t, h, 1], cuDNN >= 9.6) and padded ([b, h, s, 1], sm120) softmax stats
    ragged = list(TE_RELEASES).index(release) % 2 == 0
    fake = FakeTE(release, (9, 0) if ragged else (12, 0), (9, 8, 0))
    fake.install(monkeypatch)
    assert len(split_into_passes(BLOCKS)) == 2
    kernel = TEAttentionKernel()
    check_against_dense(kernel)
    assert fake.calls["fwd"] == 2 and fake.calls["bwd"] == 2
    # sliding windows are not sent to TE (alignment unverified on GPUs): delegated, forward and backward
    check_against_dense(kernel, WINDOWED_BLOCKS)
    assert fake.calls["fwd"] == 2 and fake.calls["bwd"] == 2 and kernel.fallback_calls == 2


@pytest.mark.parametrize("release", list(FLASH_RELEASES))
def test_flash_kernel_on_each_release(monkeypatch, cpu_as_cuda, release):
    calls = install_fake_flash(monkeypatch, release)
    check_against_dense(FlashAttentionKernel())
    assert calls == {"fwd": 2, "bwd": 2}
    # sliding windows reach the library in the forward and in each release's backward keywords (the fake
    # computes what it is told, so a dropped window shows as a mismatch with the dense reference)
    check_against_dense(FlashAttentionKernel(), WINDOWED_BLOCKS)
    assert calls == {"fwd": 4, "bwd": 4}


def _with_extra_parameter(text: str, extra: str) -> str:
    return text[:-1] + ", " + extra + ")"


@pytest.mark.parametrize("library", ["te", "flash"])
def test_a_release_with_an_unreviewed_parameter_is_refused(monkeypatch, library):
    """A future release adding a parameter (even with a default, as TE 2.15's o_format) is named, not run."""
    if library == "te":
        release = list(TE_RELEASES)[-1]
        spec = dict(TE_RELEASES[release])
        spec["fused_attn_bwd"] = _with_extra_parameter(spec["fused_attn_bwd"], "dq_format='sbhd'")
        monkeypatch.setitem(TE_RELEASES, release, spec)
        FakeTE(release, (9, 0), (9, 8, 0)).install(monkeypatch)
        with pytest.raises(RuntimeError, match=r"fused_attn_bwd: parameters \['dq_format'\].*transformer-engine"):
            TEAttentionKernel()
    else:
        release = list(FLASH_RELEASES)[-1]
        spec = dict(FLASH_RELEASES[release])
        spec["_flash_attn_varlen_backward"] = _with_extra_parameter(spec["_flash_attn_varlen_backward"],
                                                                    "num_splits=0")
        monkeypatch.setitem(FLASH_RELEASES, release, spec)
        install_fake_flash(monkeypatch, release)
        with pytest.raises(RuntimeError, match=r"\['num_splits'\].*flash-attn>=2.6.0,<3"):
            FlashAttentionKernel()


def test_te_2_15_needs_the_thd_output_format(monkeypatch, cpu_as_cuda):
    """From 2.15 TE writes O in ``o_format`` (default 'sbhd', the fake writes it as TE does): the kernel's output
    equals the dense reference because it asks for 'thd'; without it the same call returns scrambled rows."""
    FakeTE("2.15", (9, 0), (9, 8, 0)).install(monkeypatch)
    kernel = TEAttentionKernel()
    q, k, v, _ = _inputs()
    ref, _ = dense_attention(q.double(), k.double(), v.double(), dense_mask(BLOCKS, T, T), SCALE)
    out, _ = kernel.forward(q, k, v, BLOCKS, SCALE)
    torch.testing.assert_close(out.double(), ref, atol=3e-3, rtol=0)
    monkeypatch.setattr(kernel, "_fwd_keywords", kernel._fwd_keywords - {"o_format"})
    scrambled, _ = kernel.forward(q, k, v, BLOCKS, SCALE)
    assert (scrambled.double() - ref).abs().max() > 0.1


def test_the_newest_verified_releases_are_the_newest_transcribed():
    from megatron_hsap.kernels import flash_kernel, te_kernel
    newest = lambda releases: max(tuple(int(x) for x in r.split(".")) for r in releases)  # noqa: E731
    assert te_kernel.NEWEST_VERIFIED == newest(TE_RELEASES)
    assert flash_kernel.NEWEST_VERIFIED == newest(FLASH_RELEASES)


def test_unsupported_library_versions_are_clear_errors(monkeypatch):
    install_fake_flash(monkeypatch, "2.8.3")
    monkeypatch.setattr(sys.modules["flash_attn"], "__version__", "2.5.9")
    with pytest.raises(RuntimeError, match=r"flash-attn>=2.6.0,<3"):
        FlashAttentionKernel()
    FakeTE("2.0", (9, 0), (9, 8, 0)).install(monkeypatch)
    monkeypatch.setattr(sys.modules["transformer_engine"], "__version__", "1.13.0")
    with pytest.raises(RuntimeError, match=r"transformer-engine\[pytorch\]>=2.0"):
        TEAttentionKernel()


# ---------------------------------------------------------------- TE's backend support, asked first

@pytest.mark.parametrize("capability,cudnn,reason", [((8, 0), (9, 8, 0), "sm80"), ((9, 0), (9, 10, 1), "9.10.1"),
                                                     ((9, 0), (9, 0, 0), "cuDNN 9.0.0")])
def test_te_refuses_a_device_without_fused_thd_and_auto_falls_back(monkeypatch, caplog, capability, cudnn, reason):
    FakeTE("2.12", capability, cudnn).install(monkeypatch)
    with pytest.raises(RuntimeError, match=f"no fused THD attention backend on this device.*{reason}"):
        TEAttentionKernel()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # TE counts as installed with CUDA
    caplog.set_level(logging.WARNING, logger="megatron_hsap.kernels")
    kernel = get_kernel.__wrapped__("auto")  # uncached; flash-attn is not installed here
    assert kernel.name == "torch"
    assert any("'auto' selected 'torch', not 'te'" in r.message and reason in r.message for r in caplog.records)


@pytest.mark.parametrize("cudnn,h_kv,t_case,delegated", [
    ((9, 5, 0), 2, "square", True),       # GQA + THD needs cuDNN 9.6
    ((9, 5, 0), 4, "square", False),      # MHA, square causal blocks: top-left mask, fine on 9.5
    ((9, 6, 0), 4, "ragged", True),       # bottom-right causal, lengths not multiples of 64: needs 9.7
    ((9, 7, 0), 2, "ragged", False),
])
def test_te_delegates_unsupported_shapes_to_the_fallback(monkeypatch, caplog, cpu_as_cuda, cudnn, h_kv, t_case,
                                                         delegated):
    fake = FakeTE("2.15", (9, 0), cudnn)
    fake.install(monkeypatch)
    kernel = TEAttentionKernel()
    gen = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(T, 4, D, generator=gen).half() for _ in range(2))
    k, v = (torch.randn(T, h_kv, D, generator=gen).half() for _ in range(2))
    # square: a packed batch's diagonal blocks; ragged: a causal block with more keys than queries
    blocks = AttentionBlocks.from_list([(0, 12, 0, 12, True), (12, 40, 12, 40, True)] if t_case == "square"
                                       else [(0, 12, 0, 12, True), (20, 40, 10, 40, True)])
    caplog.set_level(logging.WARNING, logger="megatron_hsap.kernels.te_kernel")
    out, lse = kernel.forward(q, k, v, blocks, SCALE)
    grads = kernel.backward(dout, q, k, v, out, lse, blocks, SCALE)
    assert (fake.calls["fwd"] == 0 and fake.calls["bwd"] == 0) is delegated
    ref_out, ref_lse = TORCH.forward(q, k, v, blocks, SCALE)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-3, rtol=0)
    for got, ref in zip(grads, TORCH.backward(dout, q, k, v, ref_out, ref_lse, blocks, SCALE)):
        torch.testing.assert_close(got, ref, atol=4e-3, rtol=0)  # fp16 fused vs per-pass: measured 9.7e-4
    # another batch of the same kind with other lengths: the same decision, no second message
    other = AttentionBlocks.from_list([(0, 20, 0, 20, True), (20, 40, 20, 40, True)] if t_case == "square"
                                      else [(0, 10, 0, 10, True), (25, 40, 5, 40, True)])
    fwd_calls = fake.calls["fwd"]
    kernel.forward(q, k, v, other, SCALE)
    assert (fake.calls["fwd"] == fwd_calls) is delegated
    assert kernel.fallback_calls == (3 if delegated else 0)  # two forwards, one backward
    messages = [r.message for r in caplog.records if "no fused attention backend" in r.message]
    assert len(messages) == (1 if delegated else 0)  # once, though forward and backward of two batches delegated
    if delegated:
        assert "use the 'torch' kernel" in messages[0]


def test_te_2_20_query_answers_with_a_reason_that_the_fallback_note_quotes(monkeypatch, caplog, cpu_as_cuda):
    """TE 2.20's query takes one FusedAttentionParams and returns (backend, message): GQA on cuDNN 9.5 is
    refused with TE's reason, which the one fallback warning quotes; MHA runs on TE."""
    fake = FakeTE("2.20", (9, 0), (9, 5, 0))
    fake.install(monkeypatch)
    kernel = TEAttentionKernel()
    caplog.set_level(logging.WARNING, logger="megatron_hsap.kernels.te_kernel")
    blocks = AttentionBlocks.from_list([(0, 12, 0, 12, True), (12, 40, 12, 40, True)])
    gen = torch.Generator().manual_seed(4)
    for h_kv, on_te in ((4, True), (2, False)):
        q, k, v = (torch.randn(T, h, D, generator=gen).half() for h in (4, h_kv, h_kv))
        before = fake.calls["fwd"]
        out, _ = kernel.forward(q, k, v, blocks, SCALE)
        assert (fake.calls["fwd"] == before + 1) is on_te
        ref, _ = TORCH.forward(q, k, v, blocks, SCALE)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=0)
    (message,) = [r.message for r in caplog.records if "no fused attention backend" in r.message]
    assert "cuDNN rejects this configuration" in message and "h_kv=2" in message
