"""``--context-parallel-mode auto``: the mode, Ulysses size and head-chunk size ``megatron_hsap.configurator``
predicts fastest for this job (memory per GPU first), decided identically on every rank before any group exists."""

from __future__ import annotations

import argparse
import os

import torch

from megatron_hsap.configurator import HARDWARE, choose_mode
from megatron_hsap.instrumentation.memory_model import GiB, ModelShape
from megatron_hsap.sequence.doc_lengths import sample_doc_lengths

__all__ = ["resolve_auto_mode", "ASSUMED_DEVICE_GIB"]

#: Memory per device when there is no CUDA device to ask (a CPU run): an 80 GiB GPU.
ASSUMED_DEVICE_GIB = 80.0
#: The vocabulary when the tokenizer does not fix it before the run (Llama 3's); only the memory estimate uses it.
_DEFAULT_VOCAB = 128256


def _model(args: argparse.Namespace) -> ModelShape:
    vocab = 512 if args.tokenizer_type in (None, "ByteLevelTokenizer") and args.vocab_size is None \
        else (args.vocab_size or _DEFAULT_VOCAB)
    return ModelShape("model", args.num_layers, args.hidden_size, args.num_attention_heads, args.num_query_groups,
                      args.kv_channels or args.hidden_size // args.num_attention_heads,
                      args.ffn_hidden_size or 4 * args.hidden_size, vocab, swiglu=args.swiglu,
                      tied_embeddings=not args.untie_embeddings_and_output_weights)


def resolve_auto_mode(args: argparse.Namespace) -> str:
    """Set ``context_parallel_mode``, ``ulysses_size`` and ``head_chunk_size`` from the prediction; returns the
    one line rank 0 prints (the choice and why)."""
    if args.ulysses_size is not None or args.head_chunk_size is not None:
        raise ValueError("--context-parallel-mode auto chooses --ulysses-size and --head-chunk-size itself; drop "
                         "them, or name a mode")
    per_node = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size))
    if torch.cuda.is_available():
        device_gib = torch.cuda.get_device_properties(0).total_memory / GiB
        where = f"this {device_gib:.0f} GiB GPU"
    else:
        device_gib, where = ASSUMED_DEVICE_GIB, f"an assumed {ASSUMED_DEVICE_GIB:.0f} GiB GPU (no CUDA here)"
    recompute = ("offload" if getattr(args, "offload_checkpointed_activations", False)
                 else "full" if args.recompute_granularity == "full" else "none")
    best, compared = choose_mode(_model(args), args.tensor_model_parallel_size, args.context_parallel_size,
                                 args.data_parallel_size, per_node, args.seq_length,
                                 [sample_doc_lengths(args.seq_length, seed=0)], HARDWARE["h100"], device_gib,
                                 recompute, args.use_distributed_optimizer)
    c = best.candidate
    args.context_parallel_mode = "ulysses" if c.mode == "none" else c.mode
    if c.mode in ("hybrid", "hsap"):
        args.ulysses_size = c.ulysses
    if c.mode == "hsap":
        args.head_chunk_size = c.head_chunk
    others = "; ".join(f"{p.candidate.mode} U {p.candidate.head_chunk}: {_time(p.step_s)}, "
                       f"{_size(p.peak_bytes)}" for p in compared[1:4])
    verdict = "fits" if best.fits else "does NOT fit (the least memory of all)"
    return (f"--context-parallel-mode auto: {c.describe()} -- predicted {_time(best.step_s)} per step on H100s, "
            f"peak {_size(best.peak_bytes)} per GPU ({verdict} {where}; documents of the bucket histogram); "
            f"next: {others or 'no other mode is valid here'}")


def _size(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / 2 ** 20:.1f} MiB"


def _time(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"
