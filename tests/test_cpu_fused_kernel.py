"""The fused CPU kernel against the independent dense float64 reference (tests/reference.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_hsap.kernels import cpu_fused_kernel, get_kernel
from megatron_hsap.kernels.base import AttentionBlocks
from megatron_hsap.kernels.cpu_fused_kernel import CpuFusedAttentionKernel, _build_schedule
from tests.kernel_cases import (BAD_INPUTS, CASES, HEAD_DIMS, HEADS, check_backward_rejects_mismatched_out_and_lse,
                                check_case, check_rejects_bad_input, check_strided_inputs_and_empty_tensors,
                                check_two_calls_merged_like_a_ring_step)
from tests.reference import blocks_mask

pytestmark = pytest.mark.skipif(not CpuFusedAttentionKernel.is_available(),
                                reason="this torch build has no fused CPU attention operator")

# Layouts the operator cannot express with one call: bottom-right causal blocks with sq < sk and sq > sk
# (split into pieces merged by LSE), many tiny equal-shape blocks (stacked into one call) next to blocks
# of other shapes, several blocks on the same query rows, and rows that see no key.
FUSED_CASES = dict(CASES, **{
    "many_tiny_documents": (300, 300, [(s, s + 3, s, s + 3, True) for s in range(0, 297, 3)]
                            + [(297, 300, 297, 300, False)]),
    "tiny_blocks_sharing_rows": (60, 90, [(s, s + 2, s, s + 2, True) for s in range(0, 60, 2)]
                                 + [(s, s + 2, 60 + s // 2, 61 + s // 2, True) for s in range(0, 60, 2)]),
    "zigzag_chunks": (64, 128, [(0, 16, 0, 16, True), (16, 32, 112, 128, True), (0, 16, 32, 48, False),
                                (16, 32, 32, 48, False), (32, 48, 48, 64, True), (48, 64, 64, 80, True)]),
})


def _kernel() -> CpuFusedAttentionKernel:
    return CpuFusedAttentionKernel()


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("h_q,h_kv", HEADS)
@pytest.mark.parametrize("name", list(FUSED_CASES))
def test_matches_reference_float64(name, h_q, h_kv, d):
    check_case(_kernel(), FUSED_CASES[name], h_q, h_kv, d, torch.float64,
               atol=1e-10, rtol=0, grad_atol=1e-10, grad_rtol=0)


@pytest.mark.parametrize("name", list(FUSED_CASES))
def test_matches_reference_float32(name):
    check_case(_kernel(), FUSED_CASES[name], 8, 2, 64, torch.float32, atol=1e-5, rtol=0, grad_atol=2e-5, grad_rtol=0)


@pytest.mark.parametrize("dtype,eps", [(torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)])
@pytest.mark.parametrize("name", ["causal_fewer_queries_than_keys", "overlapping_query_rows", "many_tiny_documents"])
def test_matches_reference_low_precision(name, dtype, eps):
    # Half inputs are computed in float32: the output's error is its final rounding (eps/2 relative)
    # plus float32 noise; the gradients use the rounded `out` in D = rowsum(dout * out), an error of
    # about eps * |dout| * |out| per score gradient (see test_torch_kernel.py). Rows of 3-token documents
    # average few values, so |out| is larger than in long documents: 8 * eps absolute (the torch kernel
    # shows the same errors on these inputs).
    check_case(_kernel(), FUSED_CASES[name], 8, 2, 64, dtype, atol=1e-5, rtol=eps, grad_atol=8 * eps, grad_rtol=eps)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("h_q,h_kv", [(8, 1), (4, 4)])
def test_two_calls_merged_like_a_ring_step(dtype, tol, h_q, h_kv):
    check_two_calls_merged_like_a_ring_step(_kernel(), dtype, tol, h_q, h_kv)


def test_strided_inputs_and_empty_tensors():
    check_strided_inputs_and_empty_tensors(_kernel())


@pytest.mark.parametrize("name", list(FUSED_CASES))
def test_schedule_covers_exactly_the_mask(name):
    """The operator calls cover every attended pair once and nothing else; stacked pieces never share a row."""
    t_q, t_k, block_list = FUSED_CASES[name]
    covered = torch.zeros(t_q, t_k, dtype=torch.int64)
    for batch in _build_schedule(AttentionBlocks.from_list(block_list)):
        q_rows = torch.arange(t_q)[batch.q_rows].view(batch.count, batch.sq)
        k_rows = torch.arange(t_k)[batch.k_rows].view(batch.count, batch.sk)
        assert q_rows.unique().numel() == q_rows.numel(), "stacked pieces share query rows"
        visible = torch.ones(batch.sq, batch.sk, dtype=torch.bool)
        if batch.causal:  # the operator's top-left alignment: only used on square pieces
            assert batch.sq == batch.sk
            visible = visible.tril()
        for qr, kr in zip(q_rows, k_rows):
            covered[qr[:, None], kr[None, :]] += visible
    assert torch.equal(covered, blocks_mask(block_list, t_q, t_k).long())


def test_equal_documents_share_one_operator_call(monkeypatch):
    """2000 short documents of three lengths: three stacked calls forward and backward, not 2000."""
    lengths = [2, 5, 9] * 666 + [4, 4]
    bounds = torch.tensor([0] + lengths).cumsum(0).tolist()
    blocks = AttentionBlocks.from_list([(s, e, s, e, True) for s, e in zip(bounds, bounds[1:])])
    kernel = _kernel()
    calls = {"forward": 0, "backward": 0}

    def counted(op, name):
        def call(*args, **kwargs):
            calls[name] += 1
            return op(*args, **kwargs)
        return call

    monkeypatch.setattr(kernel, "_forward_op", counted(kernel._forward_op, "forward"))
    monkeypatch.setattr(kernel, "_backward_op", counted(kernel._backward_op, "backward"))
    t = bounds[-1]
    q = torch.randn(t, 2, 8, dtype=torch.float64)
    out, lse = kernel.forward(q, q, q, blocks, 0.5)
    kernel.backward(q, q, q, q, out, lse, blocks, 0.5)
    assert calls == {"forward": 4, "backward": 4}


def test_schedule_is_cached_per_block_structure():
    blocks = AttentionBlocks.from_list([(0, 8, 0, 8, True)])
    assert cpu_fused_kernel._schedule(blocks) is cpu_fused_kernel._schedule(AttentionBlocks.from_list([(0, 8, 0, 8, True)]))


def test_registry_and_auto_selection(caplog):
    kernel = get_kernel("cpu_fused")
    assert isinstance(kernel, CpuFusedAttentionKernel) and kernel.name == "cpu_fused"
    if torch.cuda.is_available():
        pytest.skip("'auto' prefers the CUDA kernels where CUDA is usable")
    get_kernel.cache_clear()
    with caplog.at_level(logging.INFO, logger="megatron_hsap.kernels"):
        assert isinstance(get_kernel("auto"), CpuFusedAttentionKernel)
        get_kernel("auto")
    assert [r.getMessage() for r in caplog.records].count("megatron_hsap: attention kernel 'auto' selected "
                                                          "'cpu_fused'") == 1


@pytest.mark.parametrize("bad,match", BAD_INPUTS + [
    (dict(q=torch.zeros(4, 2, 8, device="meta"), k=torch.zeros(4, 2, 8, device="meta"),
          v=torch.zeros(4, 2, 8, device="meta")), "CPU tensors only"),
])
def test_rejects_bad_inputs(bad, match):
    check_rejects_bad_input(_kernel(), bad, match)


def test_backward_rejects_mismatched_out_and_lse():
    check_backward_rejects_mismatched_out_and_lse(_kernel())
