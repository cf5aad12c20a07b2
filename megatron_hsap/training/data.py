"""Training data: Megatron-Core GPT datasets and the deterministic micro-batch order.

Datasets come from ``BlendedMegatronDatasetBuilder`` (``GPTDataset`` over indexed
datasets, ``MockGPTDataset`` for ``--mock-data``, or the embedded stdlib corpus).
Sample order follows Megatron's pretraining sampler: iteration ``i``, micro-batch
``m`` on data-parallel rank ``d`` reads samples
``i*GBS + (m*DP + d)*MBS ... + MBS``, so a run resumed at iteration k reads exactly
what the uninterrupted run read, whatever the TP/PP/CP sizes.

Bad data stops the run before training (``dataset_check``: damaged files, token ids
beyond the vocabulary) and, should anything slip through, before the embedding
(``micro_batches`` checks every micro-batch's ids).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Dict, Iterator, List

import torch
import torch.distributed as dist

from megatron_hsap.training.arguments import data_path_prefixes
from megatron_hsap.training.corpus import default_cache_dir, ensure_stdlib_corpus
from megatron_hsap.training.dataset_check import check_token_ids

__all__ = ["build_train_dataset", "micro_batches"]


def build_train_dataset(args: argparse.Namespace, tokenizer: Any) -> Any:
    """The training split as a Megatron ``GPTDataset`` with ``train_iters x global_batch_size`` samples.

    Builds (rank 0, then a barrier) the embedded corpus when no --data-path/--mock-data is given;
    that corpus always uses EOD document boundaries and EOD loss masking.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.datasets.utils import get_blend_from_list

    cache = args.data_cache_path or default_cache_dir()
    data_path = args.data_path
    if data_path is None and not args.mock_data:
        if dist.get_rank() == 0:
            ensure_stdlib_corpus(cache, tokenizer.eod, tokenizer.vocab_size)
        dist.barrier()
        data_path = [ensure_stdlib_corpus(cache, tokenizer.eod, tokenizer.vocab_size)]
        args.reset_attention_mask = True
        args.eod_mask_loss = True
    for prefix in data_path_prefixes(data_path or []):
        if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
            raise ValueError(f"--data-path {prefix!r}: .bin/.idx not found")
    _check_vocabulary(data_path_prefixes(data_path or []), tokenizer.vocab_size)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length,
        blend=get_blend_from_list(data_path) if data_path else None, split=args.split,
        path_to_cache=os.path.join(cache, "indices"), tokenizer=tokenizer,
        reset_position_ids=args.reset_attention_mask, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=False)
    cls = MockGPTDataset if args.mock_data else GPTDataset
    num_samples = args.train_iters * args.global_batch_size
    train, _, _ = BlendedMegatronDatasetBuilder(cls, [num_samples, 0, 0], lambda: True, config).build()
    if train is None or len(train) < num_samples:
        raise ValueError(f"the training split has {0 if train is None else len(train)} samples, fewer than "
                         f"--train-iters x --global-batch-size = {num_samples}; check --split and --data-path")
    return train


def _check_vocabulary(prefixes: List[str], vocab_size: int) -> None:
    """Rank 0 scans every dataset's token ids; all ranks raise the same ValueError if one is out of range."""
    problem = [""]
    if dist.get_rank() == 0:
        try:
            for prefix in prefixes:
                check_token_ids(prefix, vocab_size)
        except ValueError as err:
            problem[0] = f"--data-path: {err}"
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise ValueError(problem[0])


def micro_batches(dataset: Any, args: argparse.Namespace, data_parallel_rank: int, start_iteration: int,
                  vocab_size: int) -> Iterator[Dict[str, torch.Tensor]]:
    """Yield this DP rank's micro-batches from ``start_iteration`` on, in Megatron's sampler order.

    Each item holds ``tokens``, ``labels``, ``loss_mask`` as ``[micro_batch_size, seq_length]``
    (the same on every TP/PP/CP rank of this DP rank). A token id outside ``[0, vocab_size)`` raises
    ValueError naming the iteration and samples, before the ids reach the embedding.
    """
    gbs, mbs, dp = args.global_batch_size, args.micro_batch_size, args.data_parallel_size
    for iteration in range(start_iteration, args.train_iters):
        for micro in range(args.num_microbatches):
            first = iteration * gbs + (micro * dp + data_parallel_rank) * mbs
            samples = [dataset[i] for i in range(first, first + mbs)]
            batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples])
                     for key in ("tokens", "labels", "loss_mask")}
            for key in ("tokens", "labels"):
                ids = batch[key]
                if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                    bad = ids[(ids < 0) | (ids >= vocab_size)][0]
                    raise ValueError(f"iteration {iteration + 1}: samples {first}..{first + mbs - 1} hold {key} id "
                                     f"{int(bad)}, outside the vocabulary [0, {vocab_size}); the data does not "
                                     "match the tokenizer")
            yield batch
