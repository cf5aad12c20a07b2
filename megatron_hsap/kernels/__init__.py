"""Local attention kernels behind one interface (see ``base.py``).

``get_kernel("auto")`` on CUDA tries TransformerEngine, then flash-attn, then PyTorch's own
fused varlen flash attention (``torch_flash``, in every CUDA build of PyTorch), then the
pure-PyTorch reference kernel (``torch``), and chooses *per call shape*: for each dtype, device
type, head counts and head dim it takes the first of the kernels that could be built there
whose input checks accept the call (fp32, or a head dim above 256 / TE's 128 or not a multiple
of 8, go further down the list), decided once per shape and announced once on rank 0 when it
is not the first kernel. Without CUDA it picks the fused CPU kernel (``cpu_fused``), and the
reference kernel (``torch``) where the torch build lacks the fused CPU operator. It logs its
choice once; a library that is installed but refuses this device or release (e.g. TE on a
pre-Hopper GPU) is named with its reason in one warning on rank 0. An explicitly requested
kernel that cannot run here is an error that names what it needs.
"""

from __future__ import annotations

import importlib
import logging
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

import torch

from megatron_hsap.config import KERNELS
from megatron_hsap.kernels.base import AttentionBlocks, AttentionKernel, check_kernel_inputs
from megatron_hsap.kernels.gpu_common import warn_once_on_rank0

__all__ = ["AttentionBlocks", "AttentionKernel", "AutoKernel", "check_kernel_inputs", "get_kernel"]

_log = logging.getLogger(__name__)

# name -> (module, class, what the kernel needs and how to get it)
_REGISTRY = {
    "torch": ("megatron_hsap.kernels.torch_kernel", "TorchAttentionKernel", "nothing beyond torch"),
    "cpu_fused": ("megatron_hsap.kernels.cpu_fused_kernel", "CpuFusedAttentionKernel",
                  "a torch build with the operator aten._scaled_dot_product_flash_attention_for_cpu"),
    "torch_flash": ("megatron_hsap.kernels.torch_flash_kernel", "TorchFlashAttentionKernel",
                    "a CUDA device (compute capability 8.0+) and a CUDA build of PyTorch with flash attention "
                    "(torch.backends.cuda.is_flash_attention_available())"),
    "flash": ("megatron_hsap.kernels.flash_kernel", "FlashAttentionKernel",
              "the package 'flash-attn' and a CUDA device; install it (pip install flash-attn)"),
    "te": ("megatron_hsap.kernels.te_kernel", "TEAttentionKernel",
           "the package 'transformer-engine[pytorch]' and a CUDA device; "
           "install it (pip install transformer-engine[pytorch])"),
}
_CUDA_ORDER = ("te", "flash", "torch_flash", "torch")
_CPU_ORDER = ("cpu_fused", "torch")


def _kernel_class(name: str) -> type:
    module_name, class_name, _ = _REGISTRY[name]
    return getattr(importlib.import_module(module_name), class_name)


def _load(name: str) -> AttentionKernel:
    cls, needs = _kernel_class(name), _REGISTRY[name][2]
    if not cls.is_available():
        raise RuntimeError(f"attention kernel {name!r} needs {needs}, or use kernel='torch'")
    return cls()


class AutoKernel:
    """``kernel="auto"`` where several kernels could be built: each call goes to the first of ``kernels``
    (in order of preference, the last one accepting every valid input) whose input checks accept its dtype,
    device, head counts and head dim; decided once per such shape, forward and backward alike."""

    name = "auto"

    def __init__(self, kernels: List[AttentionKernel]) -> None:
        self.kernels = kernels
        self._chosen: Dict[Tuple, AttentionKernel] = {}

    def kernel_for(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   blocks: AttentionBlocks) -> AttentionKernel:
        """The kernel for this call's shape (q ``[t_q, h_q, d]``, k/v ``[t_k, h_kv, d]``): the first whose input
        checks accept it, else the last (the reference kernel, which raises on input no kernel takes)."""
        key = (q.dtype, q.device.type, q.shape[1], k.shape[1], q.shape[2])
        chosen = self._chosen.get(key)
        if chosen is not None:
            return chosen
        refusals = []
        for kernel in self.kernels[:-1]:
            try:
                type(kernel).check_inputs(q, k, v, blocks)
            except ValueError as err:
                refusals.append(f"{kernel.name!r}: {err}")
                continue
            break
        else:  # the reference kernel: its own checks report bad input
            kernel = self.kernels[-1]
        if refusals:
            warn_once_on_rank0(_log, f"megatron_hsap: attention kernel 'auto' uses {kernel.name!r} for dtype "
                                     f"{q.dtype}, {q.shape[1]}/{k.shape[1]} heads, head_dim {q.shape[2]}, not "
                                     + "; ".join(refusals))
        self._chosen[key] = kernel
        return kernel

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: AttentionBlocks,
                softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
        """As ``AttentionKernel.forward``, by the kernel chosen for this shape."""
        return self.kernel_for(q, k, v, blocks).forward(q, k, v, blocks, softmax_scale)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, blocks: AttentionBlocks,
                 softmax_scale: float, grad_dtype: Optional[torch.dtype] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As ``AttentionKernel.backward``, by the kernel the forward of this shape used."""
        return self.kernel_for(q, k, v, blocks).backward(dout, q, k, v, out, lse, blocks, softmax_scale, grad_dtype)


@lru_cache(maxsize=None)
def get_kernel(name: str = "auto") -> AttentionKernel:
    """Return the kernel instance for ``name`` in ``config.KERNELS`` ('auto', 'torch', 'cpu_fused', 'torch_flash',
    'flash', 'te')."""
    if name not in KERNELS:
        raise ValueError(f"kernel={name!r} is not supported; allowed values: {', '.join(map(repr, KERNELS))}")
    if name != "auto":
        return _load(name)
    refused = []  # installed with CUDA, yet unusable here (version, device, cuDNN): worth one clear message
    loaded = []
    for candidate in _CUDA_ORDER if torch.cuda.is_available() else _CPU_ORDER:
        try:
            kernel = _load(candidate)
        except (ImportError, RuntimeError) as err:
            if _kernel_class(candidate).is_available():
                refused.append(f"{candidate!r}: {err}")
            continue
        loaded.append(kernel)
        if not torch.cuda.is_available():
            break  # on CPU the first kernel that loads takes every call
    names = " then ".join(repr(k.name) for k in loaded)
    if refused:
        warn_once_on_rank0(_log, f"megatron_hsap: attention kernel 'auto' selected {names}, not " + "; ".join(refused))
    else:
        _log.info("megatron_hsap: attention kernel 'auto' selected %s", names)
    return loaded[0] if len(loaded) == 1 else AutoKernel(loaded)
