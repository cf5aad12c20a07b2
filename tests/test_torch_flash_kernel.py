"""The 'torch_flash' kernel (PyTorch's fused varlen flash attention) against stand-ins with each release's
signatures, and ``kernel="auto"``'s per-call choice.

The stand-ins take their signatures from ``tests/library_signatures.py`` (``TORCH_RELEASES``): the public
``varlen_attn`` as a Python function, the aten operators as ``torch._C.parse_schema`` schemas (what
``signature_parameters`` reads from a real operator). A call the release would reject is a TypeError here
too; the numbers come from the torch kernel on each packed pass, checked against the dense fp64 reference,
forward, backward, and backward with a merged out/LSE (ring attention).
"""

from __future__ import annotations

import inspect
import logging
import types
from typing import Callable, NamedTuple

import pytest
import torch

from megatron_hsap.kernels import AutoKernel, get_kernel, gpu_common
from megatron_hsap.kernels.base import AttentionBlocks
from megatron_hsap.kernels.gpu_common import VarlenPassKernel, merge_partial, signature_parameters
from megatron_hsap.kernels.torch_flash_kernel import TorchFlashAttentionKernel
from megatron_hsap.kernels.torch_kernel import TorchAttentionKernel
from tests.library_signatures import TORCH_RELEASES
from tests.test_gpu_kernels import dense_attention, dense_grads, dense_mask
from tests.test_gpu_signatures import (SCALE, WINDOWED_BLOCKS, FakeTE, _inputs, _seq_blocks,
                                       check_against_dense, with_signature)

TORCH = TorchAttentionKernel()


class FakeOperator:
    """A ``torch.ops`` operator stand-in: ``.default._schema`` is the transcribed schema; calls bind to it."""

    def __init__(self, schema: str, body: Callable) -> None:
        self.default = types.SimpleNamespace(_schema=torch._C.parse_schema("aten::" + schema))
        params = list(signature_parameters(self).values())
        self._signature = inspect.Signature(params)
        self._body = body

    def __call__(self, *args, **kwargs):
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return self._body(**bound.arguments)


class AuxRequest(NamedTuple):
    lse: bool = False


class FakeTorch:
    """``torch.nn.attention.varlen`` and ``torch.ops.aten`` of one release; counts the calls of each."""

    def __init__(self, release: str) -> None:
        spec = TORCH_RELEASES[release]
        self.calls = {"public": 0, "fwd": 0, "bwd": 0}
        self.varlen = types.SimpleNamespace(AuxRequest=AuxRequest)
        if spec["varlen_attn"] is not None:
            self.varlen.varlen_attn = with_signature("varlen_attn", spec["varlen_attn"], self._public)
        self.aten = types.SimpleNamespace(_flash_attention_forward=FakeOperator(spec["aten_fwd"], self._fwd),
                                          _flash_attention_backward=FakeOperator(spec["aten_bwd"], self._bwd))

    def _public(self, **a):
        self.calls["public"] += 1
        assert not torch.is_grad_enabled() and a["enable_gqa"] is True and a["return_aux"].lse
        assert isinstance(a["window_size"], tuple)  # the release compares it with (-1, 0)
        # PyTorch passes the window to flash-attn, which bounds key - query by (-left, right) bottom-right
        blocks = _seq_blocks(a["cu_seq_q"], a["cu_seq_k"], False, a["window_size"])
        out, lse = TORCH.forward(a["query"], a["key"], a["value"], blocks, a["scale"])
        return out, lse.masked_fill(torch.isneginf(lse), float("inf"))

    def _blocks(self, a: dict) -> AttentionBlocks:
        assert a["dropout_p"] == 0.0
        return _seq_blocks(a["cum_seq_q"], a["cum_seq_k"], a["is_causal"],
                           (a["window_size_left"], a["window_size_right"]))

    def _fwd(self, **a):
        self.calls["fwd"] += 1
        assert not torch.is_grad_enabled() and not a["return_debug_mask"]
        out, lse = TORCH.forward(a["query"], a["key"], a["value"], self._blocks(a), a["scale"])
        return out, lse, torch.zeros(2, dtype=torch.int64), torch.empty(0), torch.empty(0)

    def _bwd(self, **a):
        self.calls["bwd"] += 1
        q, lse = a["query"], a["logsumexp"]
        assert lse.shape == (q.shape[1], q.shape[0]) and a["rng_state"].shape == (2,)
        grads = TORCH.backward(a["grad_out"], q, a["key"], a["value"], a["out"], lse, self._blocks(a), a["scale"])
        return tuple(g.to(q.dtype) for g in grads)

    def kernel(self) -> TorchFlashAttentionKernel:
        return TorchFlashAttentionKernel(varlen=self.varlen, aten=self.aten)


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(gpu_common, "_ANNOUNCED", set())


@pytest.fixture
def cpu_as_cuda(monkeypatch):
    """Let the kernel run on CPU tensors: everything but its CUDA device check."""
    monkeypatch.setattr(TorchFlashAttentionKernel, "check_inputs",
                        classmethod(VarlenPassKernel.check_inputs.__func__))


@pytest.mark.parametrize("release", list(TORCH_RELEASES))
def test_torch_flash_on_each_release(cpu_as_cuda, release):
    fake = FakeTorch(release)
    kernel = fake.kernel()
    public = tuple(map(int, release.split("."))) >= (2, 12)  # enable_gqa (with scale and window_size) arrived in 2.12
    assert kernel.uses_public_api is public
    check_against_dense(kernel)  # two passes (rows shared by two blocks, merged in fp32), GQA
    check_against_dense(kernel, WINDOWED_BLOCKS)  # windows reach the forward and the backward
    assert fake.calls == {"public": 4 if public else 0, "fwd": 0 if public else 4, "bwd": 4}


@pytest.mark.parametrize("release", ["2.9", "2.13"])
def test_torch_flash_backward_with_the_rings_merged_output_and_lse(cpu_as_cuda, release):
    """Two calls over disjoint keys merged with the LSE; each call's backward gets the *merged* out/lse (as
    ring attention does) and the summed gradients equal the dense reference."""
    kernel = FakeTorch(release).kernel()
    q, k, v, dout = _inputs()
    t = q.shape[0]
    step_a = AttentionBlocks.from_list([(0, 20, 0, 20, True), (20, 40, 0, 20, False)])
    step_b = AttentionBlocks.from_list([(20, 40, 20, 40, True)])
    out_a, lse_a = kernel.forward(q, k, v, step_a, SCALE)
    out_b, lse_b = kernel.forward(q, k, v, step_b, SCALE)
    out, lse = merge_partial(out_a, lse_a, out_b, lse_b)
    full = AttentionBlocks.from_list([(0, 20, 0, 20, True), (20, 40, 0, 40, True)])
    mask = dense_mask(full, t, t)
    assert torch.equal(mask, dense_mask(step_a, t, t) | dense_mask(step_b, t, t))
    q64, k64, v64, dout64 = (x.double() for x in (q, k, v, dout))
    ref_out, _ = dense_attention(q64, k64, v64, mask, SCALE)
    torch.testing.assert_close(out.double(), ref_out, atol=3e-3, rtol=0)
    out = out.to(q.dtype)
    grads_a = kernel.backward(dout, q, k, v, out, lse, step_a, SCALE)
    grads_b = kernel.backward(dout, q, k, v, out, lse, step_b, SCALE)
    for ga, gb, ref in zip(grads_a, grads_b, dense_grads(q64, k64, v64, mask, SCALE, dout64)):
        torch.testing.assert_close((ga + gb).double(), ref, atol=2e-2, rtol=0)


def test_one_call_in_the_inputs_dtype_returns_the_librarys_gradients_without_fp32_copies(cpu_as_cuda):
    """``grad_dtype=q.dtype`` (what a ring of one member asks for): the same values as the float32 path, cast;
    one pass over every row returns the library's gradients as they are (no float32 dq/dk/dv is allocated)."""
    from megatron_hsap.instrumentation.memory import track_peak_memory

    kernel = FakeTorch("2.13").kernel()
    q, k, v, dout = _inputs()
    t = q.shape[0]
    packed = AttentionBlocks.from_list([(0, 24, 0, 24, True), (24, t, 24, t, True)])  # two documents: one pass
    two_passes = AttentionBlocks.from_list([(0, 20, 0, 20, True), (20, t, 0, 20, False), (20, t, 20, t, True)])
    q64, k64, v64, dout64 = (x.double() for x in (q, k, v, dout))
    for blocks in (packed, two_passes):
        out, lse = kernel.forward(q, k, v, blocks, SCALE)
        fp32 = kernel.backward(dout, q, k, v, out, lse, blocks, SCALE)
        own = kernel.backward(dout, q, k, v, out, lse, blocks, SCALE, grad_dtype=q.dtype)
        mask = dense_mask(blocks, t, t)
        for a, b, ref in zip(fp32, own, dense_grads(q64, k64, v64, mask, SCALE, dout64)):
            assert a.dtype == torch.float32 and b.dtype == q.dtype and b.shape == a.shape
            assert torch.equal(b, a.to(q.dtype))
            torch.testing.assert_close(b.double(), ref, atol=2e-2, rtol=0)
    out, lse = kernel.forward(q, k, v, packed, SCALE)
    peaks = []
    for grad_dtype in (None, q.dtype):
        with track_peak_memory("cpu") as tracker:
            kernel.backward(dout, q, k, v, out, lse, packed, SCALE, grad_dtype=grad_dtype)
        peaks.append(tracker.peak_bytes)
    fp32_grads = 4 * (q.numel() + 2 * k.numel())
    assert peaks[0] - peaks[1] >= fp32_grads, (peaks, fp32_grads)


def test_a_release_with_an_unreviewed_parameter_is_refused():
    spec = dict(TORCH_RELEASES["2.13"])
    spec["aten_bwd"] = spec["aten_bwd"].replace("SymInt? window_size_right=None)",
                                                "SymInt? window_size_right=None, bool deterministic)")
    fake = FakeTorch("2.13")
    fake.aten._flash_attention_backward = FakeOperator(spec["aten_bwd"], fake._bwd)
    with pytest.raises(RuntimeError, match=r"_flash_attention_backward: parameters \['deterministic'\].*"
                                           r"kernel='torch'"):
        fake.kernel()


def test_the_installed_torch_matches_its_transcription():
    """The local torch, where it is one of the transcribed releases (2.13 on the main stack): its real operator
    schemas and public signature build the kernel (CUDA aside) with the public function."""
    release = ".".join(torch.__version__.split(".")[:2])
    if release not in TORCH_RELEASES:
        pytest.skip(f"torch {torch.__version__} is not among the transcribed releases ({', '.join(TORCH_RELEASES)})")
    kernel = TorchFlashAttentionKernel()
    assert kernel.uses_public_api
    spec = TORCH_RELEASES[release]
    assert str(torch.ops.aten._flash_attention_forward.default._schema) == \
        str(torch._C.parse_schema("aten::" + spec["aten_fwd"]))
    import torch.nn.attention.varlen as varlen
    assert list(inspect.signature(varlen.varlen_attn).parameters) == \
        list(inspect.signature(with_signature("f", spec["varlen_attn"], None)).parameters)


def test_torch_flash_on_cpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(RuntimeError, match="'torch_flash' needs a CUDA device"):
        get_kernel("torch_flash")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        TorchFlashAttentionKernel.check_inputs(*(torch.zeros(4, 2, 64, dtype=torch.bfloat16) for _ in range(3)),
                                               AttentionBlocks.from_list([(0, 4, 0, 4, True)]))


# ---------------------------------------------------------------- kernel="auto": per call shape and dtype

def _shape(dtype, heads, head_dim):
    return [torch.zeros(8, h, head_dim, dtype=dtype) for h in heads]


def test_auto_on_cuda_without_te_or_flash_attn_picks_torch_flash(monkeypatch, caplog, cpu_as_cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(TorchFlashAttentionKernel, "is_available", classmethod(lambda cls: True))
    caplog.set_level(logging.INFO, logger="megatron_hsap.kernels")
    kernel = get_kernel.__wrapped__("auto")
    assert isinstance(kernel, AutoKernel) and [k.name for k in kernel.kernels] == ["torch_flash", "torch"]
    blocks = AttentionBlocks.from_list([(0, 8, 0, 8, True)])
    assert kernel.kernel_for(*_shape(torch.bfloat16, (8, 2, 2), 128), blocks).name == "torch_flash"
    assert kernel.kernel_for(*_shape(torch.float32, (8, 2, 2), 128), blocks).name == "torch"
    assert kernel.kernel_for(*_shape(torch.bfloat16, (8, 2, 2), 260), blocks).name == "torch"
    assert kernel.kernel_for(*_shape(torch.bfloat16, (8, 2, 2), 12), blocks).name == "torch"
    notes = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(notes) == 3 and all("'auto' uses 'torch'" in n and "'torch_flash'" in n for n in notes)
    assert "dtype torch.float32" in notes[0] and "head_dim 260" in notes[1]
    kernel.kernel_for(*_shape(torch.float32, (8, 2, 2), 128), blocks)  # decided: no second note
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 3


def test_auto_falls_back_per_call_where_te_rejects_the_input(monkeypatch, caplog, cpu_as_cuda):
    """TE installed: bf16 head_dim 64 runs on TE, head_dim 192 (TE's limit is 128) on torch_flash, fp32 on the
    reference kernel; the numbers of each call are right and its backward uses the forward's kernel."""
    from megatron_hsap.kernels.te_kernel import TEAttentionKernel

    fake_te = FakeTE("2.18", (9, 0), (9, 8, 0))
    fake_te.install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(TorchFlashAttentionKernel, "is_available", classmethod(lambda cls: True))
    monkeypatch.setattr(TEAttentionKernel, "check_inputs", classmethod(VarlenPassKernel.check_inputs.__func__))
    kernel = get_kernel.__wrapped__("auto")
    assert [k.name for k in kernel.kernels] == ["te", "torch_flash", "torch"]
    fake_torch = FakeTorch("2.13")
    kernel.kernels[1] = fake_torch.kernel()
    blocks = AttentionBlocks.from_list([(0, 12, 0, 12, True), (12, 24, 12, 24, True)])
    gen = torch.Generator().manual_seed(2)
    for dtype, d, expected in ((torch.float16, 64, "te"), (torch.float16, 192, "torch_flash"),
                               (torch.float32, 64, "torch")):
        q, k, v, dout = (torch.randn(24, h, d, generator=gen).to(dtype) for h in (4, 2, 2, 4))
        assert kernel.kernel_for(q, k, v, blocks).name == expected
        out, lse = kernel.forward(q, k, v, blocks, d ** -0.5)
        grads = kernel.backward(dout, q, k, v, out, lse, blocks, d ** -0.5)
        mask = dense_mask(blocks, 24, 24)
        ref_out, _ = dense_attention(q.double(), k.double(), v.double(), mask, d ** -0.5)
        torch.testing.assert_close(out.double(), ref_out, atol=3e-3, rtol=0)
        for got, ref in zip(grads, dense_grads(q.double(), k.double(), v.double(), mask, d ** -0.5, dout.double())):
            torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=0)
    assert fake_te.calls["fwd"] == 1 and fake_te.calls["bwd"] == 1
    assert fake_torch.calls["public"] == 1 and fake_torch.calls["bwd"] == 1
