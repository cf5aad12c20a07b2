"""Context-parallel topology on top of Megatron-Core's parallel state.

Megatron-Core builds the tensor/pipeline/context/data-parallel groups (and, given
``hierarchical_context_parallel_sizes``, the two-level CP sub-groups). This module
calls it, then records what the attention needs: inside each CP group, the
Ulysses sub-group (adjacent CP ranks, meant to share a node's fast links) and
the ring sub-group (the same Ulysses position in every Ulysses group), and which
node every CP rank is on, so traffic can be split intra-/inter-node.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_hsap.config import ContextParallelConfig

__all__ = ["CPTopology", "initialize_model_parallel", "attach_cp_topology", "cp_layout", "hierarchical_cp_sizes",
           "destroy_model_parallel", "get_cp_topology", "get_cp_config", "cp_topology_is_initialized"]


@dataclass(frozen=True)
class CPTopology:
    """One CP group's layout and this rank's place in it.

    CP rank ``c`` has ``ulysses_rank = c % ulysses_size`` and ``ring_rank = c // ulysses_size``;
    a "ring member" is one Ulysses group. ``node_of_cp_rank[c]`` is the node index of
    CP rank c. Offline topologies (no process groups, ``cp_rank is None``) describe
    any cluster shape so plans and their statistics can be computed on one machine.
    """

    cp_size: int
    ulysses_size: int
    node_of_cp_rank: Tuple[int, ...]
    cp_rank: Optional[int] = None
    cp_global_ranks: Tuple[int, ...] = ()
    cp_group: Optional[dist.ProcessGroup] = None
    ulysses_group: Optional[dist.ProcessGroup] = None
    ring_group: Optional[dist.ProcessGroup] = None
    config: ContextParallelConfig = ContextParallelConfig()

    def __post_init__(self) -> None:
        if self.cp_size < 1:
            raise ValueError(f"context_parallel_size={self.cp_size} must be >= 1")
        if self.ulysses_size < 1 or self.cp_size % self.ulysses_size != 0:
            allowed = [d for d in range(1, self.cp_size + 1) if self.cp_size % d == 0]
            raise ValueError(f"context_parallel_size={self.cp_size} is not divisible by ulysses_size={self.ulysses_size}; "
                             f"allowed ulysses_size values: {allowed}")
        if len(self.node_of_cp_rank) != self.cp_size:
            raise ValueError("node_of_cp_rank must have one entry per CP rank")

    @classmethod
    def offline(cls, context_parallel_size: int, ulysses_size: int, ranks_per_node: int) -> "CPTopology":
        """A layout without process groups: CP rank c sits on node ``c // ranks_per_node``."""
        for name, value in (("context_parallel_size", context_parallel_size), ("ulysses_size", ulysses_size),
                            ("ranks_per_node", ranks_per_node)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        nodes = tuple(c // ranks_per_node for c in range(context_parallel_size))
        return cls(cp_size=context_parallel_size, ulysses_size=ulysses_size, node_of_cp_rank=nodes)

    @property
    def ring_size(self) -> int:
        return self.cp_size // self.ulysses_size

    @property
    def is_offline(self) -> bool:
        return self.cp_rank is None

    @property
    def ulysses_rank(self) -> Optional[int]:
        return None if self.cp_rank is None else self.cp_rank % self.ulysses_size

    @property
    def ring_rank(self) -> Optional[int]:
        return None if self.cp_rank is None else self.cp_rank // self.ulysses_size

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_of_cp_rank))

    def ring_member_ranks(self, ring_index: int) -> range:
        """CP ranks of one Ulysses group (ring member)."""
        return range(ring_index * self.ulysses_size, (ring_index + 1) * self.ulysses_size)

    def same_node(self, cp_rank_a: int, cp_rank_b: int) -> bool:
        return self.node_of_cp_rank[cp_rank_a] == self.node_of_cp_rank[cp_rank_b]

    def ulysses_spans_nodes(self) -> bool:
        return any(len({self.node_of_cp_rank[c] for c in self.ring_member_ranks(m)}) > 1
                   for m in range(self.ring_size))

    @property
    def node_of_ring_member(self) -> Tuple[int, ...]:
        """Node of each ring member (of its first CP rank)."""
        return tuple(self.node_of_cp_rank[m * self.ulysses_size] for m in range(self.ring_size))

    def ring_members_share_nodes(self) -> bool:
        """Whether some node holds several ring members (where node-level K/V forwarding can save traffic)."""
        nodes = self.node_of_ring_member
        return len(set(nodes)) < len(nodes)

    def signature(self) -> Tuple[int, int, Tuple[int, ...]]:
        """What plans depend on (not the process groups): used as a cache key."""
        return (self.cp_size, self.ulysses_size, self.node_of_cp_rank)


_TOPOLOGY: Optional[CPTopology] = None
_CP_CONFIG: Optional[ContextParallelConfig] = None
_WARNED_SPAN = False


def _largest_in_node_divisor(node_of_cp_rank: Tuple[int, ...]) -> int:
    """Largest d dividing the CP size such that every block of d adjacent CP ranks shares a node."""
    cp = len(node_of_cp_rank)
    return max(d for d in range(1, cp + 1) if cp % d == 0 and
               all(len(set(node_of_cp_rank[i:i + d])) == 1 for i in range(0, cp, d)))


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              context_parallel_size: int = 1,
                              cp_config: ContextParallelConfig = ContextParallelConfig(),
                              ranks_per_node: Optional[int] = None, **megatron_kwargs: Any) -> CPTopology:
    """Build Megatron-Core's groups, then the Ulysses and ring sub-groups of every CP group.

    ranks_per_node: global ranks per node (default: torchrun's LOCAL_WORLD_SIZE, else the
    world size); tests set it to emulate several nodes on one machine. Every argument is
    validated on every rank before the first group is created.
    """
    from megatron.core import parallel_state as mpu

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized (init_process_group) before initialize_model_parallel")
    if not isinstance(cp_config, ContextParallelConfig):
        raise ValueError(f"cp_config must be a ContextParallelConfig, got {type(cp_config).__name__}")
    world = dist.get_world_size()
    rank = dist.get_rank()
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    for name, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                        ("context_parallel_size", cp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if world % (tp * pp * cp) != 0:
        raise ValueError(f"world size {world} is not divisible by tensor_model_parallel_size ({tp}) x "
                         f"pipeline_model_parallel_size ({pp}) x context_parallel_size ({cp})")
    ranks_per_node = _resolve_ranks_per_node(ranks_per_node, world)
    if "hierarchical_context_parallel_sizes" in megatron_kwargs:
        raise ValueError("hierarchical_context_parallel_sizes is derived from cp_config (ulysses_size); do not pass it")
    if megatron_kwargs.get("order", "tp-cp-ep-dp-pp") != "tp-cp-ep-dp-pp":
        raise ValueError("only Megatron's default rank order 'tp-cp-ep-dp-pp' is supported")

    cp_global_ranks, node_of_cp_rank, ulysses = cp_layout(rank, tp, cp, ranks_per_node, cp_config)
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  context_parallel_size=cp,
                                  hierarchical_context_parallel_sizes=hierarchical_cp_sizes(cp, ulysses),
                                  **megatron_kwargs)
    return _topology_over_megatron_groups(cp_global_ranks, node_of_cp_rank, ulysses, cp_config, ranks_per_node)


def hierarchical_cp_sizes(context_parallel_size: int, ulysses_size: int) -> Optional[List[int]]:
    """Megatron's ``hierarchical_context_parallel_sizes`` for these sizes: [Ulysses, ring] (None without CP)."""
    if context_parallel_size == 1:
        return None
    return [ulysses_size, context_parallel_size // ulysses_size]


def cp_layout(rank: int, tp: int, cp: int, ranks_per_node: int, cp_config: ContextParallelConfig
               ) -> Tuple[Tuple[int, ...], Tuple[int, ...], int]:
    """(global ranks of this rank's CP group, node of each, Ulysses size), from rank arithmetic only.

    CP group members are TP ranks apart (Megatron's rank order tp-cp-...), so this needs no collective.
    """
    first_of_group = (rank // (tp * cp)) * (tp * cp) + rank % tp
    cp_global_ranks = tuple(first_of_group + i * tp for i in range(cp))
    node_of_cp_rank = tuple(g // ranks_per_node for g in cp_global_ranks)
    ulysses = cp_config.resolve_ulysses_size(cp, _largest_in_node_divisor(node_of_cp_rank))
    return cp_global_ranks, node_of_cp_rank, ulysses


def _topology_over_megatron_groups(cp_global_ranks: Tuple[int, ...], node_of_cp_rank: Tuple[int, ...], ulysses: int,
                                   cp_config: ContextParallelConfig, ranks_per_node: int) -> CPTopology:
    """The topology over the CP and hierarchical CP groups ``initialize_model_parallel`` just had Megatron build."""
    from megatron.core import parallel_state as mpu

    if len(cp_global_ranks) > 1:
        ulysses_group, ring_group = mpu.get_hierarchical_context_parallel_groups()
    else:
        ulysses_group = ring_group = mpu.get_context_parallel_group()
    assert tuple(mpu.get_context_parallel_global_ranks()) == cp_global_ranks, "unexpected Megatron CP rank order"
    return _record_topology(cp_global_ranks, node_of_cp_rank, ulysses, ulysses_group, ring_group, cp_config,
                            ranks_per_node)


def attach_cp_topology(cp_config: ContextParallelConfig = ContextParallelConfig(),
                       ranks_per_node: Optional[int] = None) -> CPTopology:
    """The HSAP topology on top of Megatron-Core groups that another framework built (Megatron-LM's
    ``initialize_megatron``, Megatron-Bridge), for any rank order. Call it on every rank.

    Megatron's hierarchical CP groups are reused when their sizes are ``[ulysses, ring]``; otherwise the
    Ulysses and ring sub-groups are created here (one world all-gather, then ``new_group`` calls that every
    rank makes in the same order).
    """
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():
        raise RuntimeError("Megatron-Core's model parallel groups are not initialized; call attach_cp_topology "
                           "after initialize_model_parallel (or use megatron_hsap's initialize_model_parallel)")
    if not isinstance(cp_config, ContextParallelConfig):
        raise ValueError(f"cp_config must be a ContextParallelConfig, got {type(cp_config).__name__}")
    world = dist.get_world_size()
    ranks_per_node = _resolve_ranks_per_node(ranks_per_node, world)
    cp_global_ranks = tuple(mpu.get_context_parallel_global_ranks())
    cp = len(cp_global_ranks)
    node_of_cp_rank = tuple(g // ranks_per_node for g in cp_global_ranks)
    ulysses = cp_config.resolve_ulysses_size(cp, _largest_in_node_divisor(node_of_cp_rank))
    ring = cp // ulysses
    if cp == 1:
        ulysses_group = ring_group = mpu.get_context_parallel_group()
    else:
        built = mpu.get_hierarchical_context_parallel_groups(check_initialized=False)
        if built is not None and [dist.get_world_size(g) for g in built] == [ulysses, ring]:
            ulysses_group, ring_group = built
        else:
            all_cp_groups: List[Tuple[int, ...]] = [()] * world
            dist.all_gather_object(all_cp_groups, cp_global_ranks)
            cp_groups = sorted(set(all_cp_groups))
            ulysses_group, _ = dist.new_subgroups_by_enumeration(
                [list(g[i * ulysses:(i + 1) * ulysses]) for g in cp_groups for i in range(ring)])
            ring_group, _ = dist.new_subgroups_by_enumeration(
                [list(g[u::ulysses]) for g in cp_groups for u in range(ulysses)])
    return _record_topology(cp_global_ranks, node_of_cp_rank, ulysses, ulysses_group, ring_group, cp_config,
                            ranks_per_node)


def _record_topology(cp_global_ranks: Tuple[int, ...], node_of_cp_rank: Tuple[int, ...], ulysses: int,
                     ulysses_group: Optional[dist.ProcessGroup], ring_group: Optional[dist.ProcessGroup], cp_config: ContextParallelConfig,
                     ranks_per_node: int) -> CPTopology:
    """Make this rank's CPTopology the current one (groups joined eagerly; one warning if Ulysses spans nodes)."""
    global _TOPOLOGY, _CP_CONFIG, _WARNED_SPAN
    from megatron.core import parallel_state as mpu

    if len(cp_global_ranks) > 1:
        _join_groups_eagerly((ulysses_group, ring_group))
    topo = CPTopology(cp_size=len(cp_global_ranks), ulysses_size=ulysses, node_of_cp_rank=node_of_cp_rank,
                      cp_rank=mpu.get_context_parallel_rank(), cp_global_ranks=cp_global_ranks,
                      cp_group=mpu.get_context_parallel_group(), ulysses_group=ulysses_group, ring_group=ring_group,
                      config=cp_config)
    if topo.ulysses_spans_nodes() and dist.get_rank() == 0 and not _WARNED_SPAN:
        _WARNED_SPAN = True
        warnings.warn(f"Ulysses groups of size {ulysses} span several nodes (ranks_per_node={ranks_per_node}, "
                      f"tensor_model_parallel_size={mpu.get_tensor_model_parallel_world_size()}); the all-to-all "
                      "will cross the slow links", stacklevel=3)
    _TOPOLOGY, _CP_CONFIG = topo, cp_config
    return topo


def _resolve_ranks_per_node(ranks_per_node: Optional[int], world: int) -> int:
    """The explicit value, else torchrun's LOCAL_WORLD_SIZE, else the world size; must be a positive int."""
    if ranks_per_node is None:
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node!r} must be a positive int")
    return ranks_per_node


def _join_groups_eagerly(groups: Tuple[Optional[dist.ProcessGroup], ...]) -> None:
    """Every member joins one collective on each group now, so its communicator exists before the first
    ``batch_isend_irecv``: NCCL requires all members of a group in the first batched P2P call on it, and a
    plan can leave a ring member with nothing to exchange in the first step."""
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
              else torch.device("cpu"))
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(torch.zeros(1, device=device), group=group)


def destroy_model_parallel() -> None:
    """Forget the CP topology and destroy Megatron-Core's groups."""
    global _TOPOLOGY, _CP_CONFIG
    from megatron.core import parallel_state as mpu

    _TOPOLOGY = _CP_CONFIG = None
    mpu.destroy_model_parallel()


def cp_topology_is_initialized() -> bool:
    return _TOPOLOGY is not None


def get_cp_topology() -> CPTopology:
    if _TOPOLOGY is None:
        raise RuntimeError("megatron_hsap.parallel_state.initialize_model_parallel has not been called")
    return _TOPOLOGY


def get_cp_config() -> ContextParallelConfig:
    if _CP_CONFIG is None:
        raise RuntimeError("megatron_hsap.parallel_state.initialize_model_parallel has not been called")
    return _CP_CONFIG
