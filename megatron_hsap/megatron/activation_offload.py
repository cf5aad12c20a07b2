"""Layer checkpoints in host memory (activation offload, as DeepSpeed ALST's checkpoint offload).

With full recompute (``--recompute-granularity full``) the forward keeps only each layer's input for the
backward, but at long context those inputs still dominate: layers x t x hidden x 2 bytes (Llama3-8B:
32 x 8 KiB per token and rank, 20 GiB at 80K tokens per rank, 160 GiB at 640K). ``HostOffload`` is a
saved-tensor hook context: every activation the forward saves for backward on the compute device is copied
to host memory (pinned on CUDA) when it is saved, and copied back when the backward needs it. The backward's
recompute runs outside the context, so its activations stay on the device; the copy is synchronous, so one
layer's input is on the device at a time (the memory model's ``recompute='offload'``).

Megatron-Core's own ``cpu_offloading`` refuses activation recompute, and torch's ``save_on_cpu`` copies
parameters too (a full weight copy per micro-batch for every saved weight): this context skips parameters
and counts what it moved.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Tuple, Union

import torch

__all__ = ["HostOffload", "saved_activations_on_host"]


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved activations on ``device`` go to host memory while the context is active.

    ``offloaded_bytes``: bytes this context copied to the host; ``total_offloaded_bytes``: by every context
    of the process (the training loop logs its growth per iteration)."""

    total_offloaded_bytes = 0

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.offloaded_bytes = 0
        pin = self.device.type == "cuda"

        def pack(tensor: torch.Tensor) -> Union[torch.Tensor, Tuple[torch.device, torch.Tensor]]:
            if isinstance(tensor, torch.nn.Parameter) or tensor.device != self.device:
                return tensor
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
            host.copy_(tensor)
            nbytes = tensor.numel() * tensor.element_size()
            self.offloaded_bytes += nbytes
            HostOffload.total_offloaded_bytes += nbytes
            return tensor.device, host

        def unpack(packed: Union[torch.Tensor, Tuple[torch.device, torch.Tensor]]) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=pin)

        super().__init__(pack, unpack)

    def __enter__(self) -> "HostOffload":
        super().__enter__()
        return self


def saved_activations_on_host(enabled: bool, device: torch.device) -> ContextManager[object]:
    """``HostOffload(device)`` when ``enabled``, else a context that does nothing."""
    return HostOffload(device) if enabled else contextlib.nullcontext()
