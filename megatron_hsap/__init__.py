"""megatron-hsap: hierarchical, head-chunked, sequence-aware context parallelism for Megatron-Core.

The functional entry points are importable from the package (loaded on first use, so importing the
package stays cheap): ``context_parallel_varlen_attention`` and ``plan_for`` (``megatron_hsap.functional``).
"""

__version__ = "0.1.0"

__all__ = ["context_parallel_varlen_attention", "plan_for"]


def __getattr__(name: str) -> object:
    if name in __all__:
        from megatron_hsap import functional

        return getattr(functional, name)
    raise AttributeError(f"module 'megatron_hsap' has no attribute {name!r}")
