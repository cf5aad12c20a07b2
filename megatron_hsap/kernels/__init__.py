"""Local attention kernels behind one interface (see ``base.py``).

``get_kernel("auto")`` picks TransformerEngine, then flash-attn (both need CUDA);
without CUDA it picks the fused CPU kernel (``cpu_fused``), and the pure-PyTorch
reference kernel (``torch``) where neither applies (CUDA without the libraries, or
a torch build without the fused CPU operator). It logs its choice once; a library
that is installed but refuses this device or release (e.g. TE on a pre-Hopper GPU)
is named with its reason in one warning on rank 0. An explicitly requested kernel
whose package is missing is an error that names the package to install.
"""

from __future__ import annotations

import importlib
import logging
from functools import lru_cache

import torch

from megatron_hsap.config import KERNELS
from megatron_hsap.kernels.base import AttentionBlocks, AttentionKernel, check_kernel_inputs
from megatron_hsap.kernels.gpu_common import warn_once_on_rank0

__all__ = ["AttentionBlocks", "AttentionKernel", "check_kernel_inputs", "get_kernel"]

_log = logging.getLogger(__name__)

# name -> (module, class, what the kernel needs and how to get it)
_REGISTRY = {
    "torch": ("megatron_hsap.kernels.torch_kernel", "TorchAttentionKernel", "nothing beyond torch"),
    "cpu_fused": ("megatron_hsap.kernels.cpu_fused_kernel", "CpuFusedAttentionKernel",
                  "a torch build with the operator aten._scaled_dot_product_flash_attention_for_cpu"),
    "flash": ("megatron_hsap.kernels.flash_kernel", "FlashAttentionKernel",
              "the package 'flash-attn' and a CUDA device; install it (pip install flash-attn)"),
    "te": ("megatron_hsap.kernels.te_kernel", "TEAttentionKernel",
           "the package 'transformer-engine[pytorch]' and a CUDA device; "
           "install it (pip install transformer-engine[pytorch])"),
}


def _kernel_class(name: str) -> type:
    module_name, class_name, _ = _REGISTRY[name]
    return getattr(importlib.import_module(module_name), class_name)


def _load(name: str) -> AttentionKernel:
    cls, needs = _kernel_class(name), _REGISTRY[name][2]
    if not cls.is_available():
        raise RuntimeError(f"attention kernel {name!r} needs {needs}, or use kernel='torch'")
    return cls()


@lru_cache(maxsize=None)
def get_kernel(name: str = "auto") -> AttentionKernel:
    """Return the kernel instance for ``name`` in ``config.KERNELS`` ('auto', 'torch', 'cpu_fused', 'flash', 'te')."""
    if name not in KERNELS:
        raise ValueError(f"kernel={name!r} is not supported; allowed values: {', '.join(map(repr, KERNELS))}")
    if name != "auto":
        return _load(name)
    refused = []  # installed with CUDA, yet unusable here (version, device, cuDNN): worth one clear message
    candidates = ("te", "flash", "torch") if torch.cuda.is_available() else ("cpu_fused", "torch")
    for candidate in candidates:
        try:
            kernel = _load(candidate)
        except (ImportError, RuntimeError) as err:
            if _kernel_class(candidate).is_available():
                refused.append(f"{candidate!r}: {err}")
            continue
        if refused:
            warn_once_on_rank0(_log, f"megatron_hsap: attention kernel 'auto' selected {candidate!r}, not "
                                     + "; ".join(refused))
        else:
            _log.info("megatron_hsap: attention kernel 'auto' selected %r", candidate)
        return kernel
    raise AssertionError("the torch kernel is always available")
