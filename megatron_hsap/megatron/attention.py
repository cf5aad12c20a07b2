"""HSAP self-attention for Megatron-Core: Megatron's projections, HSAP's context-parallel core.

``HSAPSelfAttention`` is a Megatron ``SelfAttention`` (same submodules, parameters
and state-dict keys) whose forward replaces the attention core: the packed
micro-batch arrives as this rank's share of one THD token stream, laid out by a
``BatchPlan``; rotary embeddings use the plan's in-document positions, and the
attention itself is ``megatron_hsap.attention.context_parallel_attention``
(ring / Ulysses / hybrid / hsap per the ``ContextParallelConfig``), which never
lets a token attend across a document boundary. When head chunks are configured
(``head_chunk_size`` below the local head count) the projection and attention run
fused per chunk through UPipe (``megatron_hsap.attention.upipe``).

The plan reaches the layer inside ``packed_seq_params`` (``HSAPPackedSeqParams``,
a ``PackedSeqParams`` with a ``plan`` field), the way Megatron passes THD batches.
The model's ``TransformerConfig.context_parallel_size`` stays 1: CP is handled
here, so Megatron's own CP code paths (rotary slicing, TE's CP attention) stay off.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_hsap.config import ContextParallelConfig

__all__ = ["HSAPPackedSeqParams", "HSAPSelfAttention"]


@dataclass
class HSAPPackedSeqParams(PackedSeqParams):
    """Megatron's THD ``PackedSeqParams`` plus the ``BatchPlan`` that placed the tokens on CP ranks.

    ``cu_seqlens_q/kv`` are the *global* document boundaries of the packed stream
    (every rank holds the same tensor); ``max_seqlen_q/kv`` the longest document,
    which sizes the rotary table GPTModel builds.
    """

    plan: Any = None


class HSAPSelfAttention(SelfAttention):
    """Self-attention whose core is HSAP's context-parallel attention over a packed, planned batch.

    Build it through ``get_gpt_layer_hsap_spec`` (param ``cp_config``) or swap it into a
    built model with ``convert_model_to_hsap``. ``core_attention`` is still built from the
    spec so state-dict keys match Megatron's layer specs, but the forward does not call it.
    """

    def __init__(self, *args: Any, cp_config: ContextParallelConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cp_config = cp_config
        check_hsap_attention_config(self.config)
        layer_window_size(self.config, self.layer_number)  # a bad window fails when the layer is built

    @property
    def hsap_window_size(self) -> Optional[Tuple[int, int]]:
        """This layer's sliding window (None = full causal attention), as Megatron configures it (a property,
        so layers converted in place by ``convert_model_to_hsap`` have it too)."""
        return layer_window_size(self.config, self.layer_number)

    @property
    def hsap_softmax_scale(self) -> float:
        if self.config.softmax_scale is not None:
            return self.config.softmax_scale
        return 1.0 / math.sqrt(self.hidden_size_per_attention_head)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                key_value_states: Optional[torch.Tensor] = None, inference_context: Any = None,
                rotary_pos_emb: Any = None, rotary_pos_cos: Optional[torch.Tensor] = None,
                rotary_pos_sin: Optional[torch.Tensor] = None, rotary_pos_cos_sin: Optional[torch.Tensor] = None,
                attention_bias: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None, sequence_len_offset: Optional[int] = None,
                *, inference_params: Any = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """hidden_states ``[t_local(/tp with sequence parallel), 1, hidden]``: this rank's tokens in plan order.

        Returns Megatron's ``(output [same layout as hidden_states], bias)``. ``attention_mask`` is
        ignored: document masking comes from the plan. ``rotary_pos_emb`` is GPTModel's table
        ``[max_doc_len, 1, 1, d_rot]`` indexed here by the plan's in-document positions.
        """
        plan = getattr(packed_seq_params, "plan", None)
        if plan is None:
            raise ValueError("HSAPSelfAttention needs packed_seq_params=HSAPPackedSeqParams(plan=...); "
                             "got " + ("None" if packed_seq_params is None else type(packed_seq_params).__name__))
        if inference_context is not None or inference_params is not None or key_value_states is not None:
            raise NotImplementedError("HSAPSelfAttention supports training/evaluation forward passes only "
                                      "(no KV-cache inference, no cross-attention)")
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by HSAPSelfAttention")
        q_table, k_table = None, None
        if rotary_pos_emb is not None:
            q_table, k_table = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
        chunk = self._head_chunk_size(plan)
        if chunk is not None:
            context = self._upipe_attention(hidden_states, plan, q_table, k_table, chunk)
        else:
            context = self._projected_attention(hidden_states, plan, q_table, k_table)
        return self.linear_proj(context.reshape(context.shape[0], 1, -1))

    def _head_chunk_size(self, plan: Any) -> Optional[int]:
        """U query heads per UPipe stage when head chunks are configured and supported here, else None."""
        heads = self.num_attention_heads_per_partition
        chunk = self.cp_config.resolve_head_chunk_size(heads, plan.topology.ulysses_size)
        if chunk == heads:
            return None
        plain_qkv = type(self.linear_qkv) is ColumnParallelLinear
        if not plain_qkv or not isinstance(self.q_layernorm, (type(None), IdentityOp)):
            _warn_upipe_fallback(type(self.linear_qkv).__name__)
            return None
        return chunk

    def _projected_attention(self, hidden_states: torch.Tensor, plan: Any, q_table: Optional[torch.Tensor],
                             k_table: Optional[torch.Tensor]) -> torch.Tensor:
        """Megatron's QKV projection, RoPE at the plan's positions, then ``context_parallel_attention``.

        Returns ``[t_local, h_q/tp, d]`` for this rank's tokens.
        """
        from megatron_hsap.attention import context_parallel_attention

        query, key, value = self.get_query_key_value_tensors(hidden_states)  # [t_local, 1, h/tp, d]
        if query.shape[1] != 1:
            raise ValueError(f"HSAPSelfAttention expects one packed stream (batch dim 1), got {query.shape[1]}")
        if q_table is not None:
            positions = plan.position_ids.to(q_table.device)
            query = apply_rotary_pos_emb(query, q_table[positions], config=self.config)
            key = apply_rotary_pos_emb(key, k_table[positions], config=self.config)

        def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return context_parallel_attention(q, k, v, plan, causal=True, softmax_scale=self.hsap_softmax_scale,
                                              window_size=self.hsap_window_size)

        if self.checkpoint_core_attention and self.training:  # --recompute-granularity selective
            return tensor_parallel.checkpoint(core, False, query[:, 0], key[:, 0], value[:, 0])
        return core(query[:, 0], key[:, 0], value[:, 0])

    def _upipe_attention(self, hidden_states: torch.Tensor, plan: Any, q_table: Optional[torch.Tensor],
                         k_table: Optional[torch.Tensor], chunk: int) -> torch.Tensor:
        """UPipe: the fused per-head-chunk QKV projection + attention (the full-head QKV is never built).

        Takes ``linear_qkv``'s weight directly, so the input goes through the same TP region
        ColumnParallelLinear would use (sequence-parallel all-gather, or copy with a backward
        all-reduce). Its backward recomputes each chunk's projection, so selective recompute
        adds nothing here. Returns ``[t_local, 1, h_q/tp * d]``.
        """
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )

        from megatron_hsap.attention.upipe import head_chunked_attention

        if q_table is not None and q_table is not k_table:
            raise NotImplementedError("UPipe takes one rotary table for queries and keys")
        tp_group = self.pg_collection.tp
        if self.config.sequence_parallel and tp_group.size() > 1:
            hidden = gather_from_sequence_parallel_region(hidden_states, group=tp_group)
        elif tp_group.size() > 1:
            hidden = copy_to_tensor_model_parallel_region(hidden_states, group=tp_group)
        else:
            hidden = hidden_states
        freqs = None
        if q_table is not None:
            freqs = q_table[plan.position_ids.to(q_table.device)].reshape(hidden.shape[0], -1)
        return head_chunked_attention(
            hidden, self.linear_qkv.weight, self.linear_qkv.bias, plan,
            num_heads_q=self.num_attention_heads_per_partition, num_heads_kv=self.num_query_groups_per_partition,
            head_dim=self.hidden_size_per_attention_head, rotary_freqs=freqs, rope_base=None, causal=True,
            softmax_scale=self.hsap_softmax_scale, head_chunk_size=chunk, window_size=self.hsap_window_size)


def layer_window_size(config: Any, layer_number: int) -> Optional[Tuple[int, int]]:
    """The sliding window of layer ``layer_number`` (1-based, Megatron's numbering): ``config.window_size``
    on the layers Megatron's ``is_layer_window_attention`` selects (``window_attn_skip_freq``: every N-th
    layer full, or a per-layer 0/1 list), None elsewhere. Validated here (causal attention: right must be
    0 or -1), so a bad config fails when the model is built, naming ``window_size``."""
    from megatron_hsap.sequence.schedule import normalize_window

    if not is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return None
    return normalize_window(tuple(config.window_size), causal=True)


_warned_upipe_fallback = False


def _warn_upipe_fallback(linear_qkv: str) -> None:
    global _warned_upipe_fallback
    if _warned_upipe_fallback:
        return
    _warned_upipe_fallback = True
    warnings.warn(f"head chunks (UPipe) need a plain ColumnParallelLinear linear_qkv and no q/k layernorm; this "
                  f"model has {linear_qkv}: using unchunked HSAP attention instead", stacklevel=3)


def check_hsap_attention_config(config: Any) -> None:
    """Reject TransformerConfig settings the HSAP attention core does not implement (before any collective)."""
    if config.attention_dropout != 0.0:
        raise ValueError(f"attention_dropout={config.attention_dropout} is not supported by HSAP attention; use 0.0")
    if getattr(config, "attention_output_gate", False):
        raise ValueError("attention_output_gate=True is not supported by HSAP attention")
