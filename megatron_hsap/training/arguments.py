"""Megatron-LM-style command-line flags for ``pretrain_gpt_hsap.py``, validated before any process group exists.

Flag names and meanings follow Megatron-LM's ``arguments.py`` where they exist
there, plus the HSAP ones (``--context-parallel-mode``, ``--ulysses-size``,
``--head-chunk-size``, ``--cp-layout``, ``--attention-kernel``, ``--ranks-per-node``).
Every rank parses and validates the same flags, so a bad value stops all ranks
with the same message (exit code 2) before anything can hang.

Megatron-LM's own flags all parse (docs/training.md, "Megatron-LM flags"): the ones
that change nothing on this path are listed once as ignored (``args.compat_notes``,
printed by rank 0); the ones that would change results and are not supported are
errors naming the flag; Megatron-LM's context-parallel and attention-backend flags
map onto the HSAP ones.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from typing import List, Optional

from megatron_hsap.config import KERNELS, LAYOUTS, MODES, ContextParallelConfig
from megatron_hsap.sequence.plan import PLAN_CACHE_BYTES
from megatron_hsap.training.dataset_check import check_indexed_dataset
from megatron_hsap.training.tokenizer import TOKENIZER_TYPES, check_tokenizer_args, resolve_tokenizer_type

__all__ = ["DEMO_FLAGS", "IGNORED_FLAGS", "build_parser", "parse_args", "validate_args", "cp_config_from_args",
           "data_path_prefixes"]

#: Megatron-LM flags that change nothing on this path (performance, profiling, data-loader and TE-only
#: settings): accepted and listed once as ignored. flag -> nargs (0: a switch).
IGNORED_FLAGS = {
    "--use-mcore-models": 0, "--overlap-grad-reduce": 0, "--overlap-param-gather": 0,
    "--cross-entropy-loss-fusion": 0, "--manual-gc": 0, "--manual-gc-interval": 1,
    "--empty-unused-memory-level": 1, "--no-create-attention-mask-in-dataloader": 0,
    "--no-mmap-bin-files": 0, "--profile": 0, "--profile-step-start": 1, "--profile-step-end": 1,
    "--profile-ranks": "+", "--use-pytorch-profiler": 0, "--tp-comm-overlap": 0,
    "--no-gradient-accumulation-fusion": 0, "--no-masked-softmax-fusion": 0, "--no-bias-gelu-fusion": 0,
    "--no-bias-swiglu-fusion": 0, "--no-bias-dropout-fusion": 0, "--no-rope-fusion": 0,
    "--fp8-amax-history-len": 1, "--fp8-amax-compute-algo": 1, "--fp8-param-gather": 0,
    "--timing-log-level": 1, "--ddp-bucket-size": 1, "--ddp-average-in-collective": 0,
    "--accumulate-allreduce-grads-in-fp32": 0,
}
_IGNORED_HELP = "Megatron-LM's flag, accepted; changes nothing on this path (listed once at start-up)"
#: Megatron-LM flags that would change results and are not supported here -> why (an error naming the flag).
_UNSUPPORTED_FLAGS = {
    "fp16": ("--fp16", "fp16 training needs dynamic loss scaling with skipped iterations, which this loop "
                       "does not do; use --bf16 (or the fp32 default)"),
    "rampup_batch_size": ("--rampup-batch-size", "the global batch size is constant on this path; drop the flag"),
    "fp8_format": ("--fp8-format", "FP8 training is not supported on the HSAP path; use --bf16"),
    "apply_layernorm_1p": ("--apply-layernorm-1p", "zero-centred norm weights are not supported by the HSAP "
                                                   "layer spec; drop the flag"),
}
#: Megatron-LM's --cp-comm-type -> the HSAP --context-parallel-mode it means.
CP_COMM_TYPES = {"p2p": "ring", "a2a": "ulysses", "a2a+p2p": "hybrid"}
#: Megatron-LM's --attention-backend -> --attention-kernel (fused = TE's cuDNN attention; local = PyTorch).
ATTENTION_BACKENDS = {"auto": "auto", "flash": "flash", "fused": "te", "unfused": "torch", "local": "torch"}
#: Defaults of flags whose default depends on other flags (resolved by validate_args).
DEFAULT_TRAIN_ITERS = 100
DEFAULT_LR_WARMUP_ITERS = 10


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; allowed: 0, 1, 2, ...") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; allowed: 0, 1, 2, ...")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


class _Parser(argparse.ArgumentParser):
    """An error is two lines, where the flags are listed and the problem, not the 130 lines of usage text."""

    def format_usage(self) -> str:
        return f"usage: {self.prog} [flags]  (`{self.prog} --help` lists every flag)\n"


def build_parser() -> argparse.ArgumentParser:
    """Every flag, one function per argument group (``_add_*_args``, as Megatron-LM's ``arguments.py``)."""
    p = _Parser(
        prog="pretrain_gpt_hsap.py", allow_abbrev=False,
        description="Train a Megatron-Core GPT with HSAP context parallelism. With no --data-path and no "
                    "--mock-data it trains on the Python standard library's sources (byte-level tokens).")
    p.add_argument("--demo", action="store_true",
                   help="as the first flag: start from the embedded CPU demo preset (also used when no flag is given)")
    _add_model_args(p)
    _add_parallelism_args(p)
    _add_training_args(p)
    _add_data_args(p)
    _add_checkpointing_args(p)
    _add_logging_args(p)
    _add_ignored_megatron_args(p)
    add_sequence_chunk_args(p)
    add_evaluation_logging_args(p)
    return p


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    """Model shape and initialisation (Megatron-LM's network-size, regularization and initialization flags)."""
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=_positive_int, default=2, help="transformer layers")
    g.add_argument("--hidden-size", type=_positive_int, default=64,
                   help="model width; the head dimension is hidden size / attention heads")
    g.add_argument("--num-attention-heads", type=_positive_int, default=8,
                   help="query heads (any count works with any Ulysses size)")
    g.add_argument("--num-query-groups", type=_positive_int, default=None,
                   help="KV heads (grouped-query attention); default = --num-attention-heads (1 with "
                        "--group-query-attention, as Megatron-LM)")
    g.add_argument("--group-query-attention", action="store_true", help="Megatron-LM's switch for --num-query-groups")
    g.add_argument("--kv-channels", type=_positive_int, default=None,
                   help="head dimension; must be --hidden-size / --num-attention-heads (the default)")
    g.add_argument("--ffn-hidden-size", type=_positive_int, default=None, help="default 4 x hidden size")
    g.add_argument("--seq-length", type=_positive_int, default=256,
                   help="tokens per packed sample (the global sequence split over the CP ranks)")
    g.add_argument("--max-position-embeddings", type=_positive_int, default=None, help="default --seq-length")
    g.add_argument("--position-embedding-type", choices=("rope", "learned_absolute"), default="rope",
                   help="rope: rotary at each token's in-document position; learned_absolute: a table")
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base frequency")
    g.add_argument("--rotary-percent", type=float, default=1.0, help="must be 1.0 (rotary on the whole head)")
    g.add_argument("--apply-layernorm-1p", action="store_true", help="not supported (an error)")
    g.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default=None,
                   help="layer modules (default: transformer_engine with CUDA and TransformerEngine installed, "
                        "else local)")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm",
                   help="LayerNorm or RMSNorm")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (gated, as Llama)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="a separate output layer instead of the input embedding's transpose")
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in the linear layers (as Llama)")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="standard deviation of the weight initialisation")
    g.add_argument("--hidden-dropout", type=float, default=0.0, help="dropout after attention and MLP")
    g.add_argument("--attention-dropout", type=float, default=0.0,
                   help="dropout on attention probabilities; only 0 is supported with context parallelism")
    g.add_argument("--make-vocab-size-divisible-by", type=_positive_int, default=128,
                   help="pad the vocabulary to a multiple of this x TP (Megatron's padding)")
    g.add_argument("--layout-independent-init", action="store_true",
                   help="initialise every weight from its name and global (unsharded) shape, so runs with "
                        "different TP/PP sizes start from identical weights")


def _add_parallelism_args(parser: argparse.ArgumentParser) -> None:
    """TP / PP / CP sizes, the HSAP context-parallel flags and their Megatron-LM spellings, the launch."""
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=_positive_int, default=1,
                   help="TP: ranks sharing each layer's weights (innermost in the rank order)")
    g.add_argument("--pipeline-model-parallel-size", type=_positive_int, default=1, help="PP: pipeline stages")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=_positive_int, default=None,
                   help="enables the interleaved 1F1B schedule")
    g.add_argument("--context-parallel-size", type=_positive_int, default=1,
                   help="CP: ranks sharing each sequence (see --context-parallel-mode)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with TP > 1: shard norms and dropout over the TP ranks along the sequence")
    g.add_argument("--context-parallel-mode", choices=MODES + ("auto",), default=None,
                   help="default hsap, or what --cp-comm-type names; auto: the mode, Ulysses size and head chunks "
                        "the configurator predicts fastest within the memory (docs/configure.md)")
    g.add_argument("--cp-comm-type", nargs="+", choices=tuple(CP_COMM_TYPES) + ("allgather",), default=None,
                   help="Megatron-LM's name for the mode: p2p = ring, a2a = ulysses, a2a+p2p = hybrid (one type "
                        "for all layers)")
    g.add_argument("--hierarchical-context-parallel-sizes", nargs=2, type=_positive_int, default=None,
                   metavar=("A2A", "P2P"), help="with --cp-comm-type a2a+p2p: the Ulysses size and the ring size")
    g.add_argument("--ulysses-size", type=_positive_int, default=None,
                   help="all-to-all degree inside the CP group (default: per mode, see docs/training.md)")
    g.add_argument("--head-chunk-size", type=_positive_int, default=None,
                   help="query heads per UPipe stage (hsap default: the Ulysses size)")
    g.add_argument("--cp-kv-forwarding", action="store_true",
                   help="node-level K/V forwarding: a remote key/value row needed by several ring members of a "
                        "node crosses nodes once and is relayed inside the node (rings with several members per "
                        "node)")
    g.add_argument("--cp-layout", choices=LAYOUTS, default=None,
                   help="token placement (default: sequence-aware for hsap, zigzag otherwise)")
    g.add_argument("--attention-kernel", choices=KERNELS, default=None, help="default auto")
    g.add_argument("--attention-backend", choices=tuple(ATTENTION_BACKENDS), default=None,
                   help="Megatron-LM's name for the kernel: flash = flash, fused = te, unfused/local = torch")
    g.add_argument("--use-flash-attn", action="store_true", help="= --attention-kernel flash")
    g.add_argument("--ranks-per-node", type=_positive_int, default=None,
                   help="ranks per node; set it to emulate several nodes on one machine (default: LOCAL_WORLD_SIZE)")
    g.add_argument("--distributed-backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: NCCL with CUDA, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=_positive_float, default=10,
                   help="a collective waiting this long for a peer fails (fractions allowed, e.g. 0.5)")
    g.add_argument("--nproc", type=_positive_int, default=None,
                   help="when started without torchrun: spawn this many local ranks (CPU/gloo)")
    g.add_argument("--dry-run", type=_positive_int, default=None, metavar="WORLD_SIZE",
                   help="check the flags for a job of WORLD_SIZE ranks (--ranks-per-node per node, default 8), print "
                        "the resolved configuration and the predicted peak memory per GPU, and exit without "
                        "starting any process (no GPU or cluster needed)")
    g.add_argument("--print-args", action="store_true",
                   help="rank 0 prints every argument at start-up in Megatron-LM's layout")
    g.add_argument("--rank-failure-grace-seconds", type=_non_negative_float, default=10.0,
                   help="with --nproc: after one rank fails, the others get this long to exit, then are killed")
    g.add_argument("--stall-timeout-minutes", type=_non_negative_float, default=None,
                   help="with --nproc: when no rank advances (changes phase) for this long, print every rank's "
                        "stack, name the rank that stopped advancing and stop the job (status 124); 0 turns it "
                        "off (default: twice --distributed-timeout-minutes)")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    """Batch sizes, length, learning-rate schedule, optimizer, precision and recompute."""
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=_positive_int, default=1,
                   help="samples per micro-batch and data-parallel rank")
    g.add_argument("--global-batch-size", type=_positive_int, default=None, help="default micro x data-parallel")
    g.add_argument("--rampup-batch-size", nargs=3, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="not supported (an error)")
    g.add_argument("--train-iters", type=_positive_int, default=None, help=f"default {DEFAULT_TRAIN_ITERS}")
    g.add_argument("--train-samples", type=_positive_int, default=None,
                   help="instead of --train-iters: iterations = samples // global batch size (as Megatron-LM)")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=3e-4, help="learning rate at the end of the decay")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="peak learning rate of the embedding and output layers (default --lr)")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="with --decoupled-lr: their minimum learning rate (default --min-lr)")
    g.add_argument("--lr-warmup-iters", type=_non_negative_int, default=None,
                   help=f"default min({DEFAULT_LR_WARMUP_ITERS}, --train-iters / 10) with --train-iters")
    g.add_argument("--lr-warmup-samples", type=_non_negative_int, default=None, help="with --train-samples")
    g.add_argument("--lr-warmup-fraction", type=_non_negative_float, default=None,
                   help="warmup as a fraction of the decay length")
    g.add_argument("--lr-decay-iters", type=_positive_int, default=None, help="default --train-iters")
    g.add_argument("--lr-decay-samples", type=_positive_int, default=None, help="default --train-samples")
    g.add_argument("--lr-decay-style", choices=("cosine", "linear", "constant"), default="cosine",
                   help="shape of the decay after warm-up")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    g.add_argument("--adam-beta2", type=float, default=0.95, help="Adam beta2")
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="clip the global gradient norm to this (0: no clipping)")
    g.add_argument("--seed", type=int, default=1234, help="random seed (weights, data order, dropout)")
    precision = g.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true",
                           help="bf16 weights and activations with fp32 main weights in the optimizer")
    precision.add_argument("--fp32", action="store_true", help="the default; listed for Megatron compatibility")
    precision.add_argument("--fp16", action="store_true", help="not supported (an error naming --bf16)")
    g.add_argument("--fp8-format", choices=("e4m3", "hybrid"), default=None, help="not supported (an error)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16: reduce gradients over data-parallel ranks in bf16 (default fp32)")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="accepted where it equals this loss: every micro-batch has the same number of loss tokens")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the optimizer state over the data-parallel x CP ranks (ZeRO-1)")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="full: recompute whole layers in the backward; selective: recompute the attention core")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default="uniform",
                   help="with full: uniform or block (which layers are recomputed)")
    g.add_argument("--recompute-num-layers", type=_positive_int, default=1,
                   help="with full: layers per recompute unit (uniform) or recomputed layers per stage (block)")
    g.add_argument("--recompute-activations", action="store_true", help="= --recompute-granularity selective")


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    """Datasets, tokenizer, document boundaries and the data-loader workers."""
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="indexed dataset prefix(es), optionally weighted: [w1] p1 [w2] p2 ...")
    g.add_argument("--split", default="969,30,1",
                   help="train,valid,test weights of --data-path (or of the embedded corpus)")
    add_tokenizer_args(g)
    g.add_argument("--mock-data", action="store_true",
                   help="random tokens instead of a dataset (Megatron's MockGPTDataset)")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="documents end at EOD tokens inside a sample (packed documents); default on for the "
                        "embedded corpus")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="positions restart after EOD; that is what --reset-attention-mask does here, so it needs it")
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on EOD input tokens")
    g.add_argument("--data-cache-path", default=None,
                   help="where dataset indices and the embedded corpus are cached (default ~/.cache/megatron_hsap)")
    g.add_argument("--plan-cache-mb", type=_non_negative_float, default=PLAN_CACHE_BYTES / (1 << 20),
                   help="memory per process for cached sequence plans (least recently used evicted; a batch of many "
                        "short documents has a plan of tens of MB); 0 caches none")
    g.add_argument("--num-workers", type=_non_negative_int, default=2,
                   help="data-loader worker processes that read and plan the micro-batches ahead (as Megatron-LM's, "
                        "default 2); 0: read in the training process and plan in a thread there")


def _add_checkpointing_args(parser: argparse.ArgumentParser) -> None:
    """Save / load, and the exits (interval, duration, signals, NaN/Inf) that save first."""
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="checkpoint directory to save into")
    g.add_argument("--load", default=None, help="checkpoint directory to resume from (the newest complete iteration)")
    g.add_argument("--save-interval", type=_positive_int, default=None,
                   help="save every this many iterations (and at the end)")
    g.add_argument("--no-load-optim", action="store_true",
                   help="on --load, restore the weights but not the optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="do not restore the RNG states from --load")
    g.add_argument("--finetune", action="store_true",
                   help="load only the model weights and start at iteration 0 (no optimizer, RNG or scheduler)")
    g.add_argument("--override-opt_param-scheduler", dest="override_opt_param_scheduler", action="store_true",
                   help="on --load, use the learning-rate schedule these flags describe, not the checkpoint's "
                        "(Megatron-LM's flag; by default the checkpoint's schedule continues, and a start-up note "
                        "says what it does when the flags ask for another)")
    g.add_argument("--use-checkpoint-opt_param-scheduler", dest="use_checkpoint_opt_param_scheduler",
                   action="store_true", help="the default here (Megatron-LM's flag): keep the checkpoint's schedule")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model-shape flags from the --load checkpoint")
    g.add_argument("--ckpt-format", choices=("torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"),
                   default="torch_dist", help="only torch_dist (the default) is supported")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="save the distributed-optimizer state as 'fully_reshardable' (gathered per parameter; "
                        "reloads at any TP/PP/DP/CP size) instead of 'dp_reshardable' (no gather; reloads at "
                        "other DP x CP sizes only)")
    g.add_argument("--exit-interval", type=_positive_int, default=None,
                   help="stop at the first iteration divisible by this (saving first when --save is given)")
    g.add_argument("--exit-duration-in-mins", type=_non_negative_float, default=None,
                   help="stop (saving first when --save is given) after the iteration that ends this many "
                        "minutes after start-up")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal to any rank: all ranks finish the iteration, save (--save) and exit 0")
    g.add_argument("--exit-signal", nargs="+", choices=("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"),
                   default=["SIGTERM", "SIGUSR1"], help="the signal(s) --exit-signal-handler handles")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_true", default=True,
                   help="stop with an error naming iteration, rank and layer when a loss or gradient is NaN/Inf, "
                        "before the optimizer step (default on)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", help="do not stop on a NaN/Inf loss or gradient")


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    """The iteration line, TensorBoard and the JSON log (evaluation and W&B: ``add_evaluation_logging_args``)."""
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=_positive_int, default=1,
                   help="print the iteration line every this many iterations")
    g.add_argument("--tensorboard-dir", default=None, help="write Megatron-LM's scalars here (needs tensorboard)")
    g.add_argument("--no-progress-bar", action="store_true", help="no progress bar before the iteration lines")
    g.add_argument("--log-json", default=None, help="write one JSON record per iteration to this file (rank 0)")


def _add_ignored_megatron_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's flags that change nothing here (``IGNORED_FLAGS``): accepted, listed once."""
    g = parser.add_argument_group("Megatron-LM flags without effect on this path (accepted, listed once as ignored)")
    for flag, nargs in IGNORED_FLAGS.items():
        if nargs == 0:
            g.add_argument(flag, action="store_const", const=True, default=None, help=_IGNORED_HELP)
        else:
            g.add_argument(flag, nargs=None if nargs == 1 else nargs, default=None, help=_IGNORED_HELP)


def add_tokenizer_args(group: argparse._ActionsContainer) -> None:
    """Megatron-LM's tokenizer flags (shared with tools/preprocess_data.py)."""
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                       help="default: GPT2BPETokenizer with --vocab-file and --merge-file, else ByteLevelTokenizer")
    group.add_argument("--tokenizer-model", default=None,
                       help="local path: a Hugging Face tokenizer directory, a SentencePiece or tiktoken model")
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer's merges.txt")
    group.add_argument("--vocab-size", type=_positive_int, default=None, help="for NullTokenizer (and TikTokenizer)")
    group.add_argument("--tiktoken-pattern", default=None, help="for TikTokenizer (v1 or v2)")


#: The embedded default (``python pretrain_gpt_hsap.py`` with no flags, or ``--demo [overrides]``): a small
#: GPT on the stdlib corpus, hsap over 8 forked CPU ranks emulating 2 nodes of 4; ~3 minutes on 2 cores. Micro-batches
#: of 2 samples pack 2 x 1024 tokens into one plan, so a plan holds many of the corpus's documents.
DEMO_FLAGS = ["--nproc", "8", "--ranks-per-node", "4", "--context-parallel-size", "8",
              "--context-parallel-mode", "hsap", "--num-layers", "2", "--hidden-size", "64",
              "--num-attention-heads", "8", "--seq-length", "1024", "--micro-batch-size", "2",
              "--global-batch-size", "2", "--train-iters", "150", "--lr", "3e-3", "--min-lr", "3e-4",
              "--log-interval", "10", "--eval-iters", "10"]


def parse_args(argv: Optional[List[str]] = None, world_size: Optional[int] = None) -> argparse.Namespace:
    """Parse and validate; on a bad flag prints ``error: ...`` and exits with status 2 (argparse's convention).

    No flags at all, or ``--demo`` first, selects ``DEMO_FLAGS`` (flags after ``--demo`` override them).
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] == "--demo":
        argv = DEMO_FLAGS + argv[1:]
    args = parser.parse_args(argv)
    if args.demo:
        parser.error("--demo must be the first flag (later flags override the preset)")
    if world_size is None:
        world_size = args.dry_run or int(os.environ.get("WORLD_SIZE", args.nproc or 1))
    try:
        if args.use_checkpoint_args:
            from megatron_hsap.training.checkpoint import load_args_from_checkpoint

            load_args_from_checkpoint(args, parser)
        validate_args(args, world_size)
    except ValueError as err:
        parser.error(str(err))
    return args


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Fill derived defaults, map Megatron-LM's flags and reject inconsistent sizes (ValueError naming the flag).

    Sets ``args.compat_notes``: lines for rank 0 to print once (flags ignored or turned off on this path).
    The checks run in one fixed order (parallel sizes, model shape, batch sizes, training length, data,
    tokenizer, checkpointing and launch, context-parallel mode), so a command line with several mistakes
    reports the same first one every time.
    """
    args.compat_notes = []
    _map_megatron_flags(args)
    _resolve_parallel_sizes(args, world_size)
    _check_model_shape(args)
    _resolve_batch_sizes(args)
    _resolve_training_length(args)
    _check_per_token_loss(args)
    if args.attention_dropout != 0.0:
        raise ValueError("--attention-dropout must be 0.0: HSAP attention has no dropout")
    if args.data_path is not None and args.mock_data:
        raise ValueError("--data-path and --mock-data are mutually exclusive")
    validate_evaluation_logging_args(args)
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr ({args.min_lr:g}) must not exceed --lr ({args.lr:g})")
    _check_data_paths(args)
    _resolve_tokenizer(args)
    _check_checkpoint_and_launch_args(args)
    if args.context_parallel_mode == "auto":
        from megatron_hsap.training.auto_mode import resolve_auto_mode

        args.compat_notes.append(resolve_auto_mode(args))
    _check_ulysses_fits_a_node(args, world_size)
    resolve_sequence_chunks(args)
    if args.ignored_flags:
        args.compat_notes.append(f"ignored on this path: {', '.join(args.ignored_flags)}")


def _resolve_parallel_sizes(args: argparse.Namespace, world_size: int) -> None:
    """``args.world_size`` and ``args.data_parallel_size`` from the TP x PP x CP sizes."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if world_size % (tp * pp * cp) != 0:
        raise ValueError(f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
                         f"--pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp}); start a multiple "
                         f"of {tp * pp * cp} processes: --nproc {tp * pp * cp} on CPU, or torchrun --nproc-per-node "
                         f"on GPUs")
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * pp * cp)


def _check_model_shape(args: argparse.Namespace) -> None:
    """Heads, sequence length and layers against TP, CP and PP (fills --num-query-groups and
    --max-position-embeddings; turns --sequence-parallel off with TP 1, as Megatron-LM)."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    if args.num_attention_heads % args.num_query_groups != 0:
        raise ValueError(f"--num-attention-heads ({args.num_attention_heads}) must be a multiple of "
                         f"--num-query-groups ({args.num_query_groups})")
    if args.hidden_size % args.num_attention_heads != 0:
        raise ValueError(f"--hidden-size ({args.hidden_size}) must be divisible by --num-attention-heads "
                         f"({args.num_attention_heads})")
    for flag, heads in (("--num-attention-heads", args.num_attention_heads),
                        ("--num-query-groups", args.num_query_groups)):
        if heads % tp != 0:
            raise ValueError(f"{flag} ({heads}) must be divisible by --tensor-model-parallel-size ({tp})")
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False
        args.compat_notes.append("--sequence-parallel has no effect with --tensor-model-parallel-size 1: turned off "
                                 "(as Megatron-LM does)")
    if args.sequence_parallel and args.seq_length % (tp * cp) != 0:
        raise ValueError(f"--seq-length ({args.seq_length}) must be divisible by --tensor-model-parallel-size x "
                         f"--context-parallel-size ({tp} x {cp}) with --sequence-parallel")
    if cp > 1 and args.seq_length % (2 * cp) != 0:
        raise ValueError(f"--seq-length ({args.seq_length}) must be divisible by 2 x --context-parallel-size "
                         f"(= {2 * cp}) so every layout can split it into equal chunks")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise ValueError(f"--seq-length ({args.seq_length}) exceeds --max-position-embeddings "
                         f"({args.max_position_embeddings})")
    if args.num_layers % pp != 0:
        raise ValueError(f"--num-layers ({args.num_layers}) must be divisible by --pipeline-model-parallel-size ({pp})")
    if args.num_layers_per_virtual_pipeline_stage is not None:
        if pp < 2:
            raise ValueError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
        if (args.num_layers // pp) % args.num_layers_per_virtual_pipeline_stage != 0:
            raise ValueError(f"layers per pipeline stage ({args.num_layers // pp}) must be divisible by "
                             f"--num-layers-per-virtual-pipeline-stage ({args.num_layers_per_virtual_pipeline_stage})")


def _resolve_batch_sizes(args: argparse.Namespace) -> None:
    """--global-batch-size (default micro x data-parallel) and ``args.num_microbatches``."""
    pp = args.pipeline_model_parallel_size
    mbs_dp = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs_dp
    if args.global_batch_size % mbs_dp != 0:
        raise ValueError(f"--global-batch-size ({args.global_batch_size}) must be divisible by --micro-batch-size x "
                         f"data-parallel size ({args.micro_batch_size} x {args.data_parallel_size})")
    args.num_microbatches = args.global_batch_size // mbs_dp
    if args.num_layers_per_virtual_pipeline_stage is not None and args.num_microbatches % pp != 0:
        raise ValueError(f"the interleaved schedule needs the number of micro-batches ({args.num_microbatches}) "
                         f"to be divisible by --pipeline-model-parallel-size ({pp})")


def _check_data_paths(args: argparse.Namespace) -> None:
    """Weights and the .bin/.idx files of --data-path, --valid-data-path and --test-data-path."""
    for flag, paths in (("--data-path", args.data_path), ("--valid-data-path", args.valid_data_path),
                        ("--test-data-path", args.test_data_path)):
        _check_weights(flag, paths or [])
        for prefix in data_path_prefixes(paths or []):
            missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if missing:
                raise ValueError(f"{flag}: {', '.join(missing)} not found; build it with tools/preprocess_data.py, "
                                 "or use --mock-data, or omit --data-path to train on the embedded corpus")
            check_indexed_dataset(prefix)


def _resolve_tokenizer(args: argparse.Namespace) -> None:
    """--tokenizer-type (implied by --vocab-file) and the files or sizes it needs; the embedded corpus is bytes."""
    implied = args.tokenizer_type is None and args.vocab_file is not None
    args.tokenizer_type = resolve_tokenizer_type(args.tokenizer_type, args.vocab_file, args.merge_file)
    try:
        check_tokenizer_args(args.tokenizer_type, args.tokenizer_model, args.vocab_size, args.vocab_file,
                             args.merge_file)
    except ValueError as err:
        raise ValueError(f"--vocab-file without --tokenizer-type: {err}" if implied else str(err)) from err
    if args.tiktoken_pattern is not None and args.tokenizer_type != "TikTokenizer":
        args.ignored_flags.append("--tiktoken-pattern")
    if args.data_path is None and not args.mock_data and args.tokenizer_type != "ByteLevelTokenizer":
        raise ValueError("without --data-path the embedded corpus is used, which needs --tokenizer-type "
                         "ByteLevelTokenizer; pass --data-path (or --mock-data) to use another tokenizer")


def _check_checkpoint_and_launch_args(args: argparse.Namespace) -> None:
    """--save-interval needs --save, --load is a directory, --nproc agrees with the launcher's WORLD_SIZE."""
    if args.save_interval is not None and args.save is None:
        raise ValueError("--save-interval needs --save")
    if args.load is not None and os.path.exists(args.load) and not os.path.isdir(args.load):
        raise ValueError(f"--load {args.load!r} is not a directory")
    if args.nproc is not None and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) != args.nproc:
        raise ValueError(f"--nproc ({args.nproc}) conflicts with the launcher's WORLD_SIZE "
                         f"({os.environ['WORLD_SIZE']})")


def _given(args: argparse.Namespace, dest: str) -> bool:
    value = getattr(args, dest)
    return value is not None and value is not False


def _map_megatron_flags(args: argparse.Namespace) -> None:
    """Megatron-LM's spellings -> the HSAP flags; unsupported result-changing flags -> ValueError naming them."""
    args.ignored_flags = [flag for flag in IGNORED_FLAGS if getattr(args, _dest(flag)) is not None]
    for dest, (flag, why) in _UNSUPPORTED_FLAGS.items():
        if _given(args, dest):
            raise ValueError(f"{flag} is not supported: {why}")
    if args.grad_reduce_in_bf16 and not args.bf16:
        raise ValueError("--grad-reduce-in-bf16 needs --bf16")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise ValueError("--decoupled-min-lr needs --decoupled-lr")
    if args.ckpt_format != "torch_dist":
        raise ValueError(f"--ckpt-format {args.ckpt_format} is not supported: checkpoints are written with "
                         "Megatron-Core's dist_checkpointing (--ckpt-format torch_dist, the default)")
    if args.rotary_percent != 1.0:
        raise ValueError(f"--rotary-percent {args.rotary_percent:g} is not supported: the HSAP path rotates the "
                         "whole head (1.0)")
    head_dim = args.hidden_size // args.num_attention_heads
    if args.kv_channels is not None and args.kv_channels != head_dim:
        raise ValueError(f"--kv-channels ({args.kv_channels}) must equal --hidden-size / --num-attention-heads "
                         f"({head_dim}): other head dimensions are not supported")
    if args.group_query_attention and args.num_query_groups is None:
        args.num_query_groups = 1  # Megatron-LM's default for --num-query-groups
    if args.reset_position_ids and not args.reset_attention_mask and (args.data_path or args.mock_data):
        raise ValueError("--reset-position-ids needs --reset-attention-mask: positions restart exactly where "
                         "documents end on this path")
    if args.recompute_activations:
        if args.recompute_granularity == "full":
            raise ValueError("--recompute-activations (selective) conflicts with --recompute-granularity full")
        args.recompute_granularity = "selective"
    _map_context_parallel_flags(args)
    _map_attention_backend(args)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _map_context_parallel_flags(args: argparse.Namespace) -> None:
    """``--cp-comm-type`` / ``--hierarchical-context-parallel-sizes`` -> ``--context-parallel-mode`` / ``--ulysses-size``."""
    sizes = args.hierarchical_context_parallel_sizes
    mode = None
    if args.cp_comm_type is not None:
        kinds = sorted(set(args.cp_comm_type))
        if len(kinds) > 1:
            raise ValueError(f"--cp-comm-type: one type for all layers is supported, got {' '.join(args.cp_comm_type)}")
        if kinds[0] not in CP_COMM_TYPES:
            raise ValueError(f"--cp-comm-type {kinds[0]} is not supported; allowed: {', '.join(CP_COMM_TYPES)} "
                             "(or --context-parallel-mode hsap)")
        mode = CP_COMM_TYPES[kinds[0]]
    if sizes is not None:
        if mode != "hybrid":
            raise ValueError("--hierarchical-context-parallel-sizes needs --cp-comm-type a2a+p2p")
        if sizes[0] * sizes[1] != args.context_parallel_size:
            raise ValueError(f"--hierarchical-context-parallel-sizes {sizes[0]} x {sizes[1]} must equal "
                             f"--context-parallel-size ({args.context_parallel_size})")
        if args.ulysses_size is not None and args.ulysses_size != sizes[0]:
            raise ValueError(f"--ulysses-size ({args.ulysses_size}) conflicts with --hierarchical-context-parallel-"
                             f"sizes (a2a size {sizes[0]})")
        args.ulysses_size = sizes[0]
    if mode is not None and args.context_parallel_mode not in (None, mode):
        raise ValueError(f"--cp-comm-type {args.cp_comm_type[0]} means --context-parallel-mode {mode}, which "
                         f"conflicts with --context-parallel-mode {args.context_parallel_mode}")
    args.context_parallel_mode = args.context_parallel_mode or mode or "hsap"


def _map_attention_backend(args: argparse.Namespace) -> None:
    """``--use-flash-attn`` / ``--attention-backend`` -> ``--attention-kernel`` (conflicting choices are an error)."""
    chosen = {}
    if args.attention_kernel is not None:
        chosen["--attention-kernel"] = args.attention_kernel
    if args.attention_backend is not None:
        chosen[f"--attention-backend {args.attention_backend}"] = ATTENTION_BACKENDS[args.attention_backend]
    if args.use_flash_attn:
        chosen["--use-flash-attn"] = "flash"
    kernels = set(chosen.values()) - ({"auto"} if len(set(chosen.values())) > 1 else set())
    if len(kernels) > 1:
        raise ValueError(f"conflicting attention kernels: {', '.join(f'{k} ({v})' for k, v in chosen.items())}")
    args.attention_kernel = kernels.pop() if kernels else "auto"


def _resolve_training_length(args: argparse.Namespace) -> None:
    """Megatron-LM's iteration- or sample-based length and LR schedule -> ``train_iters`` and the scheduler's
    ``lr_warmup_steps`` / ``lr_decay_steps`` / ``wd_incr_steps`` (in samples, as Megatron's scheduler counts)."""
    gbs = args.global_batch_size
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        raise ValueError("--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are mutually exclusive")
    if args.train_samples is not None:
        if args.train_iters is not None:
            raise ValueError("--train-iters and --train-samples are mutually exclusive")
        for flag, value in (("--lr-warmup-iters", args.lr_warmup_iters), ("--lr-decay-iters", args.lr_decay_iters)):
            if value:
                raise ValueError(f"{flag} is iteration-based; with --train-samples use the -samples flag")
        args.train_iters = args.train_samples // gbs
        if args.train_iters < 1:
            raise ValueError(f"--train-samples ({args.train_samples}) is less than one global batch ({gbs})")
        args.lr_decay_steps = args.lr_decay_samples or args.train_samples
        warmup = args.lr_warmup_samples or 0
        args.wd_incr_steps = args.train_samples
    else:
        for flag, value in (("--lr-warmup-samples", args.lr_warmup_samples),
                            ("--lr-decay-samples", args.lr_decay_samples)):
            if value:
                raise ValueError(f"{flag} is sample-based; it needs --train-samples (or use the -iters flag)")
        if args.train_iters is None:
            args.train_iters = DEFAULT_TRAIN_ITERS
        args.lr_decay_steps = (args.lr_decay_iters or args.train_iters) * gbs
        if args.lr_warmup_iters is None:
            args.lr_warmup_iters = (0 if args.lr_warmup_fraction is not None
                                    else min(DEFAULT_LR_WARMUP_ITERS, args.train_iters // 10))
        if args.lr_warmup_iters >= args.train_iters:
            raise ValueError(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be smaller than --train-iters "
                             f"({args.train_iters})")
        warmup = args.lr_warmup_iters * gbs
        args.wd_incr_steps = args.train_iters * gbs
    args.lr_warmup_steps = (int(args.lr_warmup_fraction * args.lr_decay_steps) if args.lr_warmup_fraction is not None
                            else warmup)


def _check_per_token_loss(args: argparse.Namespace) -> None:
    """``--calculate-per-token-loss`` is accepted where it equals this loop's loss (see the error below)."""
    if not args.calculate_per_token_loss:
        return
    eod_masked = args.eod_mask_loss or (args.data_path is None and not args.mock_data)  # the embedded corpus masks EOD
    if eod_masked and args.num_microbatches * args.data_parallel_size > 1:
        raise ValueError("--calculate-per-token-loss is not supported with EOD loss masking (--eod-mask-loss, or "
                         "the embedded corpus): the loss here averages each micro-batch's per-token mean, which "
                         "equals Megatron-LM's per-token loss only when all micro-batches have the same number of "
                         "loss tokens; drop one of the two, or use one micro-batch per global batch")


def data_path_prefixes(data_path: List[str]) -> List[str]:
    """The dataset prefixes of a Megatron ``--data-path`` list (``[w1] p1 [w2] p2 ...``)."""
    if len(data_path) > 1 and len(data_path) % 2 == 0 and _is_number(data_path[0]):
        return data_path[1::2]
    return list(data_path)


def _check_weights(flag: str, data_path: List[str]) -> None:
    """Every weight of a weighted ``[w1] p1 [w2] p2 ...`` list must be a finite number above 0."""
    if not (len(data_path) > 1 and len(data_path) % 2 == 0 and _is_number(data_path[0])):
        return
    for weight, prefix in zip(data_path[0::2], data_path[1::2]):
        value = float(weight) if _is_number(weight) else math.nan
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag}: the weight of {prefix!r} is {weight!r}; weights must be finite numbers "
                             "above 0 (drop a dataset rather than give it weight 0)")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_ulysses_fits_a_node(args: argparse.Namespace, world_size: int) -> None:
    """hsap/hybrid choose their Ulysses size from the node size: refuse a node size that leaves no Ulysses
    group of two or more CP ranks inside a node though CP ranks share nodes (it would silently run as a ring)."""
    cp_config = cp_config_from_args(args)
    cp = args.context_parallel_size
    if args.context_parallel_mode not in ("hsap", "hybrid") or cp == 1 or args.ulysses_size is not None:
        return
    from megatron_hsap.parallel_state import cp_layout

    per_node = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    _, nodes, ulysses = cp_layout(0, args.tensor_model_parallel_size, cp, per_node, cp_config)
    if ulysses == 1 and len(set(nodes)) < cp:
        fits = [n * args.tensor_model_parallel_size for n in range(2, cp + 1) if cp % n == 0]
        raise ValueError(f"--context-parallel-mode {args.context_parallel_mode} with --context-parallel-size {cp}: "
                         f"{per_node} ranks per node (--ranks-per-node, or the launcher's LOCAL_WORLD_SIZE) leave "
                         "no Ulysses group of 2 or more CP ranks inside one node, so it would run as a pure ring; "
                         f"use a node size that is a multiple of one of {fits} ranks, --ulysses-size, or "
                         "--context-parallel-mode ring")


def cp_config_from_args(args: argparse.Namespace) -> ContextParallelConfig:
    """The ContextParallelConfig the flags describe (its own checks raise ValueError naming the field)."""
    try:
        return ContextParallelConfig(mode=args.context_parallel_mode, ulysses_size=args.ulysses_size,
                                     head_chunk_size=args.head_chunk_size, layout=args.cp_layout,
                                     kernel=args.attention_kernel, kv_forwarding=args.cp_kv_forwarding)
    except ValueError as err:
        raise ValueError(f"invalid context-parallel flags: {err}") from err


# ---- sequence-chunked MLP and loss (memory at long context; megatron_hsap/megatron/sequence_chunks.py) ----
#: Loss chunk default: tokens per chunk, so one chunk's fp32 logits are 2048 x vocab/TP x 4 bytes.
LOSS_CHUNK_TOKENS = 2048


def add_sequence_chunk_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("activation memory at long context (sequence chunks, host offload)")
    g.add_argument("--mlp-sequence-chunks", type=_positive_int, default=None,
                   help="compute the MLP in this many sequence tiles with recompute (default with hsap: "
                        "ceil(tokens per rank / hidden size), as DeepSpeed ALST; else 1)")
    g.add_argument("--loss-sequence-chunks", type=_positive_int, default=None,
                   help="compute the output layer + cross-entropy in this many sequence chunks, never the "
                        f"full logits (default with hsap: ceil(tokens per rank / {LOSS_CHUNK_TOKENS}); else 1)")
    g.add_argument("--offload-checkpointed-activations", action="store_true",
                   help="with --recompute-granularity full: keep the layer checkpoints (each layer's input) in host "
                        "memory, copied back one layer at a time in the backward")


def resolve_sequence_chunks(args: argparse.Namespace) -> None:
    """Fill the sequence-chunk defaults (chunked only with ``--context-parallel-mode hsap``); check the offload."""
    if getattr(args, "offload_checkpointed_activations", False) and args.recompute_granularity != "full":
        raise ValueError(f"--offload-checkpointed-activations needs --recompute-granularity full (got "
                         f"{args.recompute_granularity}): without full recompute every intermediate would cross "
                         "to host memory")
    hsap = args.context_parallel_mode == "hsap"
    tokens = -(-args.seq_length // args.context_parallel_size)
    if args.mlp_sequence_chunks is None:
        args.mlp_sequence_chunks = max(1, -(-tokens // args.hidden_size)) if hsap else 1
    if args.loss_sequence_chunks is None:
        args.loss_sequence_chunks = max(1, -(-tokens // LOSS_CHUNK_TOKENS)) if hsap else 1


# ---- evaluation and logging (Megatron-LM's flags; behaviour in training/loop.py and iteration_log.py) ----
def add_evaluation_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("evaluation and logging (Megatron-LM's flags)")
    g.add_argument("--eval-interval", type=_positive_int, default=1000,
                   help="evaluate on the validation split every this many iterations (and once after training)")
    g.add_argument("--eval-iters", type=_non_negative_int, default=100,
                   help="global batches per evaluation; 0 turns evaluation off")
    g.add_argument("--valid-data-path", nargs="*", default=None,
                   help="validation dataset prefix(es), [w1] p1 [w2] p2 ...; with it --split is unused")
    g.add_argument("--test-data-path", nargs="*", default=None,
                   help="test dataset prefix(es), [w1] p1 [w2] p2 ...; with it --split is unused")
    g.add_argument("--log-throughput", action="store_true",
                   help="print model TFLOP/s per GPU (Megatron-LM's formula) on each iteration line")
    g.add_argument("--wandb-project", default=None, help="log the scalars to this W&B project (needs wandb)")
    g.add_argument("--wandb-exp-name", default=None, help="W&B run name")
    g.add_argument("--wandb-save-dir", default=None, help="W&B local directory")


def validate_evaluation_logging_args(args: argparse.Namespace) -> None:
    """Per-split paths need --data-path (the train split); the writers' packages are installed."""
    for flag, path in (("--valid-data-path", args.valid_data_path), ("--test-data-path", args.test_data_path)):
        if path and args.data_path is None:
            raise ValueError(f"{flag} needs --data-path (the training data)")
    if args.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("--tensorboard-dir needs the tensorboard package (pip install tensorboard)")
    if args.wandb_project is not None and importlib.util.find_spec("wandb") is None:
        raise ValueError("--wandb-project needs the wandb package (pip install wandb)")
