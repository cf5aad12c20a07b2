"""The GPU path checked on CPU, device-agnostically: where the model lives, which GPU a rank takes, what
per-plan tensors are copied to the device and how often, and that the hot path never waits for the device.

- Model placement: the ``meta`` device stands in for "the configured device" (``torch.cuda.current_device()``
  on a GPU), so a parameter or buffer left on the CPU shows, which the CPU shim's cuda->cpu mapping would hide.
- Device index: ``LOCAL_RANK % torch.cuda.device_count()``.
- Host synchronisation: a dispatch mode counts the operations that make the host wait for the device on
  CUDA (``.item()``, ``bool(tensor)``, ``nonzero``, ``.tolist()``, ``.cpu()``) during forward and backward.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.distributed import run_distributed_fresh

VOCAB, SEQ = 128, 64
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
         "--micro-batch-size", "1", "--vocab-size", str(VOCAB), "--tokenizer-type", "NullTokenizer",
         "--mock-data", "--train-iters", "20", "--lr", "1e-4"]


def _args() -> argparse.Namespace:
    from megatron_hsap.training.arguments import parse_args

    return parse_args(FLAGS, world_size=1)


# ---------------------------------------------------------------- defect 5: the device index

def test_local_rank_maps_onto_the_visible_gpus():
    from megatron_hsap.training.loop import local_device_index

    assert [local_device_index(rank, 1) for rank in range(4)] == [0, 0, 0, 0]  # several ranks on one GPU
    assert [local_device_index(rank, 8) for rank in (0, 7, 8, 13)] == [0, 7, 0, 5]
    with pytest.raises(ValueError, match="device_count=0"):
        local_device_index(0, 0)


def test_init_distributed_sets_the_shared_device(monkeypatch):
    """Rank 3 of 4 on a machine with one GPU sets device 0 (set_device(3) would fail there)."""
    from megatron_hsap.training import loop

    chosen = []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(loop.dist, "init_process_group", lambda **kwargs: None)
    loop._init_distributed(argparse.Namespace(distributed_backend="gloo", distributed_timeout_minutes=1))
    assert chosen == [0]


# ---------------------------------------------------------------- defect 1: every parameter on the model's device

def _model_devices_body() -> list:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hsap.megatron.cpu_shim import apply_cpu_shim
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.training import model as model_module
    from megatron_hsap.training.arguments import cp_config_from_args

    apply_cpu_shim()
    args = _args()
    initialize_model_parallel(context_parallel_size=1, cp_config=cp_config_from_args(args))
    model_parallel_cuda_manual_seed(args.seed)
    config = model_module.transformer_config(args)
    model_module.model_device = lambda: torch.device("meta")  # the configured device (a fresh process)
    chunks = model_module.build_model(args, config, cp_config_from_args(args), VOCAB)
    return sorted({f"{name}:{t.device}" for m in chunks for name, t in
                   list(m.module.named_parameters()) + list(m.module.named_buffers()) if t.device.type != "meta"})


def test_every_parameter_and_buffer_is_on_the_model_device_before_ddp():
    """Without TE the layer spec's norms are the CPU shim's torch norms: they must follow the model's device
    like every other parameter (Megatron's optimizer rejects CPU weights in a GPU run)."""
    (elsewhere,) = run_distributed_fresh(_model_devices_body, 1, timeout=180)
    assert elsewhere == []


def test_the_shim_norm_is_built_where_megatron_builds_its_layers(monkeypatch):
    """``use_cpu_initialization=False``: on ``torch.cuda.current_device()`` (here ``meta``), not on the CPU."""
    from megatron_hsap.megatron.cpu_shim import SequenceParallelTorchNorm

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "meta")
    for normalization in ("LayerNorm", "RMSNorm"):
        config = argparse.Namespace(normalization=normalization, sequence_parallel=False,
                                    use_cpu_initialization=False)
        norm = SequenceParallelTorchNorm(config, 16)
        assert {p.device.type for p in norm.parameters()} == {"meta"}, normalization
        config.use_cpu_initialization = True
        assert {p.device.type for p in SequenceParallelTorchNorm(config, 16).parameters()} == {"cpu"}
