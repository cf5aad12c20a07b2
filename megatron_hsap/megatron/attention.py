"""HSAP self-attention for Megatron-Core: Megatron's projections, HSAP's context-parallel core.

Megatron's ``SelfAttention`` is built from a ``ModuleSpec`` whose ``core_attention`` submodule is the swap
point for the attention itself. ``HSAPCoreAttention`` fills it: ``context_parallel_attention``
(ring / Ulysses / hybrid / hsap per the ``ContextParallelConfig``) over the packed micro-batch as laid
out by a ``BatchPlan``, which never lets a token attend across a document boundary. ``HSAPSelfAttention``
is a Megatron ``SelfAttention`` (same submodules, parameters and state-dict keys) whose forward only
prepares what Megatron's forward cannot know, then runs Megatron's forward: the rotary tables are
gathered at the plan's in-document positions (the tokens of a rank are not in stream order), so
Megatron applies them row by row. Only head chunks need their own forward: when
``head_chunk_size`` is below the local head count, the QKV projection and attention run fused
per chunk through UPipe (``megatron_hsap.attention.upipe``), on the local spec's
``ColumnParallelLinear`` and on the TransformerEngine spec's ``TELayerNormColumnParallelLinear``
alike (its input norm is applied first, then the per-chunk projection from its weight).

Settings of the ``TransformerConfig`` / layer spec that this path does not implement
are rejected when the module is built (``check_hsap_attention_config``), never ignored.

The plan reaches the layer inside ``packed_seq_params`` (``HSAPPackedSeqParams``,
a ``PackedSeqParams`` with a ``plan`` field), the way Megatron passes THD batches.
The model's ``TransformerConfig.context_parallel_size`` stays 1: CP is handled
here, so Megatron's own CP code paths (rotary slicing, TE's CP attention) stay off.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_hsap.config import ContextParallelConfig

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_hsap.sequence.plan import BatchPlan

__all__ = ["HSAPPackedSeqParams", "HSAPCoreAttention", "HSAPSelfAttention", "check_hsap_attention_config"]

#: GPTModel's rotary table ``[max_doc_len, 1, 1, d_rot]``, or one for queries and one for keys.
RotaryTables = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]
#: Mask types of a causal decoder: within a packed document, bottom-right and top-left alignment coincide.
CAUSAL_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)
#: Mask types of full (bidirectional) attention inside each document; padding never takes part (the plan).
FULL_MASK_TYPES = (AttnMaskType.no_mask, AttnMaskType.padding)


@dataclass
class HSAPPackedSeqParams(PackedSeqParams):
    """Megatron's THD ``PackedSeqParams`` plus the ``BatchPlan`` that placed the tokens on CP ranks.

    ``cu_seqlens_q/kv`` are the *global* document boundaries of the packed stream
    (every rank holds the same tensor); ``max_seqlen_q/kv`` the longest document,
    which sizes the rotary table GPTModel builds.
    """

    plan: Optional["BatchPlan"] = None


def _plan_of(packed_seq_params: Optional[PackedSeqParams], who: str) -> "BatchPlan":
    plan = getattr(packed_seq_params, "plan", None)
    if plan is None:
        raise ValueError(f"{who} needs packed_seq_params=HSAPPackedSeqParams(plan=...); "
                         "got " + ("None" if packed_seq_params is None else type(packed_seq_params).__name__))
    return plan


class HSAPCoreAttention(MegatronModule):
    """The ``core_attention`` submodule of an HSAP layer spec: ``context_parallel_attention`` over the plan in
    ``packed_seq_params`` (constructor arguments: those Megatron's ``Attention`` passes to its core attention).

    Causal or full attention inside each document from the mask type, Megatron's sliding window of this
    layer (``layer_window_size``), ``softmax_scale`` or 1/sqrt(head_dim). The tokens are this rank's share
    of the packed stream in plan order with rotary embeddings already applied (``HSAPSelfAttention``
    gathers the tables at the plan's positions); ``attention_mask`` is ignored, document masking comes
    from the plan.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: Optional["ProcessGroupCollection"] = None) -> None:
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError(f"attention_type={attention_type!r} is not supported by HSAP attention; allowed: 'self'")
        check_hsap_attention_config(config, attn_mask_type)
        self.layer_number, self.attn_mask_type, self.softmax_scale = layer_number, attn_mask_type, softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None, attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        """query ``[t_local, 1, h_q/tp, d]``, key/value ``[t_local, 1, h_kv/tp, d]``: this rank's tokens in plan
        order. Returns ``[t_local, 1, h_q/tp * d]``."""
        from megatron_hsap.attention import context_parallel_attention

        plan = _plan_of(packed_seq_params, "HSAPCoreAttention")
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by HSAP attention")
        if query.dim() != 4:  # Megatron's THD path would apply rotary embeddings in stream order: wrong here
            raise ValueError(f"HSAPCoreAttention takes [t_local, 1, heads, d] from HSAPSelfAttention, got query of "
                             f"shape {tuple(query.shape)} (use HSAPSelfAttention, get_gpt_layer_hsap_spec)")
        if query.shape[1] != 1:
            raise ValueError(f"HSAP attention expects one packed stream (batch dim 1), got {query.shape[1]}")
        q, k, v = query[:, 0], key[:, 0], value[:, 0]
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal = mask_type in CAUSAL_MASK_TYPES
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        out = context_parallel_attention(q, k, v, plan, causal=causal, softmax_scale=scale,
                                         window_size=layer_window_size(self.config, self.layer_number, causal))
        return out.reshape(out.shape[0], 1, -1)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """Accepts (and drops) ``_extra_state``: TransformerEngine's ``TEDotProductAttention`` saves its fp8
        metadata there, which a checkpoint of Megatron's TE spec holds for this submodule."""
        state_dict.pop(prefix + "_extra_state", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class HSAPSelfAttention(SelfAttention):
    """Self-attention whose core is HSAP's context-parallel attention over a packed, planned batch.

    Build it through ``get_gpt_layer_hsap_spec`` (param ``cp_config``; its ``core_attention`` is
    ``HSAPCoreAttention``) or swap it into a built model with ``convert_model_to_hsap``.
    """

    def __init__(self, config: TransformerConfig, submodules: SelfAttentionSubmodules, layer_number: int,
                 attn_mask_type: AttnMaskType = AttnMaskType.padding, *args: Any, cp_config: ContextParallelConfig,
                 **kwargs: Any) -> None:
        # Checked before Megatron builds anything: the same error on every rank, before any collective.
        check_hsap_attention_config(config, attn_mask_type)
        _check_submodules_buildable(submodules)
        super().__init__(config, submodules, layer_number, attn_mask_type, *args, **kwargs)
        self.cp_config = cp_config
        self._check_core_attention()

    @property
    def hsap_causal(self) -> bool:
        """Causal attention inside each document (else full, see ``FULL_MASK_TYPES``)."""
        return self.attn_mask_type in CAUSAL_MASK_TYPES

    @property
    def hsap_window_size(self) -> Optional[Tuple[int, int]]:
        """This layer's sliding window (None = no window), as Megatron configures it (a property, so layers
        converted in place by ``convert_model_to_hsap`` have it too)."""
        return layer_window_size(self.config, self.layer_number, self.hsap_causal)

    @property
    def hsap_softmax_scale(self) -> float:
        if self.config.softmax_scale is not None:
            return self.config.softmax_scale
        return 1.0 / math.sqrt(self.hidden_size_per_attention_head)

    def _check_core_attention(self) -> None:
        if not isinstance(self.core_attention, HSAPCoreAttention):
            raise ValueError(f"HSAPSelfAttention needs core_attention=HSAPCoreAttention in its spec, got "
                             f"{type(self.core_attention).__name__} (build the layer with get_gpt_layer_hsap_spec or "
                             "convert the model with convert_model_to_hsap)")

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                key_value_states: Optional[torch.Tensor] = None, inference_context: Any = None,
                rotary_pos_emb: Optional[RotaryTables] = None, rotary_pos_cos: Optional[torch.Tensor] = None,
                rotary_pos_sin: Optional[torch.Tensor] = None, rotary_pos_cos_sin: Optional[torch.Tensor] = None,
                attention_bias: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None, sequence_len_offset: Optional[int] = None,
                *, inference_params: Any = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """hidden_states ``[t_local(/tp with sequence parallel), 1, hidden]``: this rank's tokens in plan order.

        Returns Megatron's ``(output [same layout as hidden_states], bias)``. ``attention_mask`` is
        ignored: document masking comes from the plan. ``rotary_pos_emb`` is GPTModel's table
        ``[max_doc_len, 1, 1, d_rot]``, gathered here at the plan's in-document positions
        (``[t_local, 1, 1, d_rot]``, row i for token i) so Megatron's forward applies it row by row; the
        ``packed_seq_params`` Megatron sees therefore say ``qkv_format='sbhd'`` (one stream, batch dim 1).
        """
        plan = _plan_of(packed_seq_params, "HSAPSelfAttention")
        if inference_context is not None or inference_params is not None or key_value_states is not None:
            raise NotImplementedError("HSAPSelfAttention supports training/evaluation forward passes only "
                                      "(no KV-cache inference, no cross-attention)")
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by HSAPSelfAttention")
        if self.config.no_rope_freq and self.config.no_rope_freq[self.layer_number - 1]:
            rotary_pos_emb = None  # a NoPE layer, as in Megatron's SelfAttention
        q_table, k_table = None, None
        if rotary_pos_emb is not None:
            q_table, k_table = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
        chunk = self._head_chunk_size(plan)
        if chunk is not None:
            context = self._upipe_attention(hidden_states, plan, q_table, k_table, chunk)
            return self.linear_proj(context.reshape(context.shape[0], 1, -1))
        self._check_core_attention()
        if q_table is not None:
            positions = plan.position_ids_on(q_table.device)  # copied once per micro-batch, not per layer
            rotary_pos_emb = (q_table[positions], k_table[positions])
        return super().forward(hidden_states, attention_mask, rotary_pos_emb=rotary_pos_emb,
                               packed_seq_params=dataclasses.replace(packed_seq_params, qkv_format="sbhd"))

    def _head_chunk_size(self, plan: "BatchPlan") -> Optional[int]:
        """U query heads per UPipe stage when head chunks are configured and supported here, else None."""
        heads = self.num_attention_heads_per_partition
        chunk = self.cp_config.resolve_head_chunk_size(heads, plan.topology.ulysses_size)
        if chunk == heads:
            return None
        if self.config.fp8 or self.config.fp4:
            raise ValueError(f"head chunks (head_chunk_size={chunk} < {heads} heads per TP rank) run the QKV GEMM "
                             f"outside TransformerEngine and do not implement fp8={self.config.fp8!r} / "
                             f"fp4={self.config.fp4!r}; set head_chunk_size={heads} (no chunks) or train in bf16")
        qk_norm = not all(isinstance(m, (type(None), IdentityOp)) for m in (self.q_layernorm, self.k_layernorm))
        if qk_norm or not (type(self.linear_qkv) is ColumnParallelLinear or _has_input_norm(self.linear_qkv)):
            _warn_upipe_fallback("q/k layernorm" if qk_norm else f"linear_qkv {type(self.linear_qkv).__name__}")
            return None
        return chunk

    def _upipe_attention(self, hidden_states: torch.Tensor, plan: "BatchPlan", q_table: Optional[torch.Tensor],
                         k_table: Optional[torch.Tensor], chunk: int) -> torch.Tensor:
        """UPipe: the fused per-head-chunk QKV projection + attention (the full-head QKV is never built).

        Takes ``linear_qkv``'s weight directly (after its input norm when it is TE's
        ``TELayerNormColumnParallelLinear``) with ColumnParallelLinear's TP semantics: under
        sequence parallelism ``head_chunked_attention`` gathers the shard itself and keeps only
        the shard for the backward; without it the input is copied into the TP region (backward
        all-reduce). Its backward recomputes each chunk's projection, so selective recompute
        adds nothing here. Returns ``[t_local, 1, h_q/tp * d]``.
        """
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        from megatron_hsap.attention.upipe import head_chunked_attention

        if q_table is not None and q_table is not k_table:
            raise NotImplementedError("UPipe takes one rotary table for queries and keys")
        hidden = hidden_states
        if _has_input_norm(self.linear_qkv):
            hidden = _input_norm(self.linear_qkv, hidden)
        tp_group, sp_group = self.pg_collection.tp, None
        if self.config.sequence_parallel and tp_group.size() > 1:
            sp_group = tp_group
        elif tp_group.size() > 1:
            hidden = copy_to_tensor_model_parallel_region(hidden, group=tp_group)
        freqs = None
        if q_table is not None:
            freqs = q_table[plan.position_ids_on(q_table.device)].reshape(plan.tokens_per_rank, -1)
        bias = self.linear_qkv.bias
        if bias is not None and bias.numel() == 0:  # TE keeps an empty tensor when bias=False
            bias = None
        return head_chunked_attention(
            hidden, self.linear_qkv.weight, bias, plan,
            num_heads_q=self.num_attention_heads_per_partition, num_heads_kv=self.num_query_groups_per_partition,
            head_dim=self.hidden_size_per_attention_head, rotary_freqs=freqs, rope_base=None,
            causal=self.hsap_causal, softmax_scale=self.hsap_softmax_scale, head_chunk_size=chunk,
            rotary_interleaved=self.config.rotary_interleaved, sequence_parallel_group=sp_group,
            window_size=self.hsap_window_size)


def layer_window_size(config: TransformerConfig, layer_number: int, causal: bool = True) -> Optional[Tuple[int, int]]:
    """The sliding window of layer ``layer_number`` (1-based, Megatron's numbering): ``config.window_size``
    on the layers Megatron's ``is_layer_window_attention`` selects (``window_attn_skip_freq``: every N-th
    layer full, or a per-layer 0/1 list), None elsewhere; ``check_hsap_attention_config`` has already
    refused windows the layer cannot have (causal layers: right must be 0 or -1)."""
    from megatron_hsap.sequence.schedule import normalize_window

    if not is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return None
    return normalize_window(config.window_size, causal=causal)


_warned_upipe_fallback = False


def _warn_upipe_fallback(what: str) -> None:
    global _warned_upipe_fallback
    if _warned_upipe_fallback:
        return
    _warned_upipe_fallback = True
    warnings.warn(f"head chunks (UPipe) need a ColumnParallelLinear or TELayerNormColumnParallelLinear linear_qkv "
                  f"and no q/k layernorm; this model has {what}: using unchunked HSAP attention instead", stacklevel=3)


#: The attributes of TransformerEngine's ``LayerNormLinear`` (Megatron's ``TELayerNormColumnParallelLinear``)
#: that define its input norm; a linear_qkv with all of them normalizes its input before the GEMM.
INPUT_NORM_ATTRIBUTES = ("layer_norm_weight", "layer_norm_bias", "normalization", "zero_centered_gamma", "eps")


def _has_input_norm(linear: torch.nn.Module) -> bool:
    return all(hasattr(linear, name) for name in INPUT_NORM_ATTRIBUTES)


def _input_norm(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The norm TE's ``LayerNormLinear`` applies before its GEMM, by autograd (so its weight/bias get gradients).

    x ``[t(/tp under sequence parallelism), 1, hidden]``: this rank's rows, normalized before any gather,
    as TE does. Computed in fp32 (fp64 stays fp64) and cast back, like TE's kernels, so
    ``zero_centered_gamma``'s ``1 + gamma`` is not rounded to bf16; autograd keeps that fp32 copy of x.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    weight = linear.layer_norm_weight.to(compute)
    if linear.zero_centered_gamma:
        weight = weight + 1
    if linear.normalization == "LayerNorm":
        bias = None if linear.layer_norm_bias is None else linear.layer_norm_bias.to(compute)
        y = F.layer_norm(x.to(compute), weight.shape, weight, bias, linear.eps)
    elif linear.normalization == "RMSNorm":
        y = F.rms_norm(x.to(compute), weight.shape, weight, linear.eps)
    else:
        raise ValueError(f"{type(linear).__name__}.normalization={linear.normalization!r} is not supported with "
                         "head chunks; allowed: 'LayerNorm', 'RMSNorm'")
    return y.to(x.dtype)


def _check_submodules_buildable(submodules: SelfAttentionSubmodules) -> None:
    """A TE spec built where TransformerEngine is not installed holds Megatron's placeholders for the TE
    classes, which would "build" without an error: refuse them by name."""
    from megatron.core.extensions import transformer_engine as te_ext

    if te_ext.HAVE_TE:
        return
    placeholders = {id(value) for name, value in vars(te_ext).items() if name.startswith("TE")}
    for field in dataclasses.fields(submodules):
        module = getattr(submodules, field.name)
        module = module.module if isinstance(module, ModuleSpec) else module
        if id(module) in placeholders:
            raise ValueError(f"self_attention submodule {field.name}={module!r} is a TransformerEngine class, but "
                             "transformer_engine is not installed; use the local spec (--transformer-impl local)")


def check_hsap_attention_config(config: TransformerConfig, attn_mask_type: AttnMaskType = AttnMaskType.causal) -> None:
    """Reject settings the HSAP attention path does not implement, with the allowed values.

    Called when ``HSAPSelfAttention`` is built (and by ``convert_model_to_hsap``), so a bad
    setting fails on every rank before any collective instead of silently changing results.
    Implemented, hence accepted: causal and full (``FULL_MASK_TYPES``) masks inside each
    document, ``rotary_interleaved`` (also with head chunks), ``no_rope_freq``.
    """
    # --- Sliding window: per layer (``layer_window_size``); a window this mask type cannot have is refused. ---
    if config.window_size is not None:
        from megatron_hsap.sequence.schedule import normalize_window

        normalize_window(config.window_size, attn_mask_type in CAUSAL_MASK_TYPES)
    # --- Everything else the HSAP core does not implement. ---
    if config.attention_dropout != 0.0:
        raise ValueError(f"attention_dropout={config.attention_dropout} is not supported by HSAP attention; use 0.0")
    if config.attention_output_gate:
        raise ValueError("attention_output_gate=True is not supported by HSAP attention; allowed: False")
    if config.softmax_type != "vanilla":
        raise ValueError(f"softmax_type={config.softmax_type!r} (attention sinks) is not supported by HSAP "
                         "attention; allowed: 'vanilla'")
    if config.qk_l2_norm:
        raise ValueError("qk_l2_norm=True is not supported by HSAP attention; allowed: False")
    if config.qk_clip or config.log_max_attention_logit:
        raise ValueError(f"qk_clip={config.qk_clip} / log_max_attention_logit={config.log_max_attention_logit} need "
                         "the attention logits, which HSAP attention does not report; allowed: False")
    if config.multi_latent_attention:
        raise ValueError("multi_latent_attention=True is not supported by HSAP attention (it replaces "
                         "SelfAttention only); allowed: False")
    if attn_mask_type not in CAUSAL_MASK_TYPES + FULL_MASK_TYPES:
        allowed = ", ".join(m.name for m in CAUSAL_MASK_TYPES + FULL_MASK_TYPES)
        raise ValueError(f"attn_mask_type={attn_mask_type.name} is not supported by HSAP attention (it masks by the "
                         f"plan's documents); allowed: {allowed}")
