"""Local attention kernels behind one interface (see ``base.py``).

``get_kernel("auto")`` picks TransformerEngine, then flash-attn, then the pure
PyTorch kernel, and logs its choice once. An explicitly requested kernel whose
package is missing is an error that names the package to install.
"""

from __future__ import annotations

import importlib
import logging
from functools import lru_cache

from megatron_hsap.config import KERNELS
from megatron_hsap.kernels.base import AttentionBlocks, AttentionKernel, check_kernel_inputs

__all__ = ["AttentionBlocks", "AttentionKernel", "check_kernel_inputs", "get_kernel"]

_log = logging.getLogger(__name__)

# name -> (module, class, pip package that provides the kernel's backend)
_REGISTRY = {
    "torch": ("megatron_hsap.kernels.torch_kernel", "TorchAttentionKernel", None),
    "flash": ("megatron_hsap.kernels.flash_kernel", "FlashAttentionKernel", "flash-attn"),
    "te": ("megatron_hsap.kernels.te_kernel", "TEAttentionKernel", "transformer-engine[pytorch]"),
}


def _load(name: str) -> AttentionKernel:
    module_name, class_name, package = _REGISTRY[name]
    cls = getattr(importlib.import_module(module_name), class_name)
    if not cls.is_available():
        raise RuntimeError(f"attention kernel {name!r} needs the package {package!r} and a CUDA device; "
                           f"install it (pip install {package}) or use kernel='torch'")
    return cls()


@lru_cache(maxsize=None)
def get_kernel(name: str = "auto") -> AttentionKernel:
    """Return the kernel instance for ``name`` in ('auto', 'torch', 'flash', 'te')."""
    if name not in KERNELS:
        raise ValueError(f"kernel={name!r} is not supported; allowed values: {', '.join(map(repr, KERNELS))}")
    if name != "auto":
        return _load(name)
    for candidate in ("te", "flash", "torch"):
        try:
            kernel = _load(candidate)
        except (ImportError, RuntimeError):
            continue
        _log.info("megatron_hsap: attention kernel 'auto' selected %r", candidate)
        return kernel
    raise AssertionError("the torch kernel is always available")
