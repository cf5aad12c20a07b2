"""Training data: Megatron-Core GPT datasets and the deterministic micro-batch order.

Datasets come from ``BlendedMegatronDatasetBuilder`` (``GPTDataset`` over indexed
datasets, ``MockGPTDataset`` for ``--mock-data``, or the embedded stdlib corpus).
Sample order follows Megatron's pretraining sampler: iteration ``i``, micro-batch
``m`` on data-parallel rank ``d`` reads samples
``i*GBS + (m*DP + d)*MBS ... + MBS``, so a run resumed at iteration k reads exactly
what the uninterrupted run read, whatever the TP/PP/CP sizes.

Bad data stops the run before training (``dataset_check``: damaged files, index entries outside
the ``.bin``, token ids beyond the vocabulary) and, should anything slip through, before the embedding
(``micro_batches`` checks every micro-batch's ids).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_hsap.training.arguments import data_path_prefixes
from megatron_hsap.training.corpus import default_cache_dir, ensure_stdlib_corpus
from megatron_hsap.training.dataset_check import check_token_ids, dataset_fingerprint

__all__ = ["dataset_config", "split_sizes", "build_datasets", "micro_batch_indices", "micro_batch_at",
           "micro_batches"]


def dataset_config(args: argparse.Namespace, tokenizer: Any, data_path: Optional[List[str]]) -> Any:
    """The ``GPTDatasetConfig`` of the flags (Megatron-LM's names and meanings).

    ``data_path`` is the train blend (``--data-path`` or the embedded corpus; None with mock data).
    With ``--valid-data-path``/``--test-data-path`` every split has its own blend (``blend_per_split``,
    as Megatron-LM's per-split paths): ``data_path`` is the whole training set and ``--split`` is unused.
    """
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    per_split = [args.valid_data_path, args.test_data_path]
    if any(per_split) and data_path is not None:
        blend, split = None, None
        blend_per_split = [get_blend_from_list(data_path)] + [get_blend_from_list(p) if p else None
                                                               for p in per_split]
    else:
        blend, split, blend_per_split = (get_blend_from_list(data_path) if data_path else None), args.split, None
    cache = args.data_cache_path or default_cache_dir()
    # Megatron-Core names its cached sample indices after the configuration, not the files' content: keyed
    # by the datasets' fingerprint too, a dataset rewritten at the same prefix gets new indices.
    prefixes = [p for path in (data_path, args.valid_data_path, args.test_data_path) if path
                for p in data_path_prefixes(path)]
    indices = os.path.join(cache, "indices", dataset_fingerprint(prefixes)) if prefixes else os.path.join(cache,
                                                                                                          "indices")
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=split, path_to_cache=indices, tokenizer=tokenizer,
        reset_position_ids=args.reset_attention_mask, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=False)


def split_sizes(args: argparse.Namespace) -> List[int]:
    """Samples [train, valid, test] the run reads (Megatron-LM's ``train_valid_test_num_samples``).

    Validation runs every ``--eval-interval`` iterations and once after training, each time
    ``--eval-iters`` global batches that continue where the previous evaluation stopped; the
    test split is evaluated once.
    """
    evaluations = args.train_iters // args.eval_interval + 1 if args.eval_interval else 1
    return [args.train_iters * args.global_batch_size, evaluations * args.eval_iters * args.global_batch_size,
            args.eval_iters * args.global_batch_size]


def build_datasets(args: argparse.Namespace, tokenizer: Any) -> Tuple[Any, Optional[Any], Optional[Any]]:
    """Megatron ``GPTDataset``s (train, valid, test) sized by ``split_sizes``; valid/test are None when the
    flags give them no data (``--split`` weight 0 without a per-split path, or ``--eval-iters 0``).

    Builds (rank 0, then a barrier) the embedded corpus when no --data-path/--mock-data is given;
    that corpus always uses EOD document boundaries and EOD loss masking.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    if args.mock_data and (args.valid_data_path or args.test_data_path):
        raise ValueError("--valid-data-path/--test-data-path need real training data: drop --mock-data")
    cache = args.data_cache_path or default_cache_dir()
    data_path = args.data_path
    if data_path is None and not args.mock_data:
        if dist.get_rank() == 0:
            ensure_stdlib_corpus(cache, tokenizer.eod, tokenizer.vocab_size)
        dist.barrier()
        data_path = [ensure_stdlib_corpus(cache, tokenizer.eod, tokenizer.vocab_size)]
        args.reset_attention_mask = True
        args.eod_mask_loss = True
    paths = {"--data-path": data_path or [], "--valid-data-path": args.valid_data_path or [],
             "--test-data-path": args.test_data_path or []}
    for flag, path in paths.items():
        for prefix in data_path_prefixes(path):
            if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
                raise ValueError(f"{flag} {prefix!r}: .bin/.idx not found")
    _check_vocabulary([(flag, prefix) for flag, path in paths.items() for prefix in data_path_prefixes(path)],
                      tokenizer.vocab_size)
    config = dataset_config(args, tokenizer, data_path)
    cls = MockGPTDataset if args.mock_data else GPTDataset
    sizes = split_sizes(args)
    train, valid, test = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()
    if train is None or len(train) < sizes[0]:
        raise ValueError(f"the training split has {0 if train is None else len(train)} samples, fewer than "
                         f"--train-iters x --global-batch-size = {sizes[0]}; check --split and --data-path")
    if not args.eval_iters:
        return train, None, None
    return train, valid, test


def _check_vocabulary(prefixes: List[Tuple[str, str]], vocab_size: int) -> None:
    """Rank 0 scans every dataset's token ids (``(flag, prefix)`` pairs); all ranks raise the same ValueError
    if one is out of range."""
    problem = [""]
    if dist.get_rank() == 0:
        for flag, prefix in prefixes:
            try:
                check_token_ids(prefix, vocab_size)
            except ValueError as err:
                problem[0] = f"{flag}: {err}"
                break
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise ValueError(problem[0])


def micro_batch_indices(args: argparse.Namespace, start_iteration: int, stop_iteration: Optional[int] = None
                        ) -> range:
    """Numbers ``iteration * num_microbatches + micro`` of the micro-batches of iterations
    ``[start_iteration, stop_iteration)`` (0-based; default stop: ``--train-iters``), in reading order."""
    stop = args.train_iters if stop_iteration is None else stop_iteration
    return range(start_iteration * args.num_microbatches, stop * args.num_microbatches)


def micro_batch_at(dataset: Any, args: argparse.Namespace, data_parallel_rank: int, index: int, vocab_size: int,
                   label: str = "") -> Dict[str, torch.Tensor]:
    """This DP rank's micro-batch number ``index`` (``micro_batch_indices``), in Megatron's sampler order.

    Holds ``tokens``, ``labels``, ``loss_mask`` as ``[micro_batch_size, seq_length]`` (the same on every
    TP/PP/CP rank of this DP rank). A token id outside ``[0, vocab_size)`` raises ValueError naming the
    iteration (prefixed by ``label``, e.g. ``"validation "``) and samples, before the ids reach the embedding.
    """
    gbs, mbs, dp = args.global_batch_size, args.micro_batch_size, args.data_parallel_size
    iteration, micro = divmod(index, args.num_microbatches)
    first = iteration * gbs + (micro * dp + data_parallel_rank) * mbs
    samples = [dataset[i] for i in range(first, first + mbs)]
    batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in ("tokens", "labels", "loss_mask")}
    for key in ("tokens", "labels"):
        ids = batch[key]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            bad = ids[(ids < 0) | (ids >= vocab_size)][0]
            raise ValueError(f"{label}iteration {iteration + 1}: samples {first}..{first + mbs - 1} hold "
                             f"{key} id {int(bad)}, outside the vocabulary [0, {vocab_size}); the data "
                             "does not match the tokenizer")
    return batch


def micro_batches(dataset: Any, args: argparse.Namespace, data_parallel_rank: int, start_iteration: int,
                  vocab_size: int, stop_iteration: Optional[int] = None, label: str = ""
                  ) -> Iterator[Dict[str, torch.Tensor]]:
    """Yield this DP rank's micro-batches (``micro_batch_at``) of iterations ``[start_iteration, stop_iteration)``
    (default: up to ``--train-iters``), in Megatron's sampler order."""
    for index in micro_batch_indices(args, start_iteration, stop_iteration):
        yield micro_batch_at(dataset, args, data_parallel_rank, index, vocab_size, label)
