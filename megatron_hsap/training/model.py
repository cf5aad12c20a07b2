"""Build the Megatron-Core GPTModel (one chunk per virtual pipeline stage) with HSAP attention, wrapped in DDP."""

from __future__ import annotations

import argparse
import importlib.util
import math
import zlib
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

from megatron_hsap.config import ContextParallelConfig
from megatron_hsap.megatron.cpu_shim import cpu_config_overrides
from megatron_hsap.megatron.spec import (get_gpt_decoder_block_hsap_spec, transformer_engine_usable,
                                         use_transformer_engine)

__all__ = ["transformer_config", "fusion_settings", "padded_vocab_size", "build_model", "build_gpt_chunk",
           "layout_independent_init", "model_device"]


def padded_vocab_size(vocab_size: int, args: argparse.Namespace) -> int:
    """Megatron's padding: a multiple of ``--make-vocab-size-divisible-by x TP``."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def transformer_config(args: argparse.Namespace) -> Any:
    """The model's TransformerConfig. Its context_parallel_size is 1: HSAP attention does CP itself."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    vp = args.num_layers_per_virtual_pipeline_stage
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=(None if vp is None else
                                              args.num_layers // args.pipeline_model_parallel_size // vp),
        context_parallel_size=1, sequence_parallel=args.sequence_parallel,
        params_dtype=dtype, bf16=args.bf16, pipeline_dtype=dtype, autocast_dtype=dtype,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, normalization=args.normalization,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method if args.recompute_granularity == "full" else None,
        recompute_num_layers=args.recompute_num_layers if args.recompute_granularity == "full" else None,
        **fusion_settings(torch.cuda.is_available(), gelu_without_bias=not args.swiglu and args.disable_bias_linear),
        cuda_graph_scope=[],  # Megatron-LM's CLI default (the dataclass default "full" warns as deprecated)
        **cpu_config_overrides())


def fusion_settings(cuda: bool, gelu_without_bias: bool = False) -> Dict[str, bool]:
    """Megatron's kernel fusions: on a GPU those the HSAP path allows (Megatron-LM's defaults), off on CPU.

    - bias+activation (GeLU/SwiGLU), bias+dropout+add, persistent LayerNorm: untouched by HSAP, on
      (bias+GeLU only with a bias: Megatron's config rejects the fusion for GeLU without one).
    - gradient-accumulation fusion: on where its CUDA kernel (Apex's ``fused_weight_gradient_mlp_cuda``,
      which Megatron's linear layers import) is installed; the head-chunked QKV path and the chunked
      loss add their weight gradients to ``main_grad`` through DDP's hook either way.
    - masked-softmax fusion: on (Megatron's default); HSAP's attention core does not use it.
    - RoPE fusion: off. HSAP rotates each token at its in-document position with a per-token table,
      a layout the fused kernel is not validated for.
    Note the fused bias-GeLU uses GeLU's tanh approximation (as Megatron-LM on GPU).
    """
    return {"bias_activation_fusion": cuda and not gelu_without_bias, "bias_dropout_fusion": cuda,
            "persist_layer_norm": cuda, "masked_softmax_fusion": cuda,
            "gradient_accumulation_fusion": cuda and _fused_wgrad_available(),
            "apply_rope_fusion": False}


def _fused_wgrad_available() -> bool:
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def build_model(args: argparse.Namespace, config: Any, cp_config: ContextParallelConfig, vocab_size: int) -> List[Any]:
    """GPTModel chunks for this pipeline rank (several with the interleaved schedule), moved whole to
    ``model_device()`` and DDP-wrapped."""
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    num_chunks = config.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for vp_stage in range(num_chunks):
        stage = vp_stage if num_chunks > 1 else None
        model = build_gpt_chunk(args, config, cp_config, padded_vocab_size(vocab_size, args),
                                pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                                post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                                vp_stage=stage)
        if args.layout_independent_init:
            layout_independent_init(model, args.seed, args.init_method_std, args.num_layers)
        chunks.append(model.to(model_device()))  # every parameter and buffer, before DDP builds its buffers
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=not getattr(args, "grad_reduce_in_bf16", False),
                                               overlap_grad_reduce=False,
                                               use_distributed_optimizer=args.use_distributed_optimizer)
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=m, disable_bucketing=i > 0)
            for i, m in enumerate(chunks)]


def model_device() -> torch.device:
    """The device the model is trained on: ``torch.cuda.current_device()`` (set from LOCAL_RANK by the loop)
    where CUDA is available, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def build_gpt_chunk(args: argparse.Namespace, config: Any, cp_config: ContextParallelConfig, padded_vocab: int,
                    pre_process: bool, post_process: bool, vp_stage: Optional[int]) -> Any:
    """One unwrapped GPTModel chunk with the HSAP layer spec (also Megatron-LM's model provider's, see
    ``megatron_hsap.training.megatron_lm``). ``args`` needs Megatron-LM's model flags plus
    ``--mlp/loss-sequence-chunks``."""
    from megatron_hsap.megatron.sequence_chunks import HSAPGPTModel

    # --transformer-impl's default (None): TE where it can run, as its help says
    impl = getattr(args, "transformer_impl", None) or ("transformer_engine" if transformer_engine_usable() else "local")
    use_te = use_transformer_engine(impl)
    block = get_gpt_decoder_block_hsap_spec(config, cp_config, vp_stage=vp_stage, use_transformer_engine=use_te,
                                            mlp_sequence_chunks=args.mlp_sequence_chunks)
    return HSAPGPTModel(
        loss_sequence_chunks=args.loss_sequence_chunks,
        config=config, transformer_layer_spec=block, vocab_size=padded_vocab,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base, vp_stage=vp_stage)


def layout_independent_init(model: torch.nn.Module, seed: int, std: float, num_layers: int) -> None:
    """Re-initialise every matrix from its checkpoint key and global (unsharded) shape.

    Each weight is N(0, std) (output projections std/sqrt(2L), as Megatron's scaled init),
    drawn from a generator seeded by (seed, key, layer index), then this rank's slice is
    kept. The weights are therefore identical whatever the TP/PP sizes, which the
    equivalence tests need. 1-D parameters keep their deterministic init (norms 1, biases 0).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    scaled_std = std / math.sqrt(2.0 * num_layers)
    for sh in nested_values(model.sharded_state_dict()):
        if isinstance(sh, ShardedTensorFactory):
            raise ValueError(f"layout-independent init does not support the factory-sharded tensor {sh.key!r} "
                             "(e.g. --swiglu); drop --layout-independent-init")
        if not isinstance(sh, ShardedTensor) or len(sh.global_shape) - sh.prepend_axis_num < 2:
            continue
        if sh.key.endswith("_extra_state"):
            continue
        prefix = tuple(sh.global_offset[:sh.prepend_axis_num])
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(f"{sh.key}{prefix}".encode())) % 2**63)
        scale = scaled_std if sh.key.endswith(("linear_proj.weight", "linear_fc2.weight")) else std
        full = torch.randn(sh.global_shape[sh.prepend_axis_num:], generator=gen) * scale
        index = tuple(slice(o, o + n) for o, n in zip(sh.global_offset[sh.prepend_axis_num:], sh.data.shape))
        with torch.no_grad():
            sh.data.copy_(full[index])
