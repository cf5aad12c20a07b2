"""Megatron-LM-style command-line flags for ``pretrain_gpt_hsap.py``, validated before any process group exists.

Flag names and meanings follow Megatron-LM's ``arguments.py`` where they exist
there, plus the HSAP ones (``--context-parallel-mode``, ``--ulysses-size``,
``--head-chunk-size``, ``--cp-layout``, ``--attention-kernel``, ``--ranks-per-node``).
Every rank parses and validates the same flags, so a bad value stops all ranks
with the same message (exit code 2) before anything can hang.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import List, Optional

from megatron_hsap.config import KERNELS, LAYOUTS, MODES, ContextParallelConfig
from megatron_hsap.training.dataset_check import check_indexed_dataset

__all__ = ["DEMO_FLAGS", "build_parser", "parse_args", "validate_args", "cp_config_from_args", "data_path_prefixes"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_gpt_hsap.py", allow_abbrev=False,
        description="Train a Megatron-Core GPT with HSAP context parallelism. With no --data-path and no "
                    "--mock-data it trains on the Python standard library's sources (byte-level tokens).")
    p.add_argument("--demo", action="store_true",
                   help="as the first flag: start from the embedded CPU demo preset (also used when no flag is given)")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=_positive_int, default=2)
    g.add_argument("--hidden-size", type=_positive_int, default=64)
    g.add_argument("--num-attention-heads", type=_positive_int, default=8)
    g.add_argument("--num-query-groups", type=_positive_int, default=None,
                   help="KV heads (grouped-query attention); default = --num-attention-heads")
    g.add_argument("--ffn-hidden-size", type=_positive_int, default=None, help="default 4 x hidden size")
    g.add_argument("--seq-length", type=_positive_int, default=256)
    g.add_argument("--max-position-embeddings", type=_positive_int, default=None, help="default --seq-length")
    g.add_argument("--position-embedding-type", choices=("rope", "learned_absolute"), default="rope")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--make-vocab-size-divisible-by", type=_positive_int, default=128)
    g.add_argument("--layout-independent-init", action="store_true",
                   help="initialise every weight from its name and global (unsharded) shape, so runs with "
                        "different TP/PP sizes start from identical weights")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=_positive_int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=_positive_int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=_positive_int, default=None,
                   help="enables the interleaved 1F1B schedule")
    g.add_argument("--context-parallel-size", type=_positive_int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--context-parallel-mode", choices=MODES, default="hsap")
    g.add_argument("--ulysses-size", type=_positive_int, default=None,
                   help="all-to-all degree inside the CP group (default: per mode, see docs/training.md)")
    g.add_argument("--head-chunk-size", type=_positive_int, default=None,
                   help="query heads per UPipe stage (hsap default: the Ulysses size)")
    g.add_argument("--cp-layout", choices=LAYOUTS, default=None,
                   help="token placement (default: sequence-aware for hsap, zigzag otherwise)")
    g.add_argument("--attention-kernel", choices=KERNELS, default="auto")
    g.add_argument("--ranks-per-node", type=_positive_int, default=None,
                   help="ranks per node; set it to emulate several nodes on one machine (default: LOCAL_WORLD_SIZE)")
    g.add_argument("--distributed-backend", choices=("auto", "gloo", "nccl"), default="auto")
    g.add_argument("--distributed-timeout-minutes", type=_positive_float, default=10,
                   help="a collective waiting this long for a peer fails (fractions allowed, e.g. 0.5)")
    g.add_argument("--nproc", type=_positive_int, default=None,
                   help="when started without torchrun: spawn this many local ranks (CPU/gloo)")
    g.add_argument("--rank-failure-grace-seconds", type=_non_negative_float, default=10.0,
                   help="with --nproc: after one rank fails, the others get this long to exit, then are killed")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=_positive_int, default=1)
    g.add_argument("--global-batch-size", type=_positive_int, default=None, help="default micro x data-parallel")
    g.add_argument("--train-iters", type=_positive_int, default=100)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=3e-4)
    g.add_argument("--lr-warmup-iters", type=_non_negative_int, default=10)
    g.add_argument("--lr-decay-style", choices=("cosine", "linear", "constant"), default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    precision = g.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true")
    precision.add_argument("--fp32", action="store_true", help="the default; listed for Megatron compatibility")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default="uniform")
    g.add_argument("--recompute-num-layers", type=_positive_int, default=1)

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="indexed dataset prefix(es), optionally weighted: [w1] p1 [w2] p2 ...")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--tokenizer-type", choices=("ByteLevelTokenizer", "HuggingFaceTokenizer", "NullTokenizer"),
                   default="ByteLevelTokenizer")
    g.add_argument("--tokenizer-model", default=None, help="local path of a Hugging Face tokenizer")
    g.add_argument("--vocab-size", type=_positive_int, default=None, help="for NullTokenizer")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="documents end at EOD tokens inside a sample (packed documents); default on for the "
                        "embedded corpus")
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on EOD input tokens")
    g.add_argument("--data-cache-path", default=None)

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=_positive_int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
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
                   action="store_false")

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=_positive_int, default=1)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--no-progress-bar", action="store_true")
    g.add_argument("--log-json", default=None, help="write one JSON record per iteration to this file (rank 0)")
    add_sequence_chunk_args(p)
    return p


#: The embedded default (``python pretrain_gpt_hsap.py`` with no flags, or ``--demo [overrides]``): a small
#: GPT on the stdlib corpus, hsap over 8 forked CPU ranks emulating 2 nodes of 4; ~3 minutes on 2 cores.
DEMO_FLAGS = ["--nproc", "8", "--ranks-per-node", "4", "--context-parallel-size", "8",
              "--context-parallel-mode", "hsap", "--num-layers", "2", "--hidden-size", "64",
              "--num-attention-heads", "8", "--seq-length", "1024", "--micro-batch-size", "1",
              "--global-batch-size", "1", "--train-iters", "150", "--lr", "3e-3", "--min-lr", "3e-4",
              "--lr-warmup-iters", "10", "--log-interval", "10"]


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
        world_size = int(os.environ.get("WORLD_SIZE", args.nproc or 1))
    try:
        validate_args(args, world_size)
    except ValueError as err:
        parser.error(str(err))
    return args


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Fill derived defaults and reject inconsistent sizes (ValueError naming the flag)."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if world_size % (tp * pp * cp) != 0:
        raise ValueError(f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
                         f"--pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp})")
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * pp * cp)
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
        raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
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
    if args.lr_warmup_iters >= args.train_iters:
        raise ValueError(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be smaller than --train-iters "
                         f"({args.train_iters})")
    if args.attention_dropout != 0.0:
        raise ValueError("--attention-dropout must be 0.0: HSAP attention has no dropout")
    if args.data_path is not None and args.mock_data:
        raise ValueError("--data-path and --mock-data are mutually exclusive")
    for prefix in data_path_prefixes(args.data_path or []):
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            raise ValueError(f"--data-path: {', '.join(missing)} not found; build it with tools/preprocess_data.py, "
                             "or use --mock-data, or omit --data-path to train on the embedded corpus")
        check_indexed_dataset(prefix)
    if args.tokenizer_type == "HuggingFaceTokenizer" and not args.tokenizer_model:
        raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a local path)")
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.data_path is None and not args.mock_data and args.tokenizer_type != "ByteLevelTokenizer":
        raise ValueError("without --data-path the embedded corpus is used, which needs --tokenizer-type "
                         "ByteLevelTokenizer; pass --data-path (or --mock-data) to use another tokenizer")
    if args.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("--tensorboard-dir needs the tensorboard package (pip install tensorboard)")
    if args.save_interval is not None and args.save is None:
        raise ValueError("--save-interval needs --save")
    if args.load is not None and os.path.exists(args.load) and not os.path.isdir(args.load):
        raise ValueError(f"--load {args.load!r} is not a directory")
    if args.nproc is not None and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) != args.nproc:
        raise ValueError(f"--nproc ({args.nproc}) conflicts with the launcher's WORLD_SIZE "
                         f"({os.environ['WORLD_SIZE']})")
    cp_config_from_args(args)
    resolve_sequence_chunks(args)


def data_path_prefixes(data_path: List[str]) -> List[str]:
    """The dataset prefixes of a Megatron ``--data-path`` list (``[w1] p1 [w2] p2 ...``)."""
    if len(data_path) > 1 and len(data_path) % 2 == 0 and _is_number(data_path[0]):
        return data_path[1::2]
    return list(data_path)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def cp_config_from_args(args: argparse.Namespace) -> ContextParallelConfig:
    """The ContextParallelConfig the flags describe (its own checks raise ValueError naming the field)."""
    try:
        return ContextParallelConfig(mode=args.context_parallel_mode, ulysses_size=args.ulysses_size,
                                     head_chunk_size=args.head_chunk_size, layout=args.cp_layout,
                                     kernel=args.attention_kernel)
    except ValueError as err:
        raise ValueError(f"invalid context-parallel flags: {err}") from err


# ---- sequence-chunked MLP and loss (memory at long context; megatron_hsap/megatron/sequence_chunks.py) ----
#: Loss chunk default: tokens per chunk, so one chunk's fp32 logits are 2048 x vocab/TP x 4 bytes.
LOSS_CHUNK_TOKENS = 2048


def add_sequence_chunk_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sequence chunks (activation memory outside attention)")
    g.add_argument("--mlp-sequence-chunks", type=_positive_int, default=None,
                   help="compute the MLP in this many sequence tiles with recompute (default with hsap: "
                        "ceil(tokens per rank / hidden size), as DeepSpeed ALST; else 1)")
    g.add_argument("--loss-sequence-chunks", type=_positive_int, default=None,
                   help="compute the output layer + cross-entropy in this many sequence chunks, never the "
                        f"full logits (default with hsap: ceil(tokens per rank / {LOSS_CHUNK_TOKENS}); else 1)")


def resolve_sequence_chunks(args: argparse.Namespace) -> None:
    """Fill the sequence-chunk defaults: chunked only with ``--context-parallel-mode hsap``."""
    hsap = args.context_parallel_mode == "hsap"
    tokens = -(-args.seq_length // args.context_parallel_size)
    if args.mlp_sequence_chunks is None:
        args.mlp_sequence_chunks = max(1, -(-tokens // args.hidden_size)) if hsap else 1
    if args.loss_sequence_chunks is None:
        args.loss_sequence_chunks = max(1, -(-tokens // LOSS_CHUNK_TOKENS)) if hsap else 1
