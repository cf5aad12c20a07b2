#!/usr/bin/env python
"""Megatron-Bridge recipe: pretrain a tiny GPT with HSAP context parallelism through Bridge's ``pretrain()``.

Bridge builds the groups, model, optimizer, mock data and checkpoints; HSAP supplies the layer
spec, the topology over Bridge's groups and the forward step (megatron_hsap/training/bridge.py). Runs on
CPU ranks (gloo) or GPUs. Needs the Bridge environment (``make venv-bridge``):

    .venv-bridge/bin/torchrun --nproc-per-node 4 examples/bridge_pretrain_hsap.py --context-parallel-size 4

``--save DIR`` writes Bridge (torch_dist) checkpoints, ``--load DIR`` resumes from them;
``--exit-interval N`` stops (and saves) after N iterations, as an interrupted job would.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hsap.training.quiet import quiet_rank  # noqa: E402

quiet_rank(int(os.environ.get("RANK", "0")))  # before torch, Bridge and Megatron-Core: warnings from rank 0

import torch  # noqa: E402

from megatron_hsap.config import MODES, ContextParallelConfig  # noqa: E402
from megatron_hsap.megatron.cpu_shim import apply_bridge_cpu_shim  # noqa: E402


def tiny_gpt_recipe(context_parallel_size: int = 1, mode: str = "hsap", ulysses_size: Optional[int] = None,
                    train_iters: int = 4, seq_length: int = 64, micro_batch_size: int = 2, seed: int = 1234,
                    save: Optional[str] = None, load: Optional[str] = None, save_interval: int = 1000,
                    ranks_per_node: Optional[int] = None, documents: bool = True,
                    exit_interval: Optional[int] = None, global_batch_size: Optional[int] = None) -> Any:
    """A Bridge ``ConfigContainer`` for a 2-layer GPT on Bridge's mock GPT dataset, configured for HSAP.

    documents: documents end at EOD tokens (``reset_attention_mask``, ``reset_position_ids``), so every
    micro-batch is a packed stream of several documents; False: each sample is one sequence.
    Dropout is off, so runs with different CP sizes are comparable. exit_interval: stop (and save,
    with ``save``) after that many iterations, as an interrupted job would. global_batch_size: default
    one micro-batch (a multiple of micro_batch_size x data-parallel size is needed with DP > 1).
    """
    from megatron.bridge.models import GPTModelProvider
    from megatron.bridge.training.config import (CheckpointConfig, ConfigContainer, LoggerConfig,
                                                 MockGPTDatasetConfig, OptimizerConfig, RNGConfig, SchedulerConfig,
                                                 TrainingConfig)
    from megatron.bridge.training.tokenizers.config import TokenizerConfig

    from megatron_hsap.training.bridge import configure_hsap

    model = GPTModelProvider(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=4,
        seq_length=seq_length, vocab_size=None, make_vocab_size_divisible_by=64,
        context_parallel_size=context_parallel_size, position_embedding_type="rope",
        normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        cross_entropy_loss_fusion=False, bf16=False, params_dtype=torch.float32)
    cfg = ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=train_iters, global_batch_size=global_batch_size or micro_batch_size,
                             micro_batch_size=micro_batch_size, eval_interval=train_iters + 1, eval_iters=0,
                             exit_interval=exit_interval),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.01, bf16=False, fp16=False,
                                  use_distributed_optimizer=False, clip_grad=1.0),
        scheduler=SchedulerConfig(lr_decay_style="constant", lr_warmup_iters=0, start_weight_decay=0.01,
                                  end_weight_decay=0.01),
        dataset=MockGPTDatasetConfig(seq_length=seq_length, random_seed=seed, reset_attention_mask=documents,
                                     reset_position_ids=documents, eod_mask_loss=False, split="1,0,0",
                                     num_dataset_builder_threads=1, num_workers=0, dataloader_type="single",
                                     skip_getting_attention_mask_from_dataset=True),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=127),
        checkpoint=CheckpointConfig(save=save, load=load, save_interval=save_interval, ckpt_format="torch_dist",
                                    async_save=False, fully_parallel_save=False),
        rng=RNGConfig(seed=seed),
    )
    configure_hsap(cfg, ContextParallelConfig(mode=mode, ulysses_size=ulysses_size), ranks_per_node=ranks_per_node)
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--context-parallel-mode", choices=MODES, default="hsap")
    parser.add_argument("--ulysses-size", type=int, default=None)
    parser.add_argument("--train-iters", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--save", default=None)
    parser.add_argument("--load", default=None)
    parser.add_argument("--save-interval", type=int, default=1000)
    parser.add_argument("--exit-interval", type=int, default=None, help="stop (and save) after this many iterations")
    args = parser.parse_args()
    apply_bridge_cpu_shim()
    from megatron.bridge.training.pretrain import pretrain

    from megatron_hsap.training.bridge import forward_step

    cfg = tiny_gpt_recipe(args.context_parallel_size, args.context_parallel_mode, args.ulysses_size,
                          args.train_iters, args.seq_length, args.micro_batch_size, save=args.save, load=args.load,
                          save_interval=args.save_interval, exit_interval=args.exit_interval)
    pretrain(cfg, forward_step_func=forward_step)


if __name__ == "__main__":
    main()
