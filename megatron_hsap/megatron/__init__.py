"""Megatron-Core integration: HSAP attention as a layer spec or a conversion, and the CPU shim."""

from megatron_hsap.megatron.attention import HSAPPackedSeqParams, HSAPSelfAttention
from megatron_hsap.megatron.convert import convert_model_to_hsap
from megatron_hsap.megatron.cpu_shim import apply_cpu_shim
from megatron_hsap.megatron.spec import get_gpt_decoder_block_hsap_spec, get_gpt_layer_hsap_spec

__all__ = ["HSAPPackedSeqParams", "HSAPSelfAttention", "apply_cpu_shim", "convert_model_to_hsap",
           "get_gpt_decoder_block_hsap_spec", "get_gpt_layer_hsap_spec"]
