"""Block layouts and checks shared by the local-kernel tests (every kernel against tests/reference.py)."""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch

from megatron_hsap.kernels.base import AttentionBlocks, AttentionKernel
from tests.reference import dense_attention_blocks

Block = Tuple[int, int, int, int, bool]

# (t_q, t_k, blocks): every case keeps the per-row key ranges of its blocks disjoint. Sizes are meant for
# the torch kernel's small test tiles (see test_torch_kernel.py), so that tiling, skipping of hidden tiles,
# partly masked tiles and fused small blocks all run while the float64 reference stays cheap.
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


def make_inputs(t_q: int, t_k: int, h_q: int, h_kv: int, d: int, dtype: torch.dtype, seed: int = 0):
    """Random q ``[t_q, h_q, d]``, k/v ``[t_k, h_kv, d]`` and dout ``[t_q, h_q, d]`` in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t_q, h_q, d, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(t_k, h_kv, d, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(t_k, h_kv, d, generator=gen, dtype=torch.float64).to(dtype)
    dout = torch.randn(t_q, h_q, d, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v, dout


def reference(q, k, v, dout, blocks: List[Block], scale: float):
    """Dense float64 out, lse and (dq, dk, dv) of exactly the given (possibly low-precision) input values."""
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out, lse = dense_attention_blocks(*leaves, blocks, scale)
    grads = torch.autograd.grad(out, leaves, dout.double()) if out.numel() else [torch.zeros_like(x) for x in leaves]
    return out.detach(), lse.detach(), grads


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str) -> None:
    """Same -inf pattern, finite elsewhere, and |actual - expected| <= atol + rtol * |expected|."""
    actual = actual.double()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    inf = torch.isinf(expected)
    assert torch.equal(torch.isinf(actual), inf) and torch.equal(actual[inf], expected[inf]), f"{what}: -inf pattern"
    err = (actual[~inf] - expected[~inf]).abs()
    bound = atol + rtol * expected[~inf].abs()
    assert torch.isfinite(actual[~inf]).all(), f"{what}: non-finite values"
    assert (err <= bound).all(), f"{what}: max error {err.max().item():.3g} exceeds atol={atol} rtol={rtol}"


def check_case(kernel: AttentionKernel, case: Tuple[int, int, List[Block]], h_q: int, h_kv: int, d: int,
               dtype: torch.dtype, atol: float, rtol: float, grad_atol: float, grad_rtol: float) -> None:
    """One kernel call's forward and backward against the dense float64 reference (contract of base.py)."""
    t_q, t_k, block_list = case
    blocks = AttentionBlocks.from_list(block_list)
    scale = d ** -0.5
    q, k, v, dout = make_inputs(t_q, t_k, h_q, h_kv, d, dtype)
    originals = [x.clone() for x in (q, k, v, dout)]
    out, lse = kernel.forward(q, k, v, blocks, scale)
    grads = kernel.backward(dout, q, k, v, out, lse, blocks, scale)
    assert all(torch.equal(x, y) for x, y in zip((q, k, v, dout), originals)), "the kernel modified its inputs"
    ref_out, ref_lse, ref_grads = reference(q, k, v, dout, block_list, scale)
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert out.dtype == dtype and lse.dtype == acc_dtype and lse.shape == (h_q, t_q)
    assert_close(out, ref_out, atol, rtol, "out")
    assert_close(lse, ref_lse, atol, 1e-6 if dtype != torch.float64 else 1e-12, "lse")
    for grad_name, grad, ref, x in zip(("dq", "dk", "dv"), grads, ref_grads, (q, k, v)):
        assert grad.dtype == acc_dtype and grad.shape == x.shape
        assert_close(grad, ref, grad_atol, grad_rtol, grad_name)
    uncovered = torch.isinf(ref_lse).all(dim=0)
    assert (out[uncovered] == 0).all() and (grads[0][uncovered] == 0).all()


def merge(out1, lse1, out2, lse2):
    """LSE-merge two partial results (out ``[t, h, d]``, lse ``[h, t]``) the way a ring step does."""
    lse = torch.logaddexp(lse1, lse2)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    w1 = (lse1 - safe).exp().T.unsqueeze(-1)
    w2 = (lse2 - safe).exp().T.unsqueeze(-1)
    return (out1.to(lse.dtype) * w1 + out2.to(lse.dtype) * w2).to(out1.dtype), lse


def check_two_calls_merged_like_a_ring_step(kernel: AttentionKernel, dtype: torch.dtype, tol: float,
                                            h_q: int, h_kv: int) -> None:
    """Keys split across two calls (own keys, then a peer's): merged forward and summed backward are exact."""
    t, half, d = 150, 70, 64
    scale = d ** -0.5
    q, k, v, dout = make_inputs(t, t, h_q, h_kv, d, dtype, seed=1)
    own = AttentionBlocks.from_list([(0, half, 0, half, True), (half, t, 0, half, False)])
    peer = AttentionBlocks.from_list([(half, t, 0, t - half, True)])  # rows [0, half) see none of these keys
    out1, lse1 = kernel.forward(q, k[:half], v[:half], own, scale)
    out2, lse2 = kernel.forward(q, k[half:], v[half:], peer, scale)
    assert torch.isinf(lse2[:, :half]).all()
    out, lse = merge(out1, lse1, out2, lse2)
    ref_out, ref_lse, (ref_dq, ref_dk, ref_dv) = reference(q, k, v, dout, [(0, t, 0, t, True)], scale)
    assert_close(out, ref_out, tol, 0, "merged out")
    assert_close(lse, ref_lse, tol, 0, "merged lse")
    dq1, dk1, dv1 = kernel.backward(dout, q, k[:half], v[:half], out, lse, own, scale)
    dq2, dk2, dv2 = kernel.backward(dout, q, k[half:], v[half:], out, lse, peer, scale)
    assert_close(dq1 + dq2, ref_dq, tol, 0, "dq")
    assert_close(torch.cat([dk1, dk2]), ref_dk, tol, 0, "dk")
    assert_close(torch.cat([dv1, dv2]), ref_dv, tol, 0, "dv")


def check_strided_inputs_and_empty_tensors(kernel: AttentionKernel) -> None:
    """q/k/v as slices of one packed tensor, a stride-0 dout (from .sum()), and zero-length inputs."""
    t, h, d = 70, 4, 16
    qkv = torch.randn(t, 3 * h + 1, d, dtype=torch.float64)
    q, k, v = qkv[:, :h], qkv[:, h:2 * h:2], qkv[:, 2 * h + 1:3 * h + 1:2]  # h_kv = 2, strided heads
    blocks = [(0, t, 0, t, True)]
    dout = torch.ones(1, dtype=torch.float64).expand(t, h, d)
    out, lse = kernel.forward(q, k, v, AttentionBlocks.from_list(blocks), 0.25)
    grads = kernel.backward(dout, q, k, v, out, lse.T.contiguous().T, AttentionBlocks.from_list(blocks), 0.25)
    ref_out, ref_lse, ref_grads = reference(q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous(),
                                            blocks, 0.25)
    assert_close(out, ref_out, 1e-10, 0, "out")
    for grad, ref in zip(grads, ref_grads):
        assert_close(grad, ref, 1e-10, 0, "grad")
    empty_q, empty_kv = torch.zeros(0, h, d), torch.zeros(0, 2, d)
    out, lse = kernel.forward(empty_q, empty_kv, empty_kv, AttentionBlocks(), 1.0)
    assert out.shape == (0, h, d) and lse.shape == (h, 0)
    dq, dk, dv = kernel.backward(empty_q, empty_q, empty_kv, empty_kv, out, lse, AttentionBlocks(), 1.0)
    assert dq.shape == (0, h, d) and dk.shape == dv.shape == (0, 2, d)


BAD_INPUTS = [
    (dict(q=torch.zeros(4, 2, 8, dtype=torch.int32), k=torch.zeros(4, 2, 8, dtype=torch.int32),
          v=torch.zeros(4, 2, 8, dtype=torch.int32)), "not supported"),
    (dict(q=torch.zeros(4, 16)), r"layout \[t, h, d\]"),
    (dict(q=torch.zeros(4, 3, 8)), "multiple of h_kv"),
    (dict(k=torch.zeros(4, 2, 8, dtype=torch.float64)), "share a dtype"),
    (dict(v=torch.zeros(5, 2, 8)), "same shape"),
    (dict(q=torch.zeros(4, 2, 4)), "head_dim"),
    (dict(blocks=AttentionBlocks.from_list([(0, 5, 0, 4, True)])), "out of bounds"),
]


def check_rejects_bad_input(kernel: AttentionKernel, bad: dict, match: str) -> None:
    """Forward and backward raise ValueError(match) for one entry of BAD_INPUTS."""
    args = dict(q=torch.zeros(4, 2, 8), k=torch.zeros(4, 2, 8), v=torch.zeros(4, 2, 8),
                blocks=AttentionBlocks.from_list([(0, 4, 0, 4, True)]))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        kernel.forward(args["q"], args["k"], args["v"], args["blocks"], 1.0)
    with pytest.raises(ValueError, match=match):  # input checks run before backward's own shape checks
        kernel.backward(args["q"], args["q"], args["k"], args["v"], args["q"], torch.zeros(0), args["blocks"], 1.0)


def check_backward_rejects_mismatched_out_and_lse(kernel: AttentionKernel) -> None:
    q = k = v = torch.zeros(4, 2, 8)
    blocks = AttentionBlocks.from_list([(0, 4, 0, 4, True)])
    with pytest.raises(ValueError, match="lse must have shape"):
        kernel.backward(q, q, k, v, q, torch.zeros(4, 2), blocks, 1.0)
    with pytest.raises(ValueError, match="dout must have shape"):
        kernel.backward(q[:3], q, k, v, q, torch.zeros(2, 4), blocks, 1.0)
