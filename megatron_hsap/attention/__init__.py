"""Distributed attention: Ulysses all-to-all, ring exchanges, and their hybrid."""

from megatron_hsap.attention.context_parallel import context_parallel_attention

__all__ = ["context_parallel_attention"]
