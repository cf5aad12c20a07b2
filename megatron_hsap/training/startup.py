"""What a run will do, said before it does it: the resolved configuration block, Megatron-LM's arguments block,
and the dry run (``--dry-run N``) that checks a job's flags for N ranks without starting any.

Megatron-LM prints every argument at start-up; a context-parallel run has more that is decided for the user
(Ulysses x ring split, head-chunk size, kernel, sequence chunks, ignored flags), so rank 0 prints those as a few
named lines, and ``--print-args`` adds Megatron-LM's full block.
"""

from __future__ import annotations

import argparse
from typing import List, Optional

from megatron_hsap.config import ContextParallelConfig
from megatron_hsap.parallel_state import CPTopology, cp_layout

__all__ = ["configuration_lines", "arguments_block", "dry_run_topology", "dry_run_lines"]



def configuration_lines(args: argparse.Namespace, topology: CPTopology, cp_config: ContextParallelConfig,
                        kernel: str) -> List[str]:
    """The resolved configuration, one fact per line (``kernel``: the kernel's name and how it was chosen)."""
    heads_per_tp = args.num_attention_heads // args.tensor_model_parallel_size
    nodes = topology.num_nodes
    chunk = cp_config.resolve_head_chunk_size(heads_per_tp, topology.ulysses_size)
    stages = -(-heads_per_tp // chunk)
    where = ("inside a node" if nodes == 1 or topology.ulysses_size <= topology.cp_size // nodes
             else "across nodes")
    forwarding = ("on" if cp_config.kv_forwarding else "off") + (
        "" if topology.ring_size > nodes else " (one ring member per node: nothing to forward)")
    recompute = args.recompute_granularity or "none"
    if getattr(args, "offload_checkpointed_activations", False):
        recompute += ", layer checkpoints in host memory"
    lines = [
        f"parallelism: world {args.world_size} = TP {args.tensor_model_parallel_size} x PP "
        f"{args.pipeline_model_parallel_size} x CP {args.context_parallel_size} x DP {args.data_parallel_size}; "
        f"{nodes} node(s) hold this CP group",
        f"context parallel: mode {cp_config.mode}, Ulysses {topology.ulysses_size} ({where}) x ring "
        f"{topology.ring_size}; layout {cp_config.resolved_layout}; K/V forwarding {forwarding}",
        f"head chunks: {chunk} of {heads_per_tp} query heads per stage ({stages} stage(s)"
        + (", UPipe)" if stages > 1 else ", all heads at once)"),
        f"attention kernel: {kernel}",
        f"activation memory: recompute {recompute}; MLP in {args.mlp_sequence_chunks} sequence chunk(s), "
        f"output layer + loss in {args.loss_sequence_chunks}",
        f"precision: {'bf16' if args.bf16 else 'fp32'} weights and activations; "
        f"{'bf16' if getattr(args, 'grad_reduce_in_bf16', False) else 'fp32'} gradient reduction",
    ]
    return [f"megatron-hsap: {line}" for line in lines]


def arguments_block(args: argparse.Namespace) -> str:
    """Every argument, sorted, in Megatron-LM's start-up layout (its log parsers read this block)."""
    title = " arguments "
    lines = ["-" * 24 + title + "-" * 24]
    for name in sorted(vars(args)):
        lines.append(f"  {name} {'.' * max(1, 48 - len(name))} {getattr(args, name)}")
    lines.append("-" * 20 + " end of arguments " + "-" * 20)
    return "\n".join(lines)


def dry_run_topology(args: argparse.Namespace, cp_config: ContextParallelConfig) -> CPTopology:
    """The CP topology of rank 0's group for a job of ``args.world_size`` ranks, from rank arithmetic alone."""
    ranks_per_node = args.ranks_per_node or min(args.world_size, 8)
    _, node_of_cp_rank, ulysses = cp_layout(0, args.tensor_model_parallel_size, args.context_parallel_size,
                                            ranks_per_node, cp_config)
    return CPTopology(cp_size=args.context_parallel_size, ulysses_size=ulysses, node_of_cp_rank=node_of_cp_rank)


def dry_run_lines(args: argparse.Namespace, device_gib: Optional[float] = 80.0) -> List[str]:
    """What ``--dry-run`` prints: the configuration block and the memory model's peak per GPU for these flags."""
    from megatron_hsap.configurator import MODES_MEMORY_METHOD
    from megatron_hsap.instrumentation.memory_model import GiB, ModelShape, Parallelism, Training, estimate
    from megatron_hsap.training.arguments import cp_config_from_args
    from megatron_hsap.training.model import padded_vocab_size

    cp_config = cp_config_from_args(args)
    topology = dry_run_topology(args, cp_config)
    per_node = args.ranks_per_node or min(args.world_size, 8)
    kernel = f"{args.attention_kernel} (resolved on the GPU at the first attention call)"
    lines = [f"megatron-hsap: dry run for {args.world_size} ranks, {per_node} per node "
             f"({'--ranks-per-node' if args.ranks_per_node else 'default 8 GPUs per node'}): the flags are valid"]
    lines += configuration_lines(args, topology, cp_config, kernel)
    shape = ModelShape("model", args.num_layers, args.hidden_size, args.num_attention_heads, args.num_query_groups,
                       args.hidden_size // args.num_attention_heads, args.ffn_hidden_size or 4 * args.hidden_size,
                       padded_vocab_size(_vocab_size(args), args), swiglu=args.swiglu,
                       tied_embeddings=not args.untie_embeddings_and_output_weights)
    parallel = Parallelism(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                           cp=args.context_parallel_size, dp=args.data_parallel_size, ulysses=topology.ulysses_size,
                           head_chunk=cp_config.resolve_head_chunk_size(
                               args.num_attention_heads // args.tensor_model_parallel_size, topology.ulysses_size))
    recompute = ("offload" if getattr(args, "offload_checkpointed_activations", False)
                 else "full" if args.recompute_granularity == "full" else "none")
    training = Training(dtype_bytes=2 if args.bf16 else 4, distributed_optimizer=args.use_distributed_optimizer,
                        recompute=recompute, grad_bytes=2 if getattr(args, "grad_reduce_in_bf16", False) else 4,
                        mlp_chunks=args.mlp_sequence_chunks, loss_chunks=args.loss_sequence_chunks)
    est = estimate(shape, args.seq_length * args.micro_batch_size, parallel, training,
                   MODES_MEMORY_METHOD[cp_config.mode])
    parts = ", ".join(f"{name} {value / GiB:.2f}" for name, value in est.components.items())
    verdict = "" if device_gib is None else (
        f"; fits {device_gib:g} GiB of GPU memory" if est.peak <= device_gib * GiB
        else f"; does NOT fit {device_gib:g} GiB of GPU memory (+{(est.peak - device_gib * GiB) / GiB:.2f} GiB)")
    lines.append(f"megatron-hsap: predicted peak per GPU {est.peak / GiB:.2f} GiB (memory model, "
                 f"{args.seq_length * args.micro_batch_size} tokens per micro-batch){verdict}: {parts} GiB")
    return lines


def _vocab_size(args: argparse.Namespace) -> int:
    """The tokenizer's vocabulary, built as the run would build it (its files must be readable here)."""
    from megatron_hsap.training.tokenizer import build_tokenizer

    return build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size, args.vocab_file,
                           args.merge_file, args.tiktoken_pattern).vocab_size
