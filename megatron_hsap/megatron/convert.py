"""Swap HSAP attention into an already built Megatron ``GPTModel`` (e.g. one a NeMo / Megatron-Bridge recipe built).

The class of each ``SelfAttention`` changes and its ``core_attention`` (which holds no parameters) becomes an
``HSAPCoreAttention``; its parameters, buffers and other submodules stay the same objects, so state-dict
keys and values (and therefore checkpoints saved before the conversion) are unchanged, except
TransformerEngine's ``core_attention._extra_state`` (fp8 metadata of the attention no longer run), which
``HSAPCoreAttention`` accepts and drops when loading.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.attention import SelfAttention

from megatron_hsap.config import ContextParallelConfig
from megatron_hsap.megatron.attention import HSAPCoreAttention, HSAPSelfAttention, check_hsap_attention_config

__all__ = ["convert_model_to_hsap"]


def convert_model_to_hsap(model: torch.nn.Module, cp_config: ContextParallelConfig) -> int:
    """Make every ``SelfAttention`` in ``model`` (a GPTModel, possibly DDP/Float16-wrapped) an ``HSAPSelfAttention``.

    Returns the number of attention modules converted; raises ValueError when there is none
    or when the model's config uses a feature the HSAP core does not implement. After the
    conversion the model's forward needs ``packed_seq_params=HSAPPackedSeqParams(plan=...)``.
    """
    if not isinstance(cp_config, ContextParallelConfig):
        raise ValueError(f"cp_config must be a ContextParallelConfig, got {type(cp_config).__name__}")
    attentions = [m for m in model.modules() if isinstance(m, SelfAttention)]
    if not attentions:
        raise ValueError("model has no megatron.core SelfAttention module to convert")
    for module in attentions:
        check_hsap_attention_config(module.config, module.attn_mask_type)
    for module in attentions:
        if type(module) not in (SelfAttention, HSAPSelfAttention):
            raise ValueError(f"cannot convert {type(module).__name__}: only plain SelfAttention is supported")
        if not isinstance(module.core_attention, HSAPCoreAttention):
            module.core_attention = HSAPCoreAttention(module.config, module.layer_number, module.attn_mask_type,
                                                      softmax_scale=module.config.softmax_scale,
                                                      pg_collection=module.pg_collection)
        module.__class__ = HSAPSelfAttention
        module.cp_config = cp_config
    return len(attentions)
