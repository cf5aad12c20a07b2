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
import os
import random
import sys
from typing import List, Tuple

import pytest
import torch

from megatron_hsap.kernels import get_kernel
from megatron_hsap.kernels.base import AttentionBlocks
from megatron_hsap.kernels.flash_kernel import FlashAttentionKernel
from megatron_hsap.device_cache import DEVICE_INDEX_CACHE, DeviceTensorCache
from megatron_hsap.kernels.gpu_common import (VarlenPass, VarlenPassKernel,
                                              merge_partial, normalized_blocks, split_into_passes)
from megatron_hsap.kernels.te_kernel import TEAttentionKernel
from megatron_hsap.kernels.torch_flash_kernel import TorchFlashAttentionKernel
from megatron_hsap.kernels.torch_kernel import TorchAttentionKernel

TORCH = TorchAttentionKernel()


# ---------------------------------------------------------------- dense fp64 reference

def dense_mask(blocks: AttentionBlocks, t_q: int, t_k: int) -> torch.Tensor:
    mask = torch.zeros(t_q, t_k, dtype=torch.bool)
    for i, (qs, qe, ks, ke, causal) in enumerate(blocks):
        sq, sk = qe - qs, ke - ks
        block = torch.ones(sq, sk, dtype=torch.bool)
        if causal:
            block = torch.tril(block, diagonal=sk - sq)
        left, right = blocks.window(i)  # sliding window, bottom-right aligned like causal
        diagonal = torch.arange(sk)[None, :] - torch.arange(sq)[:, None] - (sk - sq)
        if left >= 0:
            block &= diagonal >= -left
        if right >= 0:
            block &= diagonal <= right
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
    assert normalized_blocks(AttentionBlocks.from_list([(0, 10, 20, 24, True)])) == [(6, 10, 20, 24, True, (-1, -1))]
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
    got = sorted((qs, qe, ks, ke, p.causal, p.window) for p in passes
                 for (qs, qe), (ks, ke) in zip(p.q_segments, p.k_segments))
    assert got == sorted(normalized_blocks(blocks))
    for p in passes:
        assert all(a[1] <= b[0] for a, b in zip(p.q_segments, p.q_segments[1:])), "sorted and disjoint"
    for causal in (True, False):
        expected = max_depth([b for b in normalized_blocks(blocks) if b[4] == causal])
        assert sum(p.causal == causal for p in passes) == expected


def test_windowed_blocks_get_passes_of_their_own_window():
    """Blocks with different sliding windows never share a pass; each pass carries its window."""
    blocks = AttentionBlocks.from_list([(0, 8, 0, 8, True, (3, -1)), (8, 16, 8, 16, True, (3, -1)),
                                        (8, 16, 0, 8, False, (4, 2)), (16, 20, 16, 20, True)])
    passes = split_into_passes(blocks)
    assert sorted((p.causal, p.window, p.q_segments) for p in passes) == [
        (False, (4, 2), ((8, 16),)), (True, (-1, -1), ((16, 20),)), (True, (3, -1), ((0, 8), (8, 16)))]


# ---------------------------------------------------------------- the device index cache (bounded in bytes)

def test_device_tensor_cache_is_bounded_in_bytes_and_evicts_least_recently_used():
    cache = DeviceTensorCache(max_bytes=100)
    built = []

    def build(n):
        return lambda: built.append(n) or torch.zeros(n, dtype=torch.int32)  # 4 bytes per entry

    a = cache.get("a", build(10))  # 40 bytes
    cache.get("b", build(10))      # 80
    assert cache.get("a", build(10)) is a and built == [10, 10]  # hit, "a" now most recent
    cache.get("c", build(5))       # 100: fits exactly
    assert cache.bytes == 100 and len(cache) == 3
    cache.get("d", build(1))       # 104 > 100: evicts the least recently used, "b"
    assert cache.bytes == 64 and cache.get("a", build(10)) is a
    cache.get("b", build(10))      # rebuilt, evicts "c" (now the oldest)
    assert built == [10, 10, 5, 1, 10] and cache.bytes == 84
    big = cache.get("big", build(26))  # 104 bytes alone: returned, never kept
    assert big.numel() == 26 and "big" not in cache._entries and cache.bytes == 84
    cache.clear()
    assert cache.bytes == 0 and len(cache) == 0


def test_gathered_passes_stay_within_the_device_cache_bound(monkeypatch):
    """Many distinct gathered passes (a changing batch): the row-index cache never exceeds its bound in bytes,
    and results stay exact when entries are evicted and rebuilt."""
    monkeypatch.setattr(DEVICE_INDEX_CACHE, "max_bytes", 2048)
    DEVICE_INDEX_CACHE.clear()
    kernel = TorchPerPass()
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(60, 2, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    for _ in range(2):  # the second round finds some entries evicted
        for seed in range(12):
            blocks = random_blocks(random.Random(seed), 60, 60, n=10)
            out, _ = kernel.forward(q, k, v, blocks, 0.3)
            assert DEVICE_INDEX_CACHE.bytes <= 2048
            ref, _ = dense_attention(q, k, v, dense_mask(blocks, 60, 60), 0.3)
            torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    assert DEVICE_INDEX_CACHE.bytes > 1024  # it filled up to the bound (and evicted: 12 gathered batches need more)
    DEVICE_INDEX_CACHE.clear()


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
        # float32 outputs by contract: measured max |error| 4.4e-7 (gradients of O(1))
        torch.testing.assert_close(got.double(), ref, atol=2e-6, rtol=0)


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
        torch.testing.assert_close((ga + gb).double(), ref, atol=2e-6, rtol=0)  # float32: measured 3.5e-7


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
               for cls in (FlashAttentionKernel, TEAttentionKernel, TorchFlashAttentionKernel)]


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


# ---------------------------------------------------------------- tools/gpu_check.py's helpers (its dry run: test_gpu_check.py)

def _load_gpu_check():
    """tools/ is not a package: load the script as module ``gpu_check`` (once)."""
    if "gpu_check" not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "gpu_check.py")
        spec = importlib.util.spec_from_file_location("gpu_check", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["gpu_check"]
