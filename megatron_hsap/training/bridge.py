"""Megatron-Bridge integration: HSAP context parallelism inside ``megatron.bridge.training.pretrain``.

Megatron-Bridge (the successor of NeMo's LLM collection) builds the process groups, the
model from a ``GPTModelProvider``, the optimizer, data and checkpoints itself. Three pieces
plug HSAP into it (docs/bridge.md):

- ``HSAPLayerSpec``: the provider's ``transformer_layer_spec`` (megatron_hsap/megatron/spec.py's
  decoder block, so the self-attention is ``HSAPSelfAttention``);
- ``configure_hsap(cfg, cp_config)``: the config transform. Bridge calls Megatron-Core's
  ``initialize_model_parallel`` with the model config's ``context_parallel_size`` and
  ``hierarchical_context_parallel_sizes``; this sets the latter to HSAP's [Ulysses, ring] sizes
  and registers a pre-wrap hook that records the topology over the groups Bridge built
  (``parallel_state.attach_cp_topology``, which reuses them);
- ``forward_step(state, data_iterator, model)``: takes the *unsliced* packed micro-batch from
  Bridge's dataset, plans and shards it for this CP rank (training/packing.py), moves it to the
  device, and returns ``(output_tensor, loss_func)`` with the HSAP loop's loss (training/loop.py).

One context-parallel size serves both the groups and the model config: the model's layers see
``context_parallel_size > 1``, which only Megatron's own CP attention reads, and HSAP replaces it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_hsap.config import ContextParallelConfig
from megatron_hsap.parallel_state import (_resolve_ranks_per_node, attach_cp_topology, cp_layout, get_cp_topology,
                                          hierarchical_cp_sizes)
from megatron_hsap.training.loop import _loss_func
from megatron_hsap.training.packing import PackedMicroBatch, pack_micro_batch

__all__ = ["HSAPLayerSpec", "configure_hsap", "forward_step"]


@dataclass(frozen=True)
class HSAPLayerSpec:
    """``GPTModelProvider.transformer_layer_spec``: Bridge calls it with the provider (a TransformerConfig).

    Returns the HSAP decoder block for ``vp_stage``. Its core attention is ``HSAPCoreAttention``, which takes
    the model's ``context_parallel_size > 1`` (Megatron's local ``DotProductAttention`` would refuse it).
    """

    cp_config: ContextParallelConfig = ContextParallelConfig(mode="hsap")

    def __call__(self, config: Any, vp_stage: Optional[int] = None) -> Any:
        from megatron_hsap.megatron.spec import get_gpt_decoder_block_hsap_spec

        return get_gpt_decoder_block_hsap_spec(config, self.cp_config, vp_stage=vp_stage,
                                               num_experts=config.num_moe_experts, qk_layernorm=config.qk_layernorm)


def configure_hsap(cfg: Any, cp_config: ContextParallelConfig = ContextParallelConfig(mode="hsap"),
                   ranks_per_node: Optional[int] = None) -> None:
    """Make a Bridge ``ConfigContainer`` train with HSAP context parallelism (in place; call before ``pretrain``).

    Sets ``cfg.model.transformer_layer_spec``, ``cfg.model.hierarchical_context_parallel_sizes`` (the
    groups Bridge will build) and a pre-wrap hook that records the HSAP topology over those groups. On a
    machine without CUDA it also selects gloo and the TransformerConfig fields of ``cpu_config_overrides``
    (call ``megatron_hsap.megatron.cpu_shim.apply_bridge_cpu_shim()`` first there).
    ranks_per_node: global ranks per node (default: torchrun's LOCAL_WORLD_SIZE, else the world size).
    Every check runs before any process group exists, identically on every rank.
    """
    from megatron_hsap.megatron.cpu_shim import cpu_config_overrides

    if not isinstance(cp_config, ContextParallelConfig):
        raise ValueError(f"cp_config must be a ContextParallelConfig, got {type(cp_config).__name__}")
    model = cfg.model
    if model.pipeline_model_parallel_size != 1:
        raise ValueError(f"pipeline_model_parallel_size={model.pipeline_model_parallel_size} is not supported by "
                         "the Megatron-Bridge integration yet; allowed: 1 (use pretrain_gpt_hsap.py for PP)")
    if model.calculate_per_token_loss:
        raise ValueError("calculate_per_token_loss=True is not supported by the HSAP forward step (its loss is "
                         "already normalised by the whole micro-batch's token count); allowed: False")
    if model.hierarchical_context_parallel_sizes is not None:
        raise ValueError("hierarchical_context_parallel_sizes is derived from cp_config (ulysses_size); leave it None")
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    ranks_per_node = _resolve_ranks_per_node(ranks_per_node, world)
    tp, cp = model.tensor_model_parallel_size, model.context_parallel_size
    _, _, ulysses = cp_layout(rank, tp, cp, ranks_per_node, cp_config)
    heads_per_tp = model.num_attention_heads // tp
    if heads_per_tp % ulysses != 0:
        raise ValueError(f"num_attention_heads ({model.num_attention_heads}) must be divisible by "
                         f"tensor_model_parallel_size x Ulysses size ({tp} x {ulysses})")
    cp_config.resolve_head_chunk_size(heads_per_tp, ulysses)
    model.transformer_layer_spec = HSAPLayerSpec(cp_config)
    model.hierarchical_context_parallel_sizes = hierarchical_cp_sizes(cp, ulysses)
    model.register_pre_wrap_hook(partial(_attach_topology_hook, cp_config, ranks_per_node))
    for name, value in cpu_config_overrides().items():
        setattr(model, name, value)
    if not torch.cuda.is_available():
        cfg.dist.distributed_backend = "gloo"


def _attach_topology_hook(cp_config: ContextParallelConfig, ranks_per_node: int, model: List[Any]) -> List[Any]:
    """Bridge pre-wrap hook: runs after Bridge built the groups (on every rank); the model is unchanged."""
    attach_cp_topology(cp_config, ranks_per_node)
    return model


def forward_step(state: Any, data_iterator: Iterator[Dict[str, torch.Tensor]], model: Any
                 ) -> Tuple[torch.Tensor, partial]:
    """Bridge's forward-step contract, for ``pretrain(cfg, forward_step_func=forward_step)``.

    ``next(data_iterator)``: Bridge's GPT batch, *not* sliced for CP (``tokens``/``labels``/``loss_mask``
    ``[b, s]``, identical on all CP ranks of a DP rank). Documents end at sample boundaries and, with
    ``cfg.dataset.reset_attention_mask``, after every EOD token. Returns the model's per-token losses
    ``[1, t_local]`` for this CP rank's tokens and the loss function (Megatron's 2-tuple form).
    """
    cfg = state.cfg
    topology = get_cp_topology()
    batch = next(data_iterator)
    mb = pack_micro_batch(batch, cfg.dataset.tokenizer.eod, bool(cfg.dataset.reset_attention_mask), topology,
                          topology.config.resolved_layout)
    mb = _to_device(mb, _current_device())
    output = model(mb.tokens, mb.position_ids, None, labels=mb.labels, packed_seq_params=mb.packed_seq_params)
    return output, partial(_token_weighted_loss, mb, topology.cp_group)


def _token_weighted_loss(mb: PackedMicroBatch, cp_group: Any, output_tensor: torch.Tensor
                         ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The HSAP loop's loss (exact CP=1 gradients), reported as Bridge's ``[loss sum, tokens]`` pair.

    Bridge sums such pairs over micro-batches and the DP x CP group, so the logged loss is the
    token-weighted mean of the global batch (each CP rank reports its micro-batch's CP-wide sum, so
    both entries are counted CP times and the ratio is unchanged).
    """
    loss, metrics = _loss_func(mb, cp_group, None, output_tensor)
    tokens = torch.tensor(float(mb.num_loss_tokens), device=loss.device)
    return loss, {"lm loss": torch.stack([metrics["lm loss"] * max(mb.num_loss_tokens, 1), tokens])}


def _current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _to_device(mb: PackedMicroBatch, device: torch.device) -> PackedMicroBatch:
    """The micro-batch with its model inputs and loss mask on ``device`` (no copy when already there).

    ``packed_seq_params`` stays as built: its document boundaries and plan are host-side descriptions
    (the plan moves its index tables to the activations' device itself).
    """
    return dataclasses.replace(mb, **{name: getattr(mb, name).to(device, non_blocking=True)
                                      for name in ("tokens", "labels", "loss_mask", "position_ids")})
