"""Layer specs for Megatron-Core's ``GPTModel`` with HSAP self-attention.

In the style of Megatron's ``get_gpt_layer_local_spec`` /
``get_gpt_layer_with_transformer_engine_spec``: the specs are Megatron's own (TE
modules, as ``--transformer-impl transformer_engine`` selects, or local modules)
with one change, the self-attention module is ``HSAPSelfAttention``. On the TE spec
the input norm is fused into ``linear_qkv`` (``TELayerNormColumnParallelLinear``),
which the head-chunked path handles. On CPU the local spec's norms are
``SequenceParallelTorchNorm`` (see ``cpu_shim``) so sequence parallelism works
without apex/TE; without TE the TE spec can still be built, for inspection only.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from typing import Any, Optional

import torch
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hsap.config import ContextParallelConfig
from megatron_hsap.megatron import versions
from megatron_hsap.megatron.attention import HSAPCoreAttention, HSAPSelfAttention
from megatron_hsap.megatron.cpu_shim import SequenceParallelTorchNorm, transformer_engine_spec_without_te
from megatron_hsap.megatron.sequence_chunks import TiledMLP, sequence_chunk_bounds

__all__ = ["get_gpt_layer_hsap_spec", "get_gpt_decoder_block_hsap_spec", "transformer_engine_usable",
           "use_transformer_engine", "TRANSFORMER_IMPLS"]

#: Megatron-LM's ``--transformer-impl`` choices.
TRANSFORMER_IMPLS = ("local", "transformer_engine")


def transformer_engine_usable() -> bool:
    """TE modules are used only with a CUDA device and the package installed."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def use_transformer_engine(transformer_impl: str) -> bool:
    """Whether ``--transformer-impl`` selects the TE spec; a clear error where TE cannot run."""
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl={transformer_impl!r} is not supported; allowed: "
                         f"{', '.join(TRANSFORMER_IMPLS)}")
    if transformer_impl == "transformer_engine" and not transformer_engine_usable():
        raise ValueError("--transformer-impl transformer_engine needs the transformer_engine package and a CUDA "
                         f"device (installed: {importlib.util.find_spec('transformer_engine') is not None}, "
                         f"CUDA: {torch.cuda.is_available()}); use --transformer-impl local")
    return transformer_impl == "transformer_engine"


def get_gpt_layer_hsap_spec(cp_config: ContextParallelConfig, num_experts: Optional[int] = None,
                            qk_layernorm: bool = False, normalization: str = "LayerNorm",
                            use_transformer_engine: Optional[bool] = None, mlp_sequence_chunks: int = 1) -> ModuleSpec:
    """A GPT transformer-layer spec whose self-attention is HSAP's, everything else Megatron's.

    use_transformer_engine: None = TE when ``transformer_engine_usable()``; True/False forces it (True without
    TE builds the spec for inspection only: a model built from it raises).
    mlp_sequence_chunks > 1: the (dense) MLP is ``TiledMLP``, computed in that many sequence tiles with recompute.
    """
    if not isinstance(cp_config, ContextParallelConfig):
        raise ValueError(f"cp_config must be a ContextParallelConfig, got {type(cp_config).__name__}")
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"normalization={normalization!r} is not supported; allowed: 'LayerNorm', 'RMSNorm'")
    use_te = transformer_engine_usable() if use_transformer_engine is None else use_transformer_engine
    if use_te:
        with transformer_engine_spec_without_te():
            spec = get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, qk_layernorm=qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=qk_layernorm,
                                        normalization=normalization)
    spec = _copy_spec(spec)
    _use_hsap_attention(spec, cp_config)
    if not use_te:
        _use_sequence_parallel_norms(spec)
    if mlp_sequence_chunks != 1:
        _use_tiled_mlp(spec, mlp_sequence_chunks)
    return spec


def _copy_spec(node: Any) -> Any:
    """A copy of a spec's ModuleSpec / submodules-dataclass tree that shares the module classes (a deepcopy
    fails on the TE placeholders of a spec built without TE); what ``get_gpt_layer_hsap_spec`` edits is copied."""
    if isinstance(node, ModuleSpec):
        return dataclasses.replace(node, params=dict(node.params), submodules=_copy_spec(node.submodules))
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.replace(node, **{f.name: _copy_spec(getattr(node, f.name))
                                            for f in dataclasses.fields(node) if f.init})
    return node


def _use_hsap_attention(spec: ModuleSpec, cp_config: ContextParallelConfig) -> None:
    """Swap Megatron's ``SelfAttention`` for ``HSAPSelfAttention`` (same params, plus ``cp_config``) and its
    ``core_attention`` (Megatron's swap point for the attention itself) for ``HSAPCoreAttention``; the
    projections and norms stay Megatron's."""
    from megatron.core.transformer.attention import SelfAttention

    attention = spec.submodules.self_attention
    if not (isinstance(attention, ModuleSpec) and attention.module is SelfAttention):
        raise _nothing_to_rewrite("self_attention", "ModuleSpec(module=SelfAttention, ...)", attention)
    spec.submodules.self_attention = ModuleSpec(module=HSAPSelfAttention,
                                                params={**attention.params, "cp_config": cp_config},
                                                submodules=dataclasses.replace(attention.submodules,
                                                                               core_attention=HSAPCoreAttention))


def _use_tiled_mlp(spec: ModuleSpec, chunks: int) -> None:
    """Swap Megatron's dense ``MLP`` for ``TiledMLP`` (same submodules and parameters), in the spec form of the
    installed release (``versions.MLP_SPEC_IS_BUILDER``); a spec without a dense MLP (MoE) raises."""
    from megatron.core.transformer.mlp import MLP

    sequence_chunk_bounds(1, chunks)  # validates
    mlp = spec.submodules.mlp
    if versions.MLP_SPEC_IS_BUILDER:
        if (isinstance(mlp, functools.partial) and getattr(mlp.func, "__self__", None) is MLP
                and getattr(mlp.func, "__name__", None) == "as_mlp_submodule"):
            spec.submodules.mlp = functools.partial(TiledMLP.as_mlp_submodule, *mlp.args,
                                                    **{**mlp.keywords, "sequence_chunks": chunks})
            return
        expected = "functools.partial(MLP.as_mlp_submodule, ...)"
    else:
        if isinstance(mlp, ModuleSpec) and mlp.module is MLP:
            spec.submodules.mlp = ModuleSpec(module=TiledMLP, params={**mlp.params, "sequence_chunks": chunks},
                                             submodules=mlp.submodules)
            return
        expected = "ModuleSpec(module=MLP, ...)"
    raise _nothing_to_rewrite("mlp", expected, mlp, f"mlp_sequence_chunks={chunks} tiles only a dense MLP "
                                                    "(not MoE layers)")


def _nothing_to_rewrite(field: str, expected: str, found: Any, why: str = "") -> ValueError:
    """The error of a spec rewrite that found nothing to rewrite (never a silently unchanged spec)."""
    return ValueError(f"the layer spec's {field} is {found!r}, not {expected} as megatron-core "
                      f"{versions.MEGATRON_CORE_VERSION} builds it; {why + '; ' if why else ''}"
                      "the HSAP spec cannot be applied to it")


def _use_sequence_parallel_norms(spec: ModuleSpec) -> None:
    """Swap the local spec's torch norms for ones that accept ``sequence_parallel`` (same parameters); the two
    layer norms must be there (q/k norms only with ``qk_layernorm``)."""
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        norm = getattr(spec.submodules, name, None)
        if norm is None or _is_identity(norm):
            raise _nothing_to_rewrite(name, "a norm", norm)
    for owner, names in ((spec.submodules, ("input_layernorm", "pre_mlp_layernorm")),
                         (spec.submodules.self_attention.submodules, ("q_layernorm", "k_layernorm"))):
        for name in names:
            if getattr(owner, name, None) is not None and not _is_identity(getattr(owner, name)):
                setattr(owner, name, SequenceParallelTorchNorm)


def _is_identity(module: Any) -> bool:
    from megatron.core.transformer.identity_op import IdentityOp

    return module is IdentityOp or (isinstance(module, ModuleSpec) and module.module is IdentityOp)


def get_gpt_decoder_block_hsap_spec(config: TransformerConfig, cp_config: ContextParallelConfig, vp_stage: Optional[int] = None,
                                    **layer_kwargs: Any) -> TransformerBlockSubmodules:
    """The decoder block for this pipeline stage: ``get_gpt_layer_hsap_spec`` layers plus the final norm.

    Needed on CPU because Megatron's default final norm (``WrappedTorchNorm``) rejects sequence
    parallelism. ``config`` is the model's TransformerConfig; layer_kwargs go to the layer spec.
    """
    layer_kwargs.setdefault("normalization", config.normalization)
    layer = get_gpt_layer_hsap_spec(cp_config, **layer_kwargs)
    use_te = layer_kwargs.get("use_transformer_engine")
    use_te = transformer_engine_usable() if use_te is None else use_te
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm: Any = TENorm
    else:
        final_norm = SequenceParallelTorchNorm
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage),
                                      layer_norm=final_norm)
