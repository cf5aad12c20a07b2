"""Context-parallel configuration: one frozen object that every layer and plan reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_hsap.head_split import check_head_chunk_size

MODES = ("ring", "ulysses", "hybrid", "hsap")
LAYOUTS = ("zigzag", "contiguous", "sequence-aware")
KERNELS = ("auto", "torch", "cpu_fused", "torch_flash", "flash", "te")


def _check_choice(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed values: {', '.join(map(repr, allowed))}")


def _check_positive_or_none(name: str, value: Optional[int]) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name}={value!r} must be a positive int or None")


@dataclass(frozen=True)
class ContextParallelConfig:
    """How attention is spread over the context-parallel (CP) group.

    mode: ``ring`` (K/V exchanged between ranks), ``ulysses`` (all-to-all
    sequence<->heads), ``hybrid`` (Ulysses inside a node, ring across nodes) or
    ``hsap`` (hybrid + head chunks + sequence-aware layout by default).
    ulysses_size: all-to-all degree; None picks the mode's default
    (ring: 1, ulysses: CP size, hybrid/hsap: largest divisor of CP that fits a node).
    head_chunk_size: U query heads per UPipe stage; None = all heads in one stage
    (``hsap`` defaults to the Ulysses size).
    layout: how a packed batch's tokens are placed on CP ranks; None = the mode's
    default (``sequence-aware`` for ``hsap``, ``zigzag`` otherwise).
    kernel: local attention kernel (``auto`` = TE, then flash-attn where CUDA is usable, else the
    fused CPU kernel ``cpu_fused``; ``torch`` = the pure-PyTorch reference kernel, any device).
    kv_forwarding: node-level K/V forwarding for rings with several members on one node (pure ring,
    or Ulysses groups smaller than a node): a remote key/value row that several members of a node need
    crosses the node boundary once and is relayed inside the node (``PlanStats.recv_bytes_inter_forwarded``).
    Costs intra-node traffic, and the relayed rows (and their gradients) are kept until the relays ran.
    """

    mode: str = "hybrid"
    ulysses_size: Optional[int] = None
    head_chunk_size: Optional[int] = None
    layout: Optional[str] = None
    kernel: str = "auto"
    kv_forwarding: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.kv_forwarding, bool):
            raise ValueError(f"kv_forwarding={self.kv_forwarding!r} is not supported; allowed values: False, True")
        _check_choice("mode", self.mode, MODES)
        _check_positive_or_none("ulysses_size", self.ulysses_size)
        _check_positive_or_none("head_chunk_size", self.head_chunk_size)
        if self.layout is not None:
            _check_choice("layout", self.layout, LAYOUTS)
        _check_choice("kernel", self.kernel, KERNELS)
        if self.mode == "ring" and self.ulysses_size not in (None, 1):
            raise ValueError(f"ulysses_size={self.ulysses_size} is not allowed with mode='ring' (ring has no all-to-all); "
                             "use mode='hybrid' or leave ulysses_size unset")
        if self.mode == "ring" and self.head_chunk_size is not None:
            raise ValueError("head_chunk_size is only used by modes 'ulysses', 'hybrid' and 'hsap', not 'ring'")

    @property
    def resolved_layout(self) -> str:
        if self.layout is not None:
            return self.layout
        return "sequence-aware" if self.mode == "hsap" else "zigzag"

    def resolve_ulysses_size(self, context_parallel_size: int, ranks_per_node: Optional[int]) -> int:
        """The Ulysses degree this config implies for a CP group of the given size.

        ranks_per_node counts CP ranks of one CP group that share a node (None = all).
        """
        cp = context_parallel_size
        if self.mode == "ring":
            return 1
        if self.mode == "ulysses":
            size = cp if self.ulysses_size is None else self.ulysses_size
            if size != cp:
                raise ValueError(f"mode='ulysses' needs ulysses_size == context_parallel_size ({cp}), got {size}; "
                                 "use mode='hybrid' for a smaller all-to-all group")
            return size
        if self.ulysses_size is not None:
            size = self.ulysses_size
        else:
            fit = cp if ranks_per_node is None else max(1, ranks_per_node)
            size = max(d for d in range(1, min(cp, fit) + 1) if cp % d == 0 and fit % d == 0)
        if cp % size != 0:
            raise ValueError(f"context_parallel_size={cp} is not divisible by ulysses_size={size}; "
                             f"allowed ulysses_size values: {[d for d in range(1, cp + 1) if cp % d == 0]}")
        return size

    def resolve_head_chunk_size(self, num_heads: int, ulysses_size: int) -> int:
        """Query heads per UPipe stage (as seen by this TP rank); validated here, before any collective."""
        if self.head_chunk_size is None:
            return min(ulysses_size, num_heads) if self.mode == "hsap" else num_heads
        return check_head_chunk_size(self.head_chunk_size, num_heads, ulysses_size)
