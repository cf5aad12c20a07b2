"""HSAP attention on Megatron's two layer specs, and the attention settings it rejects.

- Rejections: every TransformerConfig / mask setting HSAP attention does not implement raises a
  ValueError naming it when ``HSAPSelfAttention`` is built, before Megatron allocates anything.
- The TransformerEngine spec: its ModuleSpec tree (built here without TE) and the head-chunked
  path on ``TELayerNormColumnParallelLinear``, run on CPU through a stand-in module with TE's
  attributes and maths (only TE's kernel itself needs a GPU, see the skipped test).
- Head chunks under TP with sequence parallelism: gradients exact and only the local shard saved.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import run_distributed_fresh

HIDDEN, HEADS, GROUPS = 64, 8, 4
DOCS = [0, 21, 30, 64]  # packed documents of one micro-batch (global cu_seqlens)


def _config(**overrides: Any) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hsap.megatron.cpu_shim import cpu_config_overrides

    base = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, bias_activation_fusion=False,
                masked_softmax_fusion=False, gradient_accumulation_fusion=False, apply_rope_fusion=False)
    return TransformerConfig(**{**base, **cpu_config_overrides(), **overrides})


REJECTED = [
    (dict(window_size=(16, 4)), None, "window_size=\\(16, 4\\) has right=4 with causal=True; allowed values"),
    (dict(softmax_type="off-by-one"), None, "softmax_type='off-by-one'.*allowed: 'vanilla'"),
    (dict(softmax_type="learnable"), None, "softmax_type='learnable'"),
    (dict(qk_l2_norm=True), None, "qk_l2_norm=True.*allowed: False"),
    (dict(qk_clip=True), None, "qk_clip=True"),
    (dict(log_max_attention_logit=True), None, "log_max_attention_logit=True"),
    (dict(multi_latent_attention=True), None, "multi_latent_attention=True.*allowed: False"),
    (dict(attention_dropout=0.1), None, "attention_dropout=0.1"),
    (dict(attention_output_gate=True), None, "attention_output_gate=True"),
    ({}, "arbitrary", "attn_mask_type=arbitrary.*allowed: causal, padding_causal, causal_bottom_right, no_mask, "
                      "padding"),
]


@pytest.mark.parametrize("overrides,mask,match", REJECTED, ids=[m.split("=")[0].strip("\\") for *_, m in REJECTED])
def test_unimplemented_settings_are_rejected_at_construction(overrides, mask, match):
    """Raised by HSAPSelfAttention's constructor before Megatron builds anything (no process groups exist here)."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.megatron.spec import get_gpt_layer_hsap_spec

    spec = get_gpt_layer_hsap_spec(ContextParallelConfig(), use_transformer_engine=False).submodules.self_attention
    mask_type = AttnMaskType[mask] if mask else AttnMaskType.causal
    with pytest.raises(ValueError, match=match):
        spec.module(config=_config(**overrides), submodules=spec.submodules, layer_number=1,
                    attn_mask_type=mask_type, cp_config=spec.params["cp_config"])


def test_implemented_mask_types_are_accepted():
    from megatron_hsap.megatron.attention import CAUSAL_MASK_TYPES, FULL_MASK_TYPES, check_hsap_attention_config

    config = _config(rotary_interleaved=True, no_rope_freq=2)
    for mask in CAUSAL_MASK_TYPES + FULL_MASK_TYPES:
        check_hsap_attention_config(config, mask)


def test_transformer_impl_choice():
    from megatron_hsap.megatron.spec import transformer_engine_usable, use_transformer_engine

    assert use_transformer_engine("local") is False
    with pytest.raises(ValueError, match="transformer_impl='te' is not supported; allowed: local, transformer_engine"):
        use_transformer_engine("te")
    if transformer_engine_usable():
        assert use_transformer_engine("transformer_engine") is True
    else:
        with pytest.raises(ValueError, match="needs the transformer_engine package and a CUDA device"):
            use_transformer_engine("transformer_engine")


def _dense_mlp(spec: Any) -> tuple:
    """(MLP class, MLPSubmodules) of a layer spec's dense MLP in the installed release's form: 0.18+ builds it as
    ``functools.partial(MLP.as_mlp_submodule, submodules=...)``, earlier ones as ``ModuleSpec(module=MLP)``."""
    import functools

    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_hsap.megatron import versions

    mlp = spec.submodules.mlp
    if versions.MLP_SPEC_IS_BUILDER:
        assert isinstance(mlp, functools.partial) and mlp.func.__name__ == "as_mlp_submodule", mlp
        return mlp.func.__self__, mlp.keywords["submodules"]
    assert isinstance(mlp, ModuleSpec), mlp
    return mlp.module, mlp.submodules


@pytest.mark.parametrize("use_te", [False, True])
def test_spec_rewrites_fail_loudly_when_nothing_matches(use_te):
    """Every rewrite of Megatron's layer spec raises when the spec does not have the shape it rewrites (another
    release's MLP form, an MoE layer, a non-SelfAttention, missing norms): never a silently unchanged spec."""
    import functools

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.megatron import spec as hsap_spec
    from megatron_hsap.megatron.cpu_shim import transformer_engine_spec_without_te

    cp_config = ContextParallelConfig(mode="hsap")
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        with transformer_engine_spec_without_te():
            layer = get_gpt_layer_with_transformer_engine_spec()
    else:
        layer = get_gpt_layer_local_spec()
    builder, submodules = _dense_mlp(layer)
    other_form = (ModuleSpec(module=MLP, submodules=submodules) if isinstance(layer.submodules.mlp, functools.partial)
                  else functools.partial(getattr(MLP, "as_mlp_submodule", MLP), submodules=submodules))
    for mlp in (other_form, IdentityOp):
        edited = hsap_spec._copy_spec(layer)
        edited.submodules.mlp = mlp
        with pytest.raises(ValueError, match="the layer spec's mlp is .*mlp_sequence_chunks=3 tiles only"):
            hsap_spec._use_tiled_mlp(edited, 3)
    edited = hsap_spec._copy_spec(layer)
    edited.submodules.self_attention = IdentityOp
    with pytest.raises(ValueError, match="the layer spec's self_attention is .*not ModuleSpec\\(module=SelfAttention"):
        hsap_spec._use_hsap_attention(edited, cp_config)
    if use_te:  # the TE spec fuses its norms into the linears: nothing of them is rewritten
        return
    with pytest.raises(ValueError, match="mlp_sequence_chunks=2 tiles only a dense MLP"):
        hsap_spec.get_gpt_layer_hsap_spec(cp_config, num_experts=4, use_transformer_engine=False,
                                          mlp_sequence_chunks=2)
    edited = hsap_spec._copy_spec(layer)
    edited.submodules.pre_mlp_layernorm = IdentityOp
    with pytest.raises(ValueError, match="the layer spec's pre_mlp_layernorm is .*not a norm"):
        hsap_spec._use_sequence_parallel_norms(edited)


def test_transformer_engine_spec_structure():
    """The TE spec is Megatron's TE layer spec with HSAPSelfAttention; the input norm lives in linear_qkv."""
    from megatron.core.extensions import transformer_engine as te
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP

    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.megatron.attention import HSAPCoreAttention, HSAPSelfAttention
    from megatron_hsap.megatron.sequence_chunks import TiledMLP
    from megatron_hsap.megatron.spec import get_gpt_layer_hsap_spec

    cp_config = ContextParallelConfig(mode="hsap")
    spec = get_gpt_layer_hsap_spec(cp_config, use_transformer_engine=True)
    attention = spec.submodules.self_attention
    assert attention.module is HSAPSelfAttention
    assert attention.params == {"attn_mask_type": AttnMaskType.causal, "cp_config": cp_config}
    sub = attention.submodules
    assert sub.linear_qkv is te.TELayerNormColumnParallelLinear
    assert sub.core_attention is HSAPCoreAttention
    assert sub.linear_proj is te.TERowParallelLinear
    assert sub.q_layernorm is IdentityOp and sub.k_layernorm is IdentityOp
    assert spec.submodules.input_layernorm is IdentityOp  # fused into linear_qkv
    builder, mlp_submodules = _dense_mlp(spec)
    assert builder is MLP
    assert mlp_submodules.linear_fc1 is te.TELayerNormColumnParallelLinear
    assert mlp_submodules.linear_fc2 is te.TERowParallelLinear
    tiled_builder, tiled_submodules = _dense_mlp(get_gpt_layer_hsap_spec(cp_config, use_transformer_engine=True,
                                                                         mlp_sequence_chunks=3))
    assert tiled_builder is TiledMLP and tiled_submodules == mlp_submodules
    qk_norm = get_gpt_layer_hsap_spec(cp_config, use_transformer_engine=True, qk_layernorm=True)
    assert qk_norm.submodules.self_attention.submodules.q_layernorm is te.TENorm
    if not te.HAVE_TE:  # Megatron's TE names are placeholders here: building must fail clearly, not "succeed"
        with pytest.raises(ValueError, match="linear_qkv=.* is a TransformerEngine class, but transformer_engine is "
                                             "not installed; use the local spec"):
            attention.module(config=_config(), submodules=sub, layer_number=1, cp_config=cp_config)


def test_interleaved_rope_matches_megatron():
    """UPipe's interleaved RoPE is Megatron's (RotaryEmbedding(rotary_interleaved=True) + apply_rotary_pos_emb) bit
    for bit, and its transpose is the exact adjoint."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_hsap.attention.upipe import _Rope, rope_angles

    d, h = 16, 3
    positions = torch.tensor([0, 5, 1, 36, 2, 0, 7] * 3)
    table = RotaryEmbedding(kv_channels=d, rotary_percent=1.0, rotary_interleaved=True, use_cpu_initialization=True)
    freqs = table.get_freqs_non_repeated(64)
    emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(64, -1)[positions]  # RotaryEmbedding's
    assert torch.equal(rope_angles(positions, d, interleaved=True), emb)
    x = torch.randn(len(positions), 1, h, d, dtype=torch.float64)
    want = _apply_rotary_pos_emb_bshd(x, emb[:, None, None, :], rotary_interleaved=True)
    got = x.clone()
    _Rope(emb, x.dtype, interleaved=True).apply_(got)
    assert torch.equal(got, want)
    g = torch.randn_like(x)
    adj = g.clone()
    _Rope(emb, x.dtype, interleaved=True).transpose_(adj)
    assert abs((want * g).sum().item() - (x * adj).sum().item()) < 1e-10


class LayerNormColumnLinearStandIn(torch.nn.Module):
    """CPU stand-in for Megatron's ``TELayerNormColumnParallelLinear``: its constructor, its attributes
    (``layer_norm_weight``, ``layer_norm_bias``, ``weight``, ``bias``, ``normalization``, ``zero_centered_gamma``,
    ``eps``) and TE's maths, written out independently: norm of this rank's rows, sequence-parallel all-gather (or
    TP copy), GEMM + bias. Initialised like TE (gamma 1, or 0 when zero-centered; beta 0)."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, tp_group: Any, bias: bool,
                 **unused: Any) -> None:
        super().__init__()
        tp, rank = tp_group.size(), tp_group.rank()
        self.config, self.tp_group = config, tp_group
        self.normalization, self.eps = config.normalization, config.layernorm_epsilon
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        gamma = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(gamma(input_size, dtype=config.params_dtype))
        self.layer_norm_bias = None
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype))
        shard = torch.Generator().manual_seed(11 + rank)
        self.weight = torch.nn.Parameter(torch.randn(output_size // tp, input_size, generator=shard,
                                                     dtype=config.params_dtype) / input_size ** 0.5)
        self.bias = torch.nn.Parameter(0.1 * torch.randn(output_size // tp, generator=shard,
                                                         dtype=config.params_dtype)) if bias else None

    def forward(self, x: torch.Tensor):
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )

        gamma = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        if self.normalization == "LayerNorm":
            centered = x - x.mean(-1, keepdim=True)
            y = centered / torch.sqrt(centered.pow(2).mean(-1, keepdim=True) + self.eps) * gamma + self.layer_norm_bias
        else:
            y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * gamma
        if self.tp_group.size() > 1:
            y = (gather_from_sequence_parallel_region(y, group=self.tp_group) if self.config.sequence_parallel
                 else copy_to_tensor_model_parallel_region(y, group=self.tp_group))
        return F.linear(y, self.weight, self.bias), None


CASES = [  # (tp, cp, TransformerConfig overrides, mask type, linear_qkv: the TE-structured stand-in or Megatron's)
    (1, 2, dict(normalization="LayerNorm", layernorm_zero_centered_gamma=True), "causal", LayerNormColumnLinearStandIn),
    (1, 2, dict(normalization="RMSNorm", rotary_interleaved=True), "no_mask", LayerNormColumnLinearStandIn),
    (2, 1, dict(normalization="LayerNorm", sequence_parallel=True, rotary_interleaved=True), "causal",
     LayerNormColumnLinearStandIn),
    (2, 1, dict(normalization="RMSNorm", sequence_parallel=True), "causal", None),
]


def _attention_grads(attention: Any, hidden: torch.Tensor, table: torch.Tensor, params: Any,
                     grad_out: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Loss = <output + bias, grad_out>; returns the output and every gradient (input and parameters)."""
    attention.zero_grad(set_to_none=True)
    x = hidden.detach().requires_grad_()
    out, bias = attention(x, None, rotary_pos_emb=table, packed_seq_params=params)
    ((out + bias) * grad_out).sum().backward()
    got = {"out": out.detach(), "dx": x.grad}
    got.update({name: p.grad for name, p in attention.named_parameters()})
    return got


def _saved_activation_shapes(attention: Any, hidden: torch.Tensor, table: torch.Tensor, params: Any) -> List:
    """Shapes of the non-parameter tensors the forward saves for the backward."""
    shapes: List = []
    param_ptrs = {p.data_ptr() for p in attention.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in param_ptrs:
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attention(hidden.detach().requires_grad_(), None, rotary_pos_emb=table, packed_seq_params=params)
    return shapes


def _head_chunks_case(tp: int, cp: int, overrides: Dict[str, Any], mask: str, linear_qkv: Optional[type],
                      dtype: torch.dtype = torch.float64) -> Dict[str, Any]:
    """One case on this rank: the attention's output and gradients with head chunks vs without (relative errors),
    and the saved activation shapes under sequence parallelism. CUDA when available (TE), else CPU."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.megatron.attention import HSAPPackedSeqParams
    from megatron_hsap.megatron.spec import get_gpt_layer_hsap_spec
    from megatron_hsap.parallel_state import get_cp_topology, initialize_model_parallel
    from megatron_hsap.sequence.plan import plan_batch

    heads = HEADS // tp
    cp_config = ContextParallelConfig(mode="ulysses", head_chunk_size=cp)  # the smallest chunk: most stages
    initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp, cp_config=cp_config)
    model_parallel_cuda_manual_seed(3)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    config = _config(tensor_model_parallel_size=tp, params_dtype=dtype, add_bias_linear=True, **overrides)
    spec = get_gpt_layer_hsap_spec(cp_config, use_transformer_engine=False).submodules.self_attention
    if linear_qkv is not None:  # the TE spec's attention: the input norm inside linear_qkv
        spec.submodules.linear_qkv = linear_qkv
    spec.params["attn_mask_type"] = AttnMaskType[mask]
    attention = spec.module(config=config, submodules=spec.submodules, layer_number=1, **spec.params).to(device)
    assert attention.q_layernorm is None or isinstance(attention.q_layernorm, IdentityOp)
    noise = torch.Generator().manual_seed(5)  # the same on every TP rank: norm parameters are replicated
    with torch.no_grad():  # away from their initial 1 / 0, so a wrong norm or a missing gradient shows
        for name, param in attention.named_parameters():
            if "layer_norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=noise).to(param))

    cu = torch.tensor(DOCS, dtype=torch.int32)
    plan = plan_batch(cu, get_cp_topology(), "zigzag")
    params = HSAPPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=64,
                                 max_seqlen_kv=64, plan=plan)
    table = RotaryEmbedding(kv_channels=HIDDEN // HEADS, rotary_percent=1.0, use_cpu_initialization=True,
                            rotary_interleaved=config.rotary_interleaved)(64, packed_seq=True).to(device)
    rows = plan.tokens_per_rank // tp  # this TP rank's rows under sequence parallelism
    tp_rank = torch.distributed.get_rank() % tp
    sp = config.sequence_parallel
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank() // tp)  # same on the TP ranks of a CP rank
    full = torch.randn(plan.tokens_per_rank, 1, HIDDEN, generator=gen).to(device, dtype)
    hidden = full[tp_rank * rows:(tp_rank + 1) * rows] if sp else full
    grad_out = torch.randn(hidden.shape, generator=gen).to(device, dtype)

    chunked = _attention_grads(attention, hidden, table, params, grad_out)
    assert attention._head_chunk_size(plan) == cp < heads  # the head-chunked path ran
    attention.cp_config = dataclasses.replace(cp_config, head_chunk_size=heads)
    assert attention._head_chunk_size(plan) is None
    plain = _attention_grads(attention, hidden, table, params, grad_out)
    assert chunked.keys() == plain.keys() and all(v is not None for v in chunked.values()), chunked.keys()
    errors = {k: ((chunked[k] - plain[k]).abs().max() / plain[k].abs().max().clamp_min(1e-30)).item()
              for k in plain}
    attention.cp_config = cp_config
    saved = _saved_activation_shapes(attention, hidden, table, params) if sp else []
    with torch.no_grad():  # no_rope_freq: this layer (number 1) becomes a NoPE layer, as in Megatron
        config.no_rope_freq = [1, 0]
        nope = attention(hidden, None, rotary_pos_emb=table, packed_seq_params=params)[0]
        config.no_rope_freq = None
        no_table = attention(hidden, None, rotary_pos_emb=None, packed_seq_params=params)[0]
    return {"errors": errors, "saved": saved, "rows": rows, "tokens": plan.tokens_per_rank,
            "names": sorted(chunked), "nope_is_no_rope": torch.equal(nope, no_table),
            "rope_matters": not torch.allclose(no_table, chunked["out"])}


def _head_chunks_body() -> List[Dict[str, Any]]:
    """All CASES in one 2-rank job (one process start for the lot)."""
    from megatron_hsap.megatron.cpu_shim import apply_cpu_shim
    from megatron_hsap.parallel_state import destroy_model_parallel

    apply_cpu_shim()
    results = []
    for case in CASES:
        results.append(_head_chunks_case(*case))
        destroy_model_parallel()
    return results


def test_head_chunks_match_unchunked_path():
    """fp64, 2 gloo ranks: output, input gradient and every parameter gradient (norm weight/bias, QKV weight/bias,
    output projection) of the head-chunked path equal the unchunked path (linear_qkv's own forward + HSAP core
    attention), for each of CASES."""
    for case, (rank0, rank1) in zip(CASES, zip(*run_distributed_fresh(_head_chunks_body, 2, timeout=300))):
        tp, cp, overrides, mask, linear_qkv = case
        for result in (rank0, rank1):
            if linear_qkv is not None:
                assert {"linear_qkv.layer_norm_weight", "linear_qkv.weight", "linear_qkv.bias"} <= set(result["names"])
            assert max(result["errors"].values()) < 1e-12, (case, result["errors"])
            assert result["nope_is_no_rope"] and result["rope_matters"]
            if overrides.get("sequence_parallel"):
                # Only this TP rank's rows [t/tp, 1, hidden] of the attention input are kept for the backward,
                # never the gathered [t, 1, hidden] (Megatron's ColumnParallelLinear semantics).
                inputs = [s for s in result["saved"] if s[-1] == HIDDEN and len(s) == 3]
                assert inputs and all(s[0] == result["rows"] for s in inputs), (case, result["saved"])


def _transformer_engine_body() -> Dict[str, Any]:
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear

    return _head_chunks_case(1, 1, dict(normalization="LayerNorm", layernorm_zero_centered_gamma=True,
                                        bf16=True), "causal", TELayerNormColumnParallelLinear, torch.bfloat16)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None or not torch.cuda.is_available(),
                    reason="TELayerNormColumnParallelLinear's kernel needs transformer_engine and a CUDA device; the "
                           "TE spec's structure and the head-chunked maths on its attributes are tested above on CPU")
def test_transformer_engine_linear_qkv_head_chunks():
    """bf16 on one GPU: head chunks on TE's own TELayerNormColumnParallelLinear match its fused forward/backward."""
    result = run_distributed_fresh(_transformer_engine_body, 1, timeout=300)[0]
    assert {"linear_qkv.layer_norm_weight", "linear_qkv.layer_norm_bias", "linear_qkv.weight"} <= set(result["names"])
    assert max(result["errors"].values()) < 3e-2, result["errors"]
