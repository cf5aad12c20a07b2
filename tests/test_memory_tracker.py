"""The peak-memory tracker against allocations whose sizes are known exactly."""

from __future__ import annotations

import pytest
import torch

from megatron_hsap.instrumentation.memory import track_peak_memory
from megatron_hsap.kernels.base import AttentionBlocks
from megatron_hsap.kernels.torch_kernel import TILE_K, TILE_Q, TorchAttentionKernel

F32 = 4


def test_known_allocations_frees_and_views():
    before = torch.zeros(1000)  # live at entry: never counted, nor are ops that reuse it in place
    with track_peak_memory("cpu") as mem:
        a = torch.empty(1000)                      # +4000
        b = torch.zeros(2000)                      # +8000 -> 12000
        view = b[100:].view(-1, 2)
        view.add_(1)                               # view + in-place: no new storage
        before.mul_(2)                             # in-place on a pre-existing tensor: nothing
        assert (mem.current_bytes, mem.peak_bytes) == (12000, 12000)
        del a                                      # -4000 -> 8000
        c = torch.ones(500, dtype=torch.float64)   # +4000 -> 12000 (peak unchanged)
        d = before + 1                             # +4000 -> 16000
        assert (mem.current_bytes, mem.peak_bytes) == (16000, 16000)
        del b                                      # the view keeps b's storage alive
        assert mem.current_bytes == 16000
        del view                                   # -8000 -> 8000
        assert (mem.current_bytes, mem.peak_bytes) == (8000, 16000)
    del c, d
    assert (mem.current_bytes, mem.peak_bytes) == (8000, 16000), "values are frozen at exit"


def test_matmul_chain_forward_and_backward():
    """loss = ((x @ w1) @ w2).sum(); every byte below is one tensor autograd must create."""
    n, k, m, p = 8, 16, 32, 4
    x, w1, w2 = (torch.randn(*shape, requires_grad=True) for shape in ((n, k), (k, m), (m, p)))
    with track_peak_memory("cpu") as fwd:
        loss = ((x @ w1) @ w2).sum()
    h, out, scalar = n * m * F32, n * p * F32, F32
    assert fwd.peak_bytes == h + out + scalar  # while sum runs: h (saved for backward), out, loss
    assert fwd.current_bytes == h + scalar  # out is a temporary
    with track_peak_memory("cpu") as bwd:
        loss.backward()
    grads = (n * k + k * m + m * p) * F32  # x.grad, w1.grad, w2.grad stay alive
    # peak: the seed gradient (ones), dL/dh, and the three parameter gradients; h is freed before dL/dw1
    assert bwd.peak_bytes == scalar + n * m * F32 + grads
    assert bwd.current_bytes == grads  # seed and dL/dh are gone (h was allocated, and is counted, in `fwd`)
    del loss


def test_nested_regions_are_independent():
    with track_peak_memory("cpu") as outer:
        a = torch.empty(250)  # 1000
        with track_peak_memory("cpu") as inner:
            b = torch.empty(500)  # 2000
            del b
            c = torch.empty(100)  # 400
        assert (inner.peak_bytes, inner.current_bytes) == (2000, 400)
        del a
    assert (outer.peak_bytes, outer.current_bytes) == (3000, 400)
    del c


def test_kernel_memory_is_bounded_by_tiles():
    """The blockwise kernel never holds the full [h, t, t] score matrix."""
    t, h, d = TILE_Q * 2 + TILE_K, 2, 16
    q, k, v = (torch.randn(t, h, d) for _ in range(3))
    blocks = AttentionBlocks.from_list([(0, t, 0, t, True)])
    with track_peak_memory("cpu") as mem:
        out, lse = TorchAttentionKernel().forward(q, k, v, blocks, 0.25)
    full_scores = h * t * t * F32
    one_tile = h * TILE_Q * TILE_K * F32
    io = 6 * t * h * d * F32  # q/k/v copies, accumulator, output, and row statistics fit below this
    assert one_tile < mem.peak_bytes <= 3 * one_tile + io < full_scores / 2


def test_rejects_unknown_device():
    with pytest.raises(ValueError, match="not supported"):
        with track_peak_memory("meta"):
            pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA allocator path needs a GPU")
def test_cuda_known_allocations_and_nesting():
    mib = 1 << 20
    with track_peak_memory("cuda") as outer:
        a = torch.empty(8 * mib, dtype=torch.uint8, device="cuda")
        with track_peak_memory("cuda") as inner:
            b = torch.empty(4 * mib, dtype=torch.uint8, device="cuda")
            del b
        assert inner.peak_bytes == 4 * mib and inner.current_bytes == 0
        del a
    assert outer.peak_bytes == 12 * mib and outer.current_bytes == 0
