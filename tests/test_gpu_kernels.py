"""The flash-attn / TransformerEngine kernels: pass splitting, LSE merging, availability, bad input.

On CPU the library calls are replaced by the torch kernel run on each packed pass
(``TorchPerPass``), which exercises everything the GPU kernels share: splitting
blocks into varlen passes, gathering rows, merging passes with the LSE, the
backward with the final out/lse and the scatter-add of gradients. Expected values
come from an independent dense fp64 implementation in this file. The GPU tests at
the end compare the real kernels with the torch kernel in fp32 and skip, with the
reason, where CUDA or the library is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import sys
import types
from typing import List, Tuple

import pytest
import torch

from megatron_hsap.kernels import get_kernel
from megatron_hsap.kernels.base import AttentionBlocks
from megatron_hsap.kernels.flash_kernel import FlashAttentionKernel
from megatron_hsap.kernels.gpu_common import (VarlenPass, VarlenPassKernel, merge_partial, normalized_blocks,
                                              split_into_passes)
from megatron_hsap.kernels.te_kernel import TEAttentionKernel
from megatron_hsap.kernels.torch_kernel import TorchAttentionKernel

TORCH = TorchAttentionKernel()


# ---------------------------------------------------------------- dense fp64 reference

def dense_mask(blocks: AttentionBlocks, t_q: int, t_k: int) -> torch.Tensor:
    mask = torch.zeros(t_q, t_k, dtype=torch.bool)
    for qs, qe, ks, ke, causal in blocks:
        sq, sk = qe - qs, ke - ks
        block = torch.ones(sq, sk, dtype=torch.bool)
        if causal:
            block = torch.tril(block, diagonal=sk - sq)
        mask[qs:qe, ks:ke] |= block
    return mask


def dense_attention(q, k, v, mask, scale):
    """out [t_q, h_q, d], lse [h_q, t_q] by explicit softmax in the inputs' dtype (use fp64)."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    s = s.masked_fill(~mask, -1e30)  # finite so empty rows have clean gradients
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)) * mask
    out = torch.einsum("hqk,khd->qhd", p, vv)
    lse = torch.where(mask.any(-1), lse, torch.full_like(lse, float("-inf")))
    return out, lse


def dense_grads(q, k, v, mask, scale, dout):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out, _ = dense_attention(q, k, v, mask, scale)
    out.backward(dout)
    return q.grad, k.grad, v.grad


# ---------------------------------------------------------------- torch kernel as the per-pass library call

class TorchPerPass(VarlenPassKernel):
    """The pass machinery of the GPU kernels with the torch kernel standing in for the library."""

    name = "torch-per-pass"
    supported_dtypes = (torch.float32, torch.float64)
    head_dim_multiple = 1

    def __init__(self) -> None:
        self.calls: List[VarlenPass] = []

    @staticmethod
    def _varlen_blocks(q: torch.Tensor, k: torch.Tensor, p: VarlenPass) -> AttentionBlocks:
        cq, ck = p.cu_seqlens_q, p.cu_seqlens_k
        assert q.shape[0] == cq[-1] and k.shape[0] == ck[-1], "packed buffers must match cu_seqlens"
        assert q.is_contiguous() and k.is_contiguous()
        return AttentionBlocks.from_list([(cq[i], cq[i + 1], ck[i], ck[i + 1], p.causal) for i in range(len(cq) - 1)])

    def _pass_forward(self, q, k, v, p, softmax_scale):
        self.calls.append(p)
        return TORCH.forward(q, k, v, self._varlen_blocks(q, k, p), softmax_scale)

    def _pass_backward(self, dout, q, k, v, out, lse, p, softmax_scale):
        assert torch.isfinite(lse).all(), "every row of a pass attends to at least one key"
        return TORCH.backward(dout, q, k, v, out, lse, self._varlen_blocks(q, k, p), softmax_scale)


def random_blocks(rng: random.Random, t_q: int, t_k: int, n: int) -> AttentionBlocks:
    """Random blocks; rows shared between blocks get disjoint key ranges (the interface's rule)."""
    blocks = []
    key_cuts = sorted(rng.sample(range(1, t_k), 3))
    key_ranges = list(zip([0] + key_cuts, key_cuts + [t_k]))
    for i in range(n):
        qs = rng.randrange(0, t_q - 1)
        qe = rng.randrange(qs + 1, t_q + 1)
        ks, ke = key_ranges[i % len(key_ranges)]
        blocks.append((qs, qe, ks, ke, rng.random() < 0.5))
    # keep only blocks whose key range is new for every row they share with a kept block
    kept: List[Tuple[int, int, int, int, bool]] = []
    for b in blocks:
        if all(b[1] <= o[0] or o[1] <= b[0] or b[3] <= o[2] or o[3] <= b[2] for o in kept):
            kept.append(b)
    return AttentionBlocks.from_list(kept)


def max_depth(blocks: List[Tuple[int, int, int, int, bool]]) -> int:
    events = sorted([(b[0], 1) for b in blocks] + [(b[1], -1) for b in blocks])
    depth = best = 0
    for _, step in events:
        depth += step
        best = max(best, depth)
    return best


# ---------------------------------------------------------------- pass splitting

def test_packed_batch_is_one_pass_without_copies():
    lengths = [5, 1, 17, 9]
    starts = [0, 5, 6, 23]
    blocks = AttentionBlocks.from_list([(s, s + n, s, s + n, True) for s, n in zip(starts, lengths)])
    (p,) = split_into_passes(blocks)
    assert p.causal and p.cu_seqlens_q == (0, 5, 6, 23, 32) == p.cu_seqlens_k
    assert p.q_span == (0, 32) and p.k_span == (0, 32) and p.max_seqlen_q == 17


def test_rows_shared_by_two_blocks_need_two_passes():
    # ring-like: rows 8..16 see keys 0..8 fully (previous step) and 8..16 causally (own step)
    blocks = AttentionBlocks.from_list([(8, 16, 0, 8, False), (8, 16, 8, 16, True), (0, 8, 0, 8, True)])
    passes = split_into_passes(blocks)
    assert sorted((p.causal, p.q_segments) for p in passes) == [(False, ((8, 16),)), (True, ((0, 8), (8, 16)))]
    causal = next(p for p in passes if p.causal)
    assert causal.q_span == (0, 16) and causal.k_span == (0, 16)


def test_causal_block_with_more_queries_than_keys_is_trimmed():
    # bottom-right aligned: of 10 query rows over 4 keys only the last 4 see a key
    assert normalized_blocks(AttentionBlocks.from_list([(0, 10, 20, 24, True)])) == [(6, 10, 20, 24, True)]
    # empty blocks built directly (from_list already drops them) are ignored too
    assert normalized_blocks(AttentionBlocks((3,), (3,), (0,), (4,), (False,))) == []


def test_non_adjacent_segments_are_gathered():
    blocks = AttentionBlocks.from_list([(0, 4, 10, 14, False), (6, 9, 2, 5, False)])
    (p,) = split_into_passes(blocks)
    assert p.q_span is None and p.k_span is None
    assert p.cu_seqlens_q == (0, 4, 7) and p.cu_seqlens_k == (0, 4, 7)


@pytest.mark.parametrize("seed", range(20))
def test_pass_split_is_minimal_and_complete(seed):
    rng = random.Random(seed)
    blocks = random_blocks(rng, t_q=40, t_k=50, n=12)
    passes = split_into_passes(blocks)
    got = sorted((qs, qe, ks, ke, p.causal) for p in passes for (qs, qe), (ks, ke) in zip(p.q_segments, p.k_segments))
    assert got == sorted(normalized_blocks(blocks))
    for p in passes:
        assert all(a[1] <= b[0] for a, b in zip(p.q_segments, p.q_segments[1:])), "sorted and disjoint"
    for causal in (True, False):
        expected = max_depth([b for b in normalized_blocks(blocks) if b[4] == causal])
        assert sum(p.causal == causal for p in passes) == expected


# ---------------------------------------------------------------- LSE merge

def test_merge_partial_equals_attention_over_the_union():
    torch.manual_seed(0)
    q, k, v = torch.randn(6, 2, 8, dtype=torch.float64), torch.randn(9, 2, 8, dtype=torch.float64), \
        torch.randn(9, 2, 8, dtype=torch.float64)
    first = torch.zeros(6, 9, dtype=torch.bool)
    first[:, :4] = True
    second = torch.zeros(6, 9, dtype=torch.bool)
    second[1:, 4:] = True  # row 0 gets nothing from the second part
    out_a, lse_a = dense_attention(q, k, v, first, 0.3)
    out_b, lse_b = dense_attention(q, k, v, second, 0.3)
    out, lse = merge_partial(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = dense_attention(q, k, v, first | second, 0.3)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=0)


def test_merge_partial_keeps_empty_rows_empty():
    out_a = torch.zeros(3, 2, 4)
    lse = torch.full((2, 3), float("-inf"))
    out, merged = merge_partial(out_a, lse, out_a.clone(), lse.clone())
    assert out.dtype == torch.float32 and torch.equal(out, torch.zeros(3, 2, 4))
    assert torch.isneginf(merged).all()


# ---------------------------------------------------------------- the pass kernel end to end (torch per pass)

@pytest.mark.parametrize("seed,h_q,h_kv,d", [(0, 4, 4, 16), (1, 8, 1, 8), (2, 4, 2, 17), (3, 6, 3, 32)])
def test_pass_kernel_matches_dense_reference(seed, h_q, h_kv, d):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    t_q, t_k, scale = 40, 50, d ** -0.5
    blocks = random_blocks(rng, t_q, t_k, n=12)
    q = torch.randn(t_q, h_q, d, dtype=torch.float64, generator=gen)
    k = torch.randn(t_k, h_kv, d, dtype=torch.float64, generator=gen)
    v = torch.randn(t_k, h_kv, d, dtype=torch.float64, generator=gen)
    dout = torch.randn(t_q, h_q, d, dtype=torch.float64, generator=gen)
    mask = dense_mask(blocks, t_q, t_k)
    assert (~mask.any(-1)).any() and len(split_into_passes(blocks)) >= 3, "the case must cover empty rows and merges"

    kernel = TorchPerPass()
    out, lse = kernel.forward(q, k, v, blocks, scale)
    ref_out, ref_lse = dense_attention(q, k, v, mask, scale)
    assert len(kernel.calls) == len(split_into_passes(blocks))
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-5, rtol=0)  # lse is float32 by contract
    assert torch.equal(out[~mask.any(-1)], torch.zeros_like(out[~mask.any(-1)]))

    dq, dk, dv = kernel.backward(dout, q, k, v, ref_out, ref_lse, blocks, scale)
    ref_dq, ref_dk, ref_dv = dense_grads(q, k, v, mask, scale, dout)
    for got, ref in ((dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4)  # float32 outputs by contract


def test_no_blocks_means_zero_output_and_no_library_call():
    q = torch.randn(5, 2, 8, dtype=torch.float64)
    kernel = TorchPerPass()
    out, lse = kernel.forward(q, q, q, AttentionBlocks(), 1.0)
    grads = kernel.backward(q, q, q, q, out, lse, AttentionBlocks(), 1.0)
    assert kernel.calls == [] and torch.equal(out, torch.zeros_like(q)) and torch.isneginf(lse).all()
    assert all(torch.equal(g, torch.zeros(q.shape)) for g in grads)


def test_pass_kernel_in_a_ring_merges_exactly():
    """Two calls over disjoint keys, merged with the LSE, backward with the merged out/lse (ring attention)."""
    gen = torch.Generator().manual_seed(7)
    t, h_q, h_kv, d, scale = 48, 4, 2, 16, 0.25
    q, k, v, dout = (torch.randn(t, h, d, dtype=torch.float64, generator=gen) for h in (h_q, h_kv, h_kv, h_q))
    docs = [(0, 20), (20, 21), (21, 48)]
    # keys < 24 in the first call, keys >= 24 in the second; rows 24..47 get contributions from both
    step_a = AttentionBlocks.from_list([(0, 20, 0, 20, True), (20, 21, 20, 21, True), (21, 24, 21, 24, True),
                                        (24, 48, 21, 24, False)])
    step_b = AttentionBlocks.from_list([(24, 48, 24, 48, True)])
    kernel = TorchPerPass()
    out_a, lse_a = kernel.forward(q, k, v, step_a, scale)
    out_b, lse_b = kernel.forward(q, k, v, step_b, scale)
    out, lse = merge_partial(out_a, lse_a, out_b, lse_b)
    full = AttentionBlocks.from_list([(s, e, s, e, True) for s, e in docs])
    mask = dense_mask(full, t, t)
    assert torch.equal(mask, dense_mask(step_a, t, t) | dense_mask(step_b, t, t))
    ref_out, ref_lse = dense_attention(q, k, v, mask, scale)
    # the merge weights come from float32 lse (the interface's lse dtype): ~1e-7 relative
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=0)
    grads_a = kernel.backward(dout, q, k, v, out, lse, step_a, scale)
    grads_b = kernel.backward(dout, q, k, v, out, lse, step_b, scale)
    for ga, gb, ref in zip(grads_a, grads_b, dense_grads(q, k, v, mask, scale, dout)):
        torch.testing.assert_close((ga + gb).double(), ref, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- availability and bad input

@pytest.mark.parametrize("cls,module", [(FlashAttentionKernel, "flash_attn"),
                                        (TEAttentionKernel, "transformer_engine")])
def test_is_available_needs_cuda_and_the_package(cls, module):
    installed = importlib.util.find_spec(module) is not None
    if not (torch.cuda.is_available() and installed):
        assert cls.is_available() is False
    else:
        assert cls.is_available() is True


@pytest.mark.parametrize("name,cls,package", [("flash", FlashAttentionKernel, "flash-attn"),
                                              ("te", TEAttentionKernel, "transformer-engine")])
def test_requesting_a_missing_kernel_names_the_package(name, cls, package):
    if cls.is_available():
        pytest.skip(f"{name} is installed here; the missing-package error cannot occur")
    with pytest.raises(RuntimeError, match=package):
        get_kernel(name)


@pytest.mark.parametrize("cls", [FlashAttentionKernel, TEAttentionKernel])
def test_bad_dtype_head_dim_and_device_are_value_errors(cls):
    blocks = AttentionBlocks.from_list([(0, 4, 0, 4, True)])
    half = dict(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        cls.check_inputs(torch.randn(4, 2, 64), torch.randn(4, 2, 64), torch.randn(4, 2, 64), blocks)
    with pytest.raises(ValueError, match="head_dim=12"):
        cls.check_inputs(torch.randn(4, 2, 12, **half), torch.randn(4, 2, 12, **half),
                         torch.randn(4, 2, 12, **half), blocks)
    too_big = cls.max_head_dim + 8
    with pytest.raises(ValueError, match=f"head_dim={too_big}"):
        cls.check_inputs(*(torch.randn(4, 2, too_big, **half) for _ in range(3)), blocks)
    with pytest.raises(ValueError, match="CUDA"):
        cls.check_inputs(*(torch.randn(4, 2, 64, **half) for _ in range(3)), blocks)


# ---------------------------------------------------------------- GPU: the real kernels against fp32

GPU_KERNELS = [pytest.param(cls, marks=pytest.mark.skipif(not cls.is_available(),
                                                          reason=f"{cls.name!r} needs CUDA and its package"))
               for cls in (FlashAttentionKernel, TEAttentionKernel)]


@pytest.mark.parametrize("cls", GPU_KERNELS)
@pytest.mark.parametrize("case", ["packed", "ring-step", "gathered"])
def test_gpu_kernel_matches_torch_kernel(cls, case):
    """flash-attn's own criterion: error against fp32 (the torch kernel on the bf16 values) at most 2x (out,
    lse) / 3x (grads) the error of dense attention computed in bf16 (``gpu_check.dense_lowp_attention``)."""
    from megatron_hsap.sequence.doc_lengths import sample_doc_lengths
    gc = _load_gpu_check()
    t, h_q, h_kv, d, scale = 4096, 8, 2, 128, 128 ** -0.5
    if case == "packed":
        lengths = sample_doc_lengths(t, seed=3, max_doc_len=2048)
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        blocks = AttentionBlocks.from_list([(s, s + n, s, s + n, True) for s, n in zip(starts, lengths)])
    elif case == "ring-step":
        blocks = AttentionBlocks.from_list([(0, 2048, 0, 2048, True), (2048, t, 2048, t, True),
                                            (2048, t, 0, 2048, False)])
    else:
        blocks = AttentionBlocks.from_list([(100, 900, 3000, 3700, True), (1000, 1500, 200, 1200, False),
                                            (1600, 4000, 0, 100, False)])
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for h in (h_q, h_kv, h_kv, h_q))
    kernel = cls()
    out, lse = kernel.forward(q, k, v, blocks, scale)
    grads = kernel.backward(dout, q, k, v, out, lse, blocks, scale)
    ref_out, ref_lse = TORCH.forward(q.float(), k.float(), v.float(), blocks, scale)
    ref_grads = TORCH.backward(dout.float(), q.float(), k.float(), v.float(), ref_out, ref_lse, blocks, scale)
    pt_out, pt_lse, pt_grads = gc.dense_lowp_attention(q, k, v, dout, gc.dense_mask(blocks, t, t, q.device), scale)
    floor = 1e-5
    assert gc.max_err(out, ref_out) <= 2 * gc.max_err(pt_out, ref_out) + floor
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
    assert gc.max_err(lse, ref_lse) <= 2 * gc.max_err(pt_lse, ref_lse) + floor
    for got, ref, pt in zip(grads, ref_grads, pt_grads):
        assert got.dtype == torch.float32
        assert gc.max_err(got, ref) <= 3 * gc.max_err(pt, ref) + floor


# ---------------------------------------------------------------- tools/gpu_check.py on CPU

def _load_gpu_check():
    """tools/ is not a package: load the script as module ``gpu_check`` (once)."""
    if "gpu_check" not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "gpu_check.py")
        spec = importlib.util.spec_from_file_location("gpu_check", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["gpu_check"]


def test_gpu_check_upipe_stage_backward_equals_autograd():
    """The emulated UPipe stage rebuilds Q/K/V in its backward; its grads must equal plain autograd's."""
    gc = _load_gpu_check()
    gen = torch.Generator().manual_seed(5)
    n, hidden, d, cp, seq = 12, 16, 8, 2, 24
    x = torch.randn(n, hidden, dtype=torch.float64, generator=gen)
    wq, wk, wv = (torch.randn(r, hidden, dtype=torch.float64, generator=gen) for r in (2 * d, 2 * d, 2 * d))
    grad = torch.randn(n, 2 * d, dtype=torch.float64, generator=gen)
    blocks = AttentionBlocks.from_list([(0, 10, 0, 10, True), (10, 24, 10, 24, True)])
    shape = (seq, 2 // cp, 2 // cp, d)
    leaves = [t.clone().requires_grad_(True) for t in (x, wq, wk, wv)]
    gc._UPipeStage.apply(*leaves, TORCH, blocks, d ** -0.5, shape).backward(grad)
    plain = [t.clone().requires_grad_(True) for t in (x, wq, wk, wv)]
    q, k, v = gc._stage_qkv(*plain, shape)
    gc._all_to_all(gc._Attention.apply(q, k, v, TORCH, blocks, d ** -0.5), (n, -1)).backward(grad)
    for a, b in zip(leaves, plain):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)  # kernel grads are float32


def test_gpu_check_cpu_smoke_run(tmp_path):
    gc = _load_gpu_check()
    assert gc.main([str(tmp_path), "--device", "cpu", "--sections", "1,2,3"]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = report["sections"]
    assert sections["equivalence"]["all_pass"] is True and len(sections["equivalence"]["rows"]) == 4
    assert {r["config"] for r in sections["throughput"]["rows"]} == {"ulysses_all_heads", "upipe_stage"}
    assert all(r["fwd_tflops"] > 0 for r in sections["throughput"]["rows"])
    assert [(r["scope"], r["kind"]) for r in sections["memory"]["rows"]] == [
        ("attention_block", "ulysses"), ("attention_block", "upipe"),
        ("layer_recompute", "ulysses"), ("layer_recompute", "upipe")]
    assert all(cut > 0 for cut in sections["memory"]["upipe_peak_cut"].values())  # UPipe keeps less
    assert set(sections["memory"]["upipe_peak_cut"]) == {"attention_block", "layer_recompute"}
    assert "## 3. Peak memory" in (tmp_path / "gpu_check.md").read_text()


# ---------------------------------------------------------------- the library calls' plumbing, with fake libraries
# The fakes have the real functions' signatures (flash-attn 2.6 / 2.7+, TransformerEngine 2.x) and compute
# with the torch kernel, so every line of the flash/te kernels runs here; only CUDA itself is missing.

def _seq_blocks(cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool) -> AttentionBlocks:
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return AttentionBlocks.from_list([(cq[i], cq[i + 1], ck[i], ck[i + 1], causal) for i in range(len(cq) - 1)])


def _fake_flash(monkeypatch, split_window: bool) -> None:
    flash, iface = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.flash_attn_interface")
    flash.__version__, flash.flash_attn_interface = ("2.7.4.post1" if split_window else "2.6.3"), iface

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        assert return_attn_probs and dropout_p == 0.0 and not torch.is_grad_enabled()
        assert max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        out, lse = TORCH.forward(q, k, v, _seq_blocks(cu_seqlens_q, cu_seqlens_k, causal), softmax_scale)
        return out, lse.masked_fill(torch.isneginf(lse), float("inf")), None  # flash marks empty rows +inf

    def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, dropout_p, softmax_scale, causal, softcap, alibi_slopes, deterministic, rng_state):
        assert softmax_lse.shape == (q.shape[1], q.shape[0]) and softmax_lse.is_contiguous()
        grads = TORCH.backward(dout, q, k, v, out, softmax_lse, _seq_blocks(cu_seqlens_q, cu_seqlens_k, causal),
                               softmax_scale)
        for buf, g in zip((dq, dk, dv), grads):
            buf.copy_(g)

    if split_window:
        def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                                        window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                                        rng_state=None):
            assert (window_size_left, window_size_right) == (-1, -1)
            backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, dropout_p, softmax_scale, causal, softcap, alibi_slopes, deterministic, rng_state)
    else:
        def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                        softcap, alibi_slopes, deterministic, rng_state=None):
            assert window_size == (-1, -1)
            backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, dropout_p, softmax_scale, causal, softcap, alibi_slopes, deterministic, rng_state)

    iface.flash_attn_varlen_func = flash_attn_varlen_func
    iface._flash_attn_varlen_backward = _flash_attn_varlen_backward
    monkeypatch.setitem(sys.modules, "flash_attn", flash)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)


def _fake_te(monkeypatch, packed: bool) -> None:
    names = ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.constants",
             "transformer_engine.pytorch.cpp_extensions", "transformer_engine.pytorch.cpp_extensions.fused_attn",
             "transformer_engine.pytorch.utils"]
    te, pt, constants, ext, fused, utils = (types.ModuleType(n) for n in names)
    te.__version__, te.pytorch, pt.constants, pt.cpp_extensions, pt.utils = "2.4.0", pt, constants, ext, utils
    ext.fused_attn = fused
    constants.TE_DType = {torch.float16: "kFloat16", torch.bfloat16: "kBFloat16"}
    utils.get_cudnn_version = lambda: (9, 8, 0) if packed else (9, 1, 0)
    fused.FusedAttnBackend = {"F16_arbitrary_seqlen": "arbitrary"}

    def check(fake_dtype, q, backend, qkv_layout, attn_mask_type, cu_q, cu_q_padded, cu_k, cu_k_padded):
        assert fake_dtype == q.dtype and backend == "arbitrary" and qkv_layout == "thd_thd_thd"
        assert torch.equal(cu_q, cu_q_padded) and torch.equal(cu_k, cu_k_padded)
        assert attn_mask_type in ("padding", "padding_causal_bottom_right")
        return _seq_blocks(cu_q, cu_k, attn_mask_type == "padding_causal_bottom_right")

    def fused_attn_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype,
                       fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                       page_table_k=None, page_table_v=None, s_quantizer=None, o_quantizer=None, attn_scale=None,
                       dropout=0.0, fast_zero_fill=True, qkv_layout="sbh3d", attn_bias_type="no_bias",
                       attn_mask_type="padding", window_size=(-1, -1), rng_gen=None):
        assert is_training and dropout == 0.0 and attn_bias_type == "no_bias"
        blocks = check(fake_dtype, q, fused_attention_backend, qkv_layout, attn_mask_type, cu_seqlens_q,
                       cu_seqlens_q_padded, cu_seqlens_kv, cu_seqlens_kv_padded)
        out, lse = TORCH.forward(q, k, v, blocks, attn_scale)
        if packed:
            stats = lse.t().unsqueeze(-1)
        else:
            stats = torch.full((len(blocks), q.shape[1], max_seqlen_q, 1), 123.0)  # padding slots: garbage
            for i, (qs, qe, _, _, _) in enumerate(blocks):
                stats[i, :, :qe - qs, 0] = lse[:, qs:qe]
        return out, [stats, torch.zeros(2, dtype=torch.int64)]

    def fused_attn_bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype,
                       dqkv_dtype, aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded=None,
                       cu_seqlens_kv_padded=None, s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None,
                       attn_scale=None, dropout=0.0, fast_zero_fill=True, qkv_layout="sbh3d",
                       attn_bias_type="no_bias", attn_mask_type="padding", window_size=(-1, -1),
                       deterministic=False):
        assert dqkv_dtype == constants.TE_DType[q.dtype] and len(aux_ctx_tensors) == 2
        blocks = check(fake_dtype, q, fused_attention_backend, qkv_layout, attn_mask_type, cu_seqlens_q,
                       cu_seqlens_q_padded, cu_seqlens_kv, cu_seqlens_kv_padded)
        stats = aux_ctx_tensors[0]
        if packed:
            lse = stats[..., 0].t()
        else:
            assert stats.shape == (len(blocks), q.shape[1], max_seqlen_q, 1)
            lse = torch.cat([stats[i, :, :qe - qs, 0] for i, (qs, qe, _, _, _) in enumerate(blocks)], dim=1)
        grads = TORCH.backward(d_o, q, k, v, o, lse, blocks, attn_scale)
        return [g.to(q.dtype) for g in grads]

    fused.fused_attn_fwd, fused.fused_attn_bwd = fused_attn_fwd, fused_attn_bwd
    for name, module in zip(names, (te, pt, constants, ext, fused, utils)):
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize("library,variant", [("flash", True), ("flash", False), ("te", True), ("te", False)])
def test_library_calls_with_fake_libraries(monkeypatch, library, variant):
    """flash: variant = split window arguments (2.7+) or not (2.6); te: variant = packed stats or not."""
    (_fake_flash if library == "flash" else _fake_te)(monkeypatch, variant)
    cls = FlashAttentionKernel if library == "flash" else TEAttentionKernel
    monkeypatch.setattr(cls, "check_inputs", VarlenPassKernel.check_inputs)  # everything but the CUDA check
    kernel = cls()
    gen = torch.Generator().manual_seed(9)
    t, h_q, h_kv, d, scale = 40, 4, 2, 16, 0.25
    q, k, v, dout = (torch.randn(t, h, d, generator=gen).half() for h in (h_q, h_kv, h_kv, h_q))
    blocks = AttentionBlocks.from_list([(0, 12, 0, 12, True), (12, 30, 12, 30, True), (12, 30, 30, 40, False),
                                        (30, 40, 0, 5, False), (35, 38, 20, 24, True)])
    assert len(split_into_passes(blocks)) == 2
    out, lse = kernel.forward(q, k, v, blocks, scale)
    q64, k64, v64, dout64 = (x.double() for x in (q, k, v, dout))
    mask = dense_mask(blocks, t, t)
    ref_out, ref_lse = dense_attention(q64, k64, v64, mask, scale)
    # fp16 inputs: each pass output is rounded to fp16 once (~5e-4 relative) before the fp32 merge
    torch.testing.assert_close(out.double(), ref_out, atol=3e-3, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=0)
    grads = kernel.backward(dout, q, k, v, out, lse, blocks, scale)
    for got, ref in zip(grads, dense_grads(q64, k64, v64, mask, scale, dout64)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=0)  # fp16 grads per pass, |grad| ~ 1


def test_unsupported_library_versions_are_clear_errors(monkeypatch):
    _fake_flash(monkeypatch, True)
    monkeypatch.setattr(sys.modules["flash_attn"], "__version__", "2.5.9")
    with pytest.raises(RuntimeError, match=r"flash-attn>=2.6.0,<3"):
        FlashAttentionKernel()
    _fake_te(monkeypatch, True)
    monkeypatch.setattr(sys.modules["transformer_engine"], "__version__", "1.13.0")
    with pytest.raises(RuntimeError, match=r"transformer-engine\[pytorch\]>=2.0,<3"):
        TEAttentionKernel()
