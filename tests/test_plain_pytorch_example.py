"""examples/plain_pytorch_training.py (a plain PyTorch loop over ``context_parallel_varlen_attention``) on 2 gloo
ranks takes the same steps as one process with the fp64 dense reference attention (tests/reference.py): the
losses of every step and the parameters after them (so every gradient) agree."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tests.distributed import run_distributed

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "plain_pytorch_training.py")
STEPS = 4


def _example():
    spec = importlib.util.spec_from_file_location("plain_pytorch_training", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(dtype: torch.dtype, reference: bool, layout: str):
    import torch.distributed as dist

    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.parallel_state import initialize_model_parallel
    from tests.reference import dense_attention

    initialize_model_parallel(context_parallel_size=dist.get_world_size(), cp_config=ContextParallelConfig(mode="ring"))
    # one rank, contiguous layout: the local tokens are the global stream, the reference applies as is
    attention = (lambda q, k, v, cu: dense_attention(q, k, v, cu).to(q.dtype)) if reference else None
    return _example().train(STEPS, dtype, attention, layout)


def test_two_ranks_take_the_steps_of_the_fp64_reference():
    ref_losses, ref_params = run_distributed(_train, 1, torch.float64, True, "contiguous", timeout=120)[0]
    results = run_distributed(_train, 2, torch.float64, False, "zigzag", timeout=120)
    losses, params = results[0]
    assert torch.equal(params, results[1][1]), "the CP ranks' parameters diverged"
    assert losses == pytest.approx(ref_losses, rel=1e-10, abs=0), (losses, ref_losses)
    assert (params - ref_params).abs().max().item() < 1e-10
    assert losses[-1] < losses[0]  # it trains


def test_example_trains_in_fp32_on_two_ranks():
    losses, _ = run_distributed(_train, 2, torch.float32, False, None, timeout=120)[0]
    ref_losses, _ = run_distributed(_train, 1, torch.float64, True, "contiguous", timeout=120)[0]
    assert losses == pytest.approx(ref_losses, rel=1e-4), (losses, ref_losses)
