"""The pure-PyTorch kernel against the independent dense float64 reference (tests/reference.py)."""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F

from megatron_hsap.kernels import get_kernel
from megatron_hsap.kernels.base import AttentionBlocks
from megatron_hsap.kernels import torch_kernel
from megatron_hsap.kernels.torch_kernel import TorchAttentionKernel, _build_schedule
from tests.reference import blocks_mask, dense_attention, dense_attention_blocks, hard_cases

Block = Tuple[int, int, int, int, bool]

# (t_q, t_k, blocks): every case keeps the per-row key ranges of its blocks disjoint. Sizes are meant for
# the small tiles of the `small_tiles` fixture (SMALL_TILES), so that tiling, skipping of hidden tiles,
# partly masked tiles and fused small blocks all run while the float64 reference stays cheap.
SMALL_TILES = dict(TILE_Q=32, TILE_K=64, FUSE_Q=16, FUSE_K=32)
CASES: Dict[str, Tuple[int, int, List[Block]]] = {
    "causal_multi_tile": (150, 150, [(0, 150, 0, 150, True)]),
    "full_multi_tile": (90, 150, [(0, 90, 0, 150, False)]),
    "causal_fewer_queries_than_keys": (40, 200, [(0, 40, 0, 200, True)]),
    # bottom-right alignment: the first 80 query rows see no key at all
    "causal_more_queries_than_keys": (120, 40, [(0, 120, 0, 40, True)]),
    "uncovered_rows": (90, 80, [(10, 30, 0, 20, True), (50, 70, 40, 80, False)]),
    # several blocks on the same query rows with disjoint key ranges (zigzag-like, ring-like)
    "overlapping_query_rows": (120, 200, [(0, 60, 0, 50, False), (0, 60, 50, 110, True), (30, 120, 110, 200, True),
                                          (60, 120, 0, 110, False)]),
    # a packed batch: short documents (fused into shared tiles), length-1 ones, and longer ones
    "packed_documents": (200, 200, [(s, e, s, e, True) for s, e in
                                    [(0, 1), (1, 4), (4, 12), (12, 13), (13, 40), (40, 41), (41, 50), (50, 200)]]),
    "no_blocks": (30, 20, []),
}
HEADS = [(8, 1), (4, 2), (4, 4)]
HEAD_DIMS = [64, 17]


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Shrink the kernel's tiles (and drop cached schedules) so small cases exercise every code path."""
    for name, value in SMALL_TILES.items():
        monkeypatch.setattr(torch_kernel, name, value)
    torch_kernel._schedules.clear()
    yield
    torch_kernel._schedules.clear()


def _inputs(t_q: int, t_k: int, h_q: int, h_kv: int, d: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t_q, h_q, d, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(t_k, h_kv, d, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(t_k, h_kv, d, generator=gen, dtype=torch.float64).to(dtype)
    dout = torch.randn(t_q, h_q, d, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v, dout


def _reference(q, k, v, dout, blocks: List[Block], scale: float):
    """Dense float64 out, lse and (dq, dk, dv) of exactly the given (possibly low-precision) input values."""
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out, lse = dense_attention_blocks(*leaves, blocks, scale)
    grads = torch.autograd.grad(out, leaves, dout.double()) if out.numel() else [torch.zeros_like(x) for x in leaves]
    return out.detach(), lse.detach(), grads


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str) -> None:
    actual = actual.double()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    inf = torch.isinf(expected)
    assert torch.equal(torch.isinf(actual), inf) and torch.equal(actual[inf], expected[inf]), f"{what}: -inf pattern"
    err = (actual[~inf] - expected[~inf]).abs()
    bound = atol + rtol * expected[~inf].abs()
    assert torch.isfinite(actual[~inf]).all(), f"{what}: non-finite values"
    assert (err <= bound).all(), f"{what}: max error {err.max().item():.3g} exceeds atol={atol} rtol={rtol}"


def _check_case(case: Tuple[int, int, List[Block]], h_q: int, h_kv: int, d: int, dtype: torch.dtype,
                atol: float, rtol: float, grad_atol: float, grad_rtol: float) -> None:
    t_q, t_k, block_list = case
    blocks = AttentionBlocks.from_list(block_list)
    scale = d ** -0.5
    q, k, v, dout = _inputs(t_q, t_k, h_q, h_kv, d, dtype)
    originals = [x.clone() for x in (q, k, v, dout)]
    kernel = TorchAttentionKernel()
    out, lse = kernel.forward(q, k, v, blocks, scale)
    grads = kernel.backward(dout, q, k, v, out, lse, blocks, scale)
    assert all(torch.equal(x, y) for x, y in zip((q, k, v, dout), originals)), "the kernel modified its inputs"
    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, block_list, scale)
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert out.dtype == dtype and lse.dtype == acc_dtype and lse.shape == (h_q, t_q)
    _assert_close(out, ref_out, atol, rtol, "out")
    _assert_close(lse, ref_lse, atol, 1e-6 if dtype != torch.float64 else 1e-12, "lse")
    for grad_name, grad, ref, x in zip(("dq", "dk", "dv"), grads, ref_grads, (q, k, v)):
        assert grad.dtype == acc_dtype and grad.shape == x.shape
        _assert_close(grad, ref, grad_atol, grad_rtol, grad_name)
    uncovered = torch.isinf(ref_lse).all(dim=0)
    assert (out[uncovered] == 0).all() and (grads[0][uncovered] == 0).all()


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("h_q,h_kv", HEADS)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_float64(name, h_q, h_kv, d):
    _check_case(CASES[name], h_q, h_kv, d, torch.float64, atol=1e-10, rtol=0, grad_atol=1e-10, grad_rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_float32(name):
    _check_case(CASES[name], 8, 2, 64, torch.float32, atol=1e-5, rtol=0, grad_atol=2e-5, grad_rtol=0)


@pytest.mark.parametrize("dtype,eps", [(torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)])
@pytest.mark.parametrize("name", ["causal_multi_tile", "overlapping_query_rows", "packed_documents"])
def test_matches_reference_low_precision(name, dtype, eps):
    # The reference sees the same rounded inputs, and the kernel accumulates in float32, so the output's
    # error is its final rounding (half an ulp: eps/2 relative) plus float32 noise. The gradients are
    # float32 but use the rounded `out` in D = rowsum(dout * out): an eps-relative error in D, i.e.
    # about eps * |dout| * |out| per score gradient, bounded here by 4 * eps absolute.
    _check_case(CASES[name], 8, 2, 64, dtype, atol=1e-5, rtol=eps, grad_atol=4 * eps, grad_rtol=eps)


def _merge(out1, lse1, out2, lse2):
    """LSE-merge two partial results (out ``[t, h, d]``, lse ``[h, t]``) the way a ring step does."""
    lse = torch.logaddexp(lse1, lse2)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    w1 = (lse1 - safe).exp().T.unsqueeze(-1)
    w2 = (lse2 - safe).exp().T.unsqueeze(-1)
    return (out1.to(lse.dtype) * w1 + out2.to(lse.dtype) * w2).to(out1.dtype), lse


def test_default_tiles_float64(monkeypatch):
    """The shipped tile sizes: a causal document spanning several default tiles, and fused short documents."""
    monkeypatch.undo()
    torch_kernel._schedules.clear()
    t = torch_kernel.TILE_Q + torch_kernel.TILE_K // 2 + 3
    _check_case((t, t, [(0, t, 0, t, True)]), 4, 2, 32, torch.float64, 1e-10, 0, 1e-10, 0)
    short = [(s, min(s + 7, 200), s, min(s + 7, 200), True) for s in range(0, 200, 7)]
    _check_case((200, 200, short), 4, 2, 32, torch.float64, 1e-10, 0, 1e-10, 0)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("h_q,h_kv", [(8, 1), (4, 4)])
def test_two_calls_merged_like_a_ring_step(dtype, tol, h_q, h_kv):
    """Keys split across two calls (own keys, then a peer's): merged forward and summed backward are exact."""
    t, half, d = 150, 70, 64
    scale = d ** -0.5
    q, k, v, dout = _inputs(t, t, h_q, h_kv, d, dtype, seed=1)
    kernel = TorchAttentionKernel()
    own = AttentionBlocks.from_list([(0, half, 0, half, True), (half, t, 0, half, False)])
    peer = AttentionBlocks.from_list([(half, t, 0, t - half, True)])  # rows [0, half) see none of these keys
    out1, lse1 = kernel.forward(q, k[:half], v[:half], own, scale)
    out2, lse2 = kernel.forward(q, k[half:], v[half:], peer, scale)
    assert torch.isinf(lse2[:, :half]).all()
    out, lse = _merge(out1, lse1, out2, lse2)
    ref_out, ref_lse, (ref_dq, ref_dk, ref_dv) = _reference(q, k, v, dout, [(0, t, 0, t, True)], scale)
    _assert_close(out, ref_out, tol, 0, "merged out")
    _assert_close(lse, ref_lse, tol, 0, "merged lse")
    dq1, dk1, dv1 = kernel.backward(dout, q, k[:half], v[:half], out, lse, own, scale)
    dq2, dk2, dv2 = kernel.backward(dout, q, k[half:], v[half:], out, lse, peer, scale)
    _assert_close(dq1 + dq2, ref_dq, tol, 0, "dq")
    _assert_close(torch.cat([dk1, dk2]), ref_dk, tol, 0, "dk")
    _assert_close(torch.cat([dv1, dv2]), ref_dv, tol, 0, "dv")


def test_strided_inputs_and_empty_tensors():
    """q/k/v as slices of one packed tensor, a stride-0 dout (from .sum()), and zero-length inputs."""
    t, h, d = 70, 4, 16
    qkv = torch.randn(t, 3 * h + 1, d, dtype=torch.float64)
    q, k, v = qkv[:, :h], qkv[:, h:2 * h:2], qkv[:, 2 * h + 1:3 * h + 1:2]  # h_kv = 2, strided heads
    blocks = [(0, t, 0, t, True)]
    dout = torch.ones(1, dtype=torch.float64).expand(t, h, d)
    kernel = TorchAttentionKernel()
    out, lse = kernel.forward(q, k, v, AttentionBlocks.from_list(blocks), 0.25)
    grads = kernel.backward(dout, q, k, v, out, lse.T.contiguous().T, AttentionBlocks.from_list(blocks), 0.25)
    ref_out, ref_lse, ref_grads = _reference(q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous(),
                                             blocks, 0.25)
    _assert_close(out, ref_out, 1e-10, 0, "out")
    for grad, ref in zip(grads, ref_grads):
        _assert_close(grad, ref, 1e-10, 0, "grad")
    empty_q, empty_kv = torch.zeros(0, h, d), torch.zeros(0, 2, d)
    out, lse = kernel.forward(empty_q, empty_kv, empty_kv, AttentionBlocks(), 1.0)
    assert out.shape == (0, h, d) and lse.shape == (h, 0)
    dq, dk, dv = kernel.backward(empty_q, empty_q, empty_kv, empty_kv, out, lse, AttentionBlocks(), 1.0)
    assert dq.shape == (0, h, d) and dk.shape == dv.shape == (0, 2, d)


@pytest.mark.parametrize("name", list(CASES))
def test_schedule_covers_exactly_the_mask(name):
    """Tiles cover every attended pair once, never a hidden one, and no tile is entirely masked."""
    t_q, t_k, block_list = CASES[name]
    covered = torch.zeros(t_q, t_k, dtype=torch.int64)
    for tile in _build_schedule(AttentionBlocks.from_list(block_list)):
        visible = torch.ones(tile.q1 - tile.q0, tile.k1 - tile.k0, dtype=torch.bool)
        if tile.hidden is not None:
            visible = ~tile.hidden
        assert visible.any(), f"tile q[{tile.q0}:{tile.q1}] k[{tile.k0}:{tile.k1}] is entirely masked"
        covered[tile.q0:tile.q1, tile.k0:tile.k1] += visible
    assert torch.equal(covered, blocks_mask(block_list, t_q, t_k).long())


def test_registry_and_availability():
    assert TorchAttentionKernel.is_available()
    kernel = get_kernel("torch")
    assert isinstance(kernel, TorchAttentionKernel) and kernel.name == "torch"


@pytest.mark.parametrize("bad,match", [
    (dict(q=torch.zeros(4, 2, 8, dtype=torch.int32), k=torch.zeros(4, 2, 8, dtype=torch.int32),
          v=torch.zeros(4, 2, 8, dtype=torch.int32)), "not supported"),
    (dict(q=torch.zeros(4, 16)), r"layout \[t, h, d\]"),
    (dict(q=torch.zeros(4, 3, 8)), "multiple of h_kv"),
    (dict(k=torch.zeros(4, 2, 8, dtype=torch.float64)), "share a dtype"),
    (dict(v=torch.zeros(5, 2, 8)), "same shape"),
    (dict(q=torch.zeros(4, 2, 4)), "head_dim"),
    (dict(blocks=AttentionBlocks.from_list([(0, 5, 0, 4, True)])), "out of bounds"),
])
def test_rejects_bad_inputs(bad, match):
    args = dict(q=torch.zeros(4, 2, 8), k=torch.zeros(4, 2, 8), v=torch.zeros(4, 2, 8),
                blocks=AttentionBlocks.from_list([(0, 4, 0, 4, True)]))
    args.update(bad)
    kernel = TorchAttentionKernel()
    with pytest.raises(ValueError, match=match):
        kernel.forward(args["q"], args["k"], args["v"], args["blocks"], 1.0)
    with pytest.raises(ValueError, match=match):  # input checks run before backward's own shape checks
        kernel.backward(args["q"], args["q"], args["k"], args["v"], args["q"], torch.zeros(0), args["blocks"], 1.0)


def test_backward_rejects_mismatched_out_and_lse():
    q = k = v = torch.zeros(4, 2, 8)
    blocks = AttentionBlocks.from_list([(0, 4, 0, 4, True)])
    kernel = TorchAttentionKernel()
    with pytest.raises(ValueError, match="lse must have shape"):
        kernel.backward(q, q, k, v, q, torch.zeros(4, 2), blocks, 1.0)
    with pytest.raises(ValueError, match="dout must have shape"):
        kernel.backward(q[:3], q, k, v, q, torch.zeros(2, 4), blocks, 1.0)


# --- the reference itself: checked against torch's SDPA and the AttentionBlocks rule, element by element ---

def test_blocks_mask_follows_the_bottom_right_rule():
    blocks = [(0, 5, 0, 3, True), (5, 7, 0, 9, True), (0, 5, 3, 6, False)]
    mask = blocks_mask(blocks, 7, 9)
    expected = torch.zeros(7, 9, dtype=torch.bool)
    for qs, qe, ks, ke, causal in blocks:
        for a in range(qe - qs):
            for b in range(ke - ks):
                expected[qs + a, ks + b] = (not causal) or b <= a + (ke - ks) - (qe - qs)
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("causal", [True, False])
def test_dense_reference_matches_sdpa_per_document(causal):
    lengths, h_q, h_kv, d = [5, 1, 0, 17, 9], 4, 2, 8
    total = sum(lengths) + 3  # three trailing tokens outside any document
    q, k, v, _ = _inputs(total, total, h_q, h_kv, d, torch.float64, seed=3)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    valid = torch.ones(total, dtype=torch.bool)
    valid[3] = False  # a padding token inside the first document
    out = dense_attention(q, k, v, cu, causal=causal, softmax_scale=0.3, valid=valid)
    expected = torch.zeros_like(out)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        keep = [i for i in range(start, end) if valid[i]]
        if not keep:
            continue
        sub = [x[keep].transpose(0, 1) for x in (q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))]
        expected[keep] = F.scaled_dot_product_attention(*sub, is_causal=causal, scale=0.3).transpose(0, 1)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    assert (out[3] == 0).all() and (out[-3:] == 0).all()


@pytest.mark.parametrize("cp_size", [2, 3, 4, 8])
def test_hard_cases_cover_reference_section_6(cp_size):
    cases = hard_cases(cp_size)
    shard = 48  # tokens per rank in the cases' contiguous description
    total = shard * cp_size

    def crossed(lengths):  # how many shard edges each document strictly contains
        bounds = torch.tensor([0] + lengths).cumsum(0).tolist()
        return [sum(1 for edge in range(shard, total, shard) if a < edge < b) for a, b in zip(bounds, bounds[1:])]

    for name, lengths in cases.items():
        assert all(isinstance(n, int) and n >= 0 for n in lengths), name
        assert sum(lengths) == (total + 1 if name == "total_not_divisible_by_c" else total), name
    assert cases["single_document"] == [total]
    assert max(cases["only_short"]) <= 10 and max(crossed(cases["only_short"])) <= 1
    assert crossed(cases["crosses_one_boundary"])[1] == 1
    assert crossed(cases["crosses_several_boundaries"])[1] == min(2, cp_size - 1)
    assert crossed(cases["crosses_all_boundaries"])[1] == cp_size - 1
    assert max(crossed(cases["boundaries_on_shard_edges"])) == 0
    chunk = total // (2 * cp_size)  # zigzag chunk of the whole packed sequence
    assert all(edge % chunk == 0 for edge in torch.tensor(cases["boundaries_on_zigzag_chunk_edges"]).cumsum(0).tolist())
    assert {0, 1} <= set(cases["length_one_and_zero"])
    assert any(n % (2 * cp_size) for n in cases["not_divisible_by_2c"])
    assert sum(cases["total_not_divisible_by_c"]) % cp_size != 0
    long_tail = cases["long_tail_sampled"]
    assert len(long_tail) >= 4 and max(long_tail) >= 3 * sorted(long_tail)[len(long_tail) // 2]
