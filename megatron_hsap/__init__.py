"""megatron-hsap: hierarchical, head-chunked, sequence-aware context parallelism for Megatron-Core."""

__version__ = "0.1.0"
