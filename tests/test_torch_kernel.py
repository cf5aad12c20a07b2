"""The pure-PyTorch kernel against the independent dense float64 reference (tests/reference.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_hsap.kernels import get_kernel
from megatron_hsap.kernels.base import AttentionBlocks
from megatron_hsap.kernels import torch_kernel
from megatron_hsap.kernels.torch_kernel import TorchAttentionKernel, _build_schedule
from tests.kernel_cases import (BAD_INPUTS, CASES, HEAD_DIMS, HEADS, check_backward_rejects_mismatched_out_and_lse,
                                check_case, check_rejects_bad_input, check_strided_inputs_and_empty_tensors,
                                check_two_calls_merged_like_a_ring_step, make_inputs)
from tests.reference import blocks_mask, dense_attention, hard_cases

# Tiles small enough that the shared cases (tests/kernel_cases.py) run tiling, skipping of hidden tiles,
# partly masked tiles and fused small blocks.
SMALL_TILES = dict(TILE_Q=32, TILE_K=64, FUSE_Q=16, FUSE_K=32)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Shrink the kernel's tiles (and drop cached schedules) so small cases exercise every code path."""
    for name, value in SMALL_TILES.items():
        monkeypatch.setattr(torch_kernel, name, value)
    torch_kernel._schedules.clear()
    yield
    torch_kernel._schedules.clear()


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("h_q,h_kv", HEADS)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_float64(name, h_q, h_kv, d):
    check_case(TorchAttentionKernel(), CASES[name], h_q, h_kv, d, torch.float64,
               atol=1e-10, rtol=0, grad_atol=1e-10, grad_rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_float32(name):
    check_case(TorchAttentionKernel(), CASES[name], 8, 2, 64, torch.float32,
               atol=1e-5, rtol=0, grad_atol=2e-5, grad_rtol=0)


@pytest.mark.parametrize("dtype,eps", [(torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)])
@pytest.mark.parametrize("name", ["causal_multi_tile", "overlapping_query_rows", "packed_documents"])
def test_matches_reference_low_precision(name, dtype, eps):
    # The reference sees the same rounded inputs, and the kernel accumulates in float32, so the output's
    # error is its final rounding (half an ulp: eps/2 relative) plus float32 noise. The gradients are
    # float32 but use the rounded `out` in D = rowsum(dout * out): an eps-relative error in D, i.e.
    # about eps * |dout| * |out| per score gradient, bounded here by 4 * eps absolute.
    check_case(TorchAttentionKernel(), CASES[name], 8, 2, 64, dtype,
               atol=1e-5, rtol=eps, grad_atol=4 * eps, grad_rtol=eps)


def test_default_tiles_float64(monkeypatch):
    """The shipped tile sizes: a causal document spanning several default tiles, and fused short documents."""
    monkeypatch.undo()
    torch_kernel._schedules.clear()
    t = torch_kernel.TILE_Q + torch_kernel.TILE_K // 2 + 3
    check_case(TorchAttentionKernel(), (t, t, [(0, t, 0, t, True)]), 4, 2, 32, torch.float64, 1e-10, 0, 1e-10, 0)
    short = [(s, min(s + 7, 200), s, min(s + 7, 200), True) for s in range(0, 200, 7)]
    check_case(TorchAttentionKernel(), (200, 200, short), 4, 2, 32, torch.float64, 1e-10, 0, 1e-10, 0)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("h_q,h_kv", [(8, 1), (4, 4)])
def test_two_calls_merged_like_a_ring_step(dtype, tol, h_q, h_kv):
    check_two_calls_merged_like_a_ring_step(TorchAttentionKernel(), dtype, tol, h_q, h_kv)


def test_strided_inputs_and_empty_tensors():
    check_strided_inputs_and_empty_tensors(TorchAttentionKernel())


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


@pytest.mark.parametrize("bad,match", BAD_INPUTS)
def test_rejects_bad_inputs(bad, match):
    check_rejects_bad_input(TorchAttentionKernel(), bad, match)


def test_backward_rejects_mismatched_out_and_lse():
    check_backward_rejects_mismatched_out_and_lse(TorchAttentionKernel())


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
    q, k, v, _ = make_inputs(total, total, h_q, h_kv, d, torch.float64, seed=3)
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


def test_worked_mask_example_in_the_kernel_docstring_is_the_mask():
    """The matrices in ``AttentionBlocks``' docstring are what the reference mask (and so every kernel) computes."""
    lines = [line.strip() for line in AttentionBlocks.__doc__.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("causal, sq = 3, sk = 5"))
    rows = [line.split() for line in lines[start + 2:] if line[:1] == "q"]
    # three matrices side by side: causal 3x5, causal 5x3, causal + window (1, 0) 3x5
    pictures = [[r[1:6] for r in rows[:3]], [r[7:10] if i < 3 else r[1:4] for i, r in enumerate(rows)],
                [r[11:16] for r in rows[:3]]]
    blocks = [[(0, 3, 0, 5, True)], [(0, 5, 0, 3, True)], [(0, 3, 0, 5, True, (1, 0))]]
    for picture, block in zip(pictures, blocks):
        expected = torch.tensor([[int(x) for x in row] for row in picture], dtype=torch.bool)
        assert torch.equal(blocks_mask(block, *expected.shape), expected), (block, picture)
