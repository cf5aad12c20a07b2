"""Per-batch plans: where every token of a packed batch lives, and what attention exchanges.

``plan_batch`` turns the global batch's document boundaries into a ``BatchPlan``.
The same plan is computed identically on every rank (it depends only on the
document lengths and the topology's shape), so every rank knows what every other
rank will send without asking. Plans are cached by document-length signature (``PLAN_CACHE``,
bounded), which also takes plan data built ahead in data-loader workers (``training.plan_workers``).
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_hsap.config import LAYOUTS
from megatron_hsap.device_cache import host_to_device
from megatron_hsap.head_split import split_heads
from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.sequence.cost_model import CostModel
from megatron_hsap.sequence.plan_cache import PlanCache, approximate_bytes
from megatron_hsap.kernels.base import band_area
from megatron_hsap.sequence.layouts import LAYOUT_TABLES, Segment, check_table, table_segments
from megatron_hsap.sequence.placement_config import PlacementConfig
from megatron_hsap.sequence.schedule import (MemberSchedule, Piece, Window, build_member_schedule, document_bounds,
                                             member_pieces, normalize_window, piece_tables)

__all__ = ["BatchPlan", "PlanStats", "PLAN_CACHE", "PlanKey", "build_plan_data", "plan_batch", "plan_key",
           "store_plan_data", "validate_cu_seqlens"]


def validate_cu_seqlens(cu_seqlens: torch.Tensor) -> Tuple[int, ...]:
    """Document lengths from ``cu_seqlens`` (int ``[num_docs + 1]``, starting at 0, non-decreasing)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a torch.Tensor of int32/int64, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must have dtype int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D [num_docs + 1], got shape {tuple(cu_seqlens.shape)}")
    values = cu_seqlens.detach().cpu().numpy().astype(np.int64)
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {values[0]}")
    lengths = np.diff(values)
    if len(lengths) and lengths.min() < 0:
        bad = int(np.argmax(lengths < 0))
        raise ValueError(f"cu_seqlens must be non-decreasing; cu_seqlens[{bad + 1}]={values[bad + 1]} < "
                         f"cu_seqlens[{bad}]={values[bad]}")
    return tuple(lengths.tolist())


@dataclass(frozen=True)
class PlanStats:
    """Per-CP-rank figures for one layer's attention forward pass (lists indexed by CP rank, except
    ``recv_bytes_inter_forwarded``: indexed by node, in increasing node id).

    ``recv_bytes_inter`` counts a remote key/value row once per receiving ring member (what the ring
    moves without forwarding; the other per-rank fields are also without it); ``recv_bytes_inter_forwarded``
    once per receiving node: what the ring moves with node-level K/V forwarding
    (``ContextParallelConfig.kv_forwarding``: a row needed by several members of a node crosses the node
    boundary once, then is relayed inside the node). The two are equal when a node holds one ring member
    (Ulysses over the node).
    """

    tokens: List[int]
    padding_tokens: List[int]
    attn_flops: List[int]
    send_bytes_intra: List[int]
    send_bytes_inter: List[int]
    recv_bytes_intra: List[int]
    recv_bytes_inter: List[int]
    #: The ring's key/value bytes among ``send_bytes_*`` (what a sliding window shrinks).
    ring_send_bytes: List[int]
    recv_bytes_inter_forwarded: List[int]
    #: The ring's key/value bytes among ``recv_bytes_*`` (the backward returns their gradients to the senders).
    ring_recv_bytes: List[int]

    def __getitem__(self, key: str) -> List[int]:
        return getattr(self, key)

    @property
    def flops_imbalance(self) -> float:
        """max / mean attention FLOPs over ranks (1.0 = perfectly balanced)."""
        mean = sum(self.attn_flops) / len(self.attn_flops)
        return max(self.attn_flops) / mean if mean > 0 else 1.0


@dataclass
class _PlanData:
    """Rank-independent part of a plan, shared through the cache (and picklable: data-loader workers build it).

    ``table``: the placement as a segment table (``layouts.split_streams``); ``tables``: per member, the piece
    tables the schedule compiler joins on (``schedule.piece_tables``' form), built from it with numpy ops.
    The per-rank segment tuples and per-member piece dicts are built on first use (reports, ``stats``):
    a rank in training needs only its own slots and its member's schedule.
    """

    doc_lengths: Tuple[int, ...]
    layout: str
    cp_size: int
    ulysses_size: int
    table: np.ndarray
    tokens_per_rank: int
    schedules: Dict[Tuple[int, bool, Window, Optional[Tuple[int, ...]]], MemberSchedule] = field(default_factory=dict)
    tables: Optional[List[np.ndarray]] = None
    _segments: Optional[Tuple[Tuple[Segment, ...], ...]] = None
    _pieces: Optional[List[Dict[int, List[Piece]]]] = None
    #: What every member's schedule derives from ``tables`` alike (``build_member_schedule``'s ``shared``),
    #: built with the first schedule; not pickled (rebuilt on first use where the data lands).
    compiled: Dict[object, object] = field(default_factory=dict, compare=False, repr=False)
    #: Its key in ``PLAN_CACHE`` once stored there: what it builds later (schedules) is counted against the
    #: cache's budget under that key. Not pickled.
    cache_key: Optional["PlanKey"] = field(default=None, compare=False, repr=False)

    def __getstate__(self) -> Dict[str, object]:
        return {**self.__dict__, "compiled": {}, "cache_key": None}

    @property
    def rank_segments(self) -> Tuple[Tuple[Segment, ...], ...]:
        if self._segments is None:
            self._segments = tuple(tuple(s) for s in table_segments(self.table, self.cp_size))
        return self._segments

    @property
    def pieces(self) -> List[Dict[int, List[Piece]]]:
        if self._pieces is None:
            self._pieces = member_pieces(self.rank_segments, self.tokens_per_rank, self.ulysses_size)
        return self._pieces

    def schedule(self, member: int, causal: bool, window: Window,
                 node_of_member: Optional[Tuple[int, ...]] = None) -> MemberSchedule:
        key = (member, causal, window, node_of_member)
        if key not in self.schedules:
            before = (self._pieces, self.tables, self.compiled or None)
            if self.tables is None:
                self.tables = piece_tables(self.pieces)
            with _gc_paused():
                self.schedules[key] = build_member_schedule(self.tables, member, causal, window, node_of_member,
                                                            self.compiled)
            if self.cache_key is not None:  # the schedule, and what it was the first to need
                built = [now for was, now in zip(before, (self._pieces, self.tables, self.compiled)) if was is None]
                PLAN_CACHE.add_bytes(self.cache_key, approximate_bytes([self.schedules[key]] + built))
        return self.schedules[key]


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Planning and schedule compiling allocate many small acyclic objects; a full cyclic-GC pass over the
    process heap triggered by them would stall random batches (tools/bench_plan_ahead.py measures planning time). Refcounting frees them; the
    collector resumes after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _member_tables(table: np.ndarray, doc_lengths: Sequence[int], tokens_per_rank: int, ulysses: int,
                   ring: int) -> List[np.ndarray]:
    """Per member, int64 ``[n, 4]`` rows (doc, buffer_start, doc_start, doc_end) sorted by document then
    position, adjacent pieces merged: ``schedule.piece_tables(schedule.member_pieces(...))`` with numpy ops."""
    if not len(table):
        return [np.zeros((0, 4), dtype=np.int64) for _ in range(ring)]
    rank, doc, start, end = table.T
    length = end - start
    # Buffer position: the rank's slot offset in the member, plus the tokens before the row in its rank.
    before = np.cumsum(length) - length
    rank_first = np.cumsum(np.bincount(rank, minlength=ring * ulysses)) - np.bincount(rank, minlength=ring * ulysses)
    buffer = (rank % ulysses) * tokens_per_rank + before - before[rank_first[rank]]
    member = rank // ulysses
    # A row continuing the previous one (same member and document, adjacent in the buffer and the document)
    # is merged into it: a document cut only by a Ulysses rank boundary is one piece of the member buffer.
    head = np.ones(len(doc), dtype=bool)
    head[1:] = ~((member[1:] == member[:-1]) & (doc[1:] == doc[:-1]) & (start[1:] == end[:-1])
                 & (buffer[1:] == buffer[:-1] + length[:-1]))
    heads = np.flatnonzero(head)
    tails = np.append(heads[1:] - 1, len(doc) - 1)
    merged = np.stack([doc[heads], buffer[heads], start[heads], end[tails]], axis=1)
    owner = member[heads]
    # Sort by member, then document, then position: the packed position orders (document, position).
    doc_starts = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(doc_lengths, dtype=np.int64)])
    order = np.argsort(owner * (int(doc_starts[-1]) + 1) + doc_starts[merged[:, 0]] + merged[:, 2], kind="stable")
    merged, owner = merged[order], owner[order]
    bounds = np.searchsorted(owner, np.arange(ring + 1)).tolist()
    return [merged[bounds[m]:bounds[m + 1]] for m in range(ring)]


def build_plan_data(doc_lengths: Tuple[int, ...], topology_signature: tuple, layout: str,
                    cost_model: Optional[CostModel], placement: Optional[PlacementConfig] = None) -> _PlanData:
    """The rank-independent part of a plan, uncached: placement, its check, the members' piece tables."""
    cp, ulysses, nodes = topology_signature
    topology = CPTopology(cp_size=cp, ulysses_size=ulysses, node_of_cp_rank=nodes)
    with _gc_paused():
        lengths = np.fromiter(doc_lengths, np.int64, len(doc_lengths))  # one conversion for every step below
        table, tokens_per_rank = LAYOUT_TABLES[layout].table(lengths, topology, cost_model, placement)
        check_table(table, lengths, tokens_per_rank)
        data = _PlanData(doc_lengths, layout, cp, ulysses, table, tokens_per_rank)
        data.tables = _member_tables(table, lengths, tokens_per_rank, ulysses, cp // ulysses)
    return data


#: (document lengths, topology signature, layout, cost model, placement config): ``build_plan_data``'s arguments.
PlanKey = Tuple[Tuple[int, ...], Tuple[int, int, Tuple[int, ...]], str, Optional[CostModel], Optional[PlacementConfig]]
#: The plans' rank-independent data by ``plan_key``: up to ``PLAN_CACHE_BYTES`` (the training script's
#: ``--plan-cache-mb``), least recently used evicted.
PLAN_CACHE_BYTES = 256 << 20


def _plan_bytes(data: object) -> int:
    """``approximate_bytes`` of a cache entry, a plan's lengths tuple counted without visiting its ints (a pointer
    each: they hold nothing else), which a batch of 2**20 documents would make a noticeable part of planning."""
    if isinstance(data, _PlanData):
        return 8 * len(data.doc_lengths) + approximate_bytes({k: v for k, v in vars(data).items()
                                                              if k not in ("doc_lengths", "cache_key")})
    return approximate_bytes(data)


PLAN_CACHE: PlanCache = PlanCache(max_bytes=PLAN_CACHE_BYTES, size_of=_plan_bytes)


def store_plan_data(key: "PlanKey", data: _PlanData) -> None:
    """Put a plan's data in ``PLAN_CACHE`` under ``key``; the schedules it compiles later count there too."""
    data.cache_key = key
    PLAN_CACHE.put(key, data)


def plan_key(cu_seqlens: torch.Tensor, topology_signature: Tuple[int, int, Tuple[int, ...]], layout: str,
             cost_model: Optional[CostModel] = None, placement: Optional[PlacementConfig] = None) -> PlanKey:
    """The cache key of ``plan_batch``'s plan (``topology_signature``: ``CPTopology.signature()``), with the
    arguments checked (ValueError naming the bad one) and a cost model or placement config that changes
    nothing dropped, so plans that cannot differ share an entry."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; allowed values: {', '.join(map(repr, LAYOUTS))}")
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model must be a CostModel or None, got {type(cost_model).__name__}")
    if placement is not None and not isinstance(placement, PlacementConfig):
        raise ValueError(f"placement must be a PlacementConfig or None, got {type(placement).__name__}")
    lengths = validate_cu_seqlens(cu_seqlens)
    configurable = LAYOUT_TABLES[layout].configurable
    if not configurable or cost_model == CostModel():
        cost_model = None
    if not configurable or placement == PlacementConfig():
        placement = None
    return lengths, topology_signature, layout, cost_model, placement


def plan_batch(cu_seqlens: torch.Tensor, topology: CPTopology, layout: str = "zigzag", *,
               cost_model: Optional[CostModel] = None, placement: Optional[PlacementConfig] = None) -> "BatchPlan":
    """Plan one packed batch.

    cu_seqlens: int ``[num_docs + 1]`` boundaries of the *global* packed batch (the same
    on every rank; zero-length documents allowed). topology: from ``get_cp_topology()``
    or ``CPTopology.offline(...)``. layout: 'zigzag', 'contiguous' or 'sequence-aware'.
    cost_model: the model's layer geometry (``CostModel``; default ``CostModel()``, Llama-3-8B), part of the
    sequence-aware plan's cache key; the placement itself does not depend on it (a member with tail padding
    takes the same attention share as a full one: docs/sequence_aware.md, "Cost model").
    placement: the sequence-aware placement's targets and knobs (``PlacementConfig``; default
    ``PlacementConfig()``: attention imbalance <= 1.02, slack spent on inter-node traffic). The other layouts
    ignore both.
    """
    if not isinstance(topology, CPTopology):
        raise ValueError(f"topology must be a CPTopology, got {type(topology).__name__}")
    with _gc_paused():  # the lengths' list and tuple: a batch of many documents would trigger collections
        key = plan_key(cu_seqlens, topology.signature(), layout, cost_model, placement)
    data = PLAN_CACHE.get(key)
    if data is None:
        data = build_plan_data(*key)
        store_plan_data(key, data)
    return BatchPlan(data, topology)


class BatchPlan:
    """Where this batch's tokens live on the CP ranks, and how attention moves them.

    Every CP rank holds ``tokens_per_rank`` slots: its segments (in order), then padding.
    Local tensors handed to attention and to the rest of the model are laid out that way.
    """

    def __init__(self, data: _PlanData, topology: CPTopology) -> None:
        self._data = data
        self.topology = topology
        self._local: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        #: This rank's per-plan tensors already copied to a device (``position_ids_on``), by device.
        self._on_device: Dict[torch.device, torch.Tensor] = {}
        #: Call signatures whose cross-rank agreement was checked (``attention.agreement``).
        self.verified_signatures: set = set()

    # ---- layout -------------------------------------------------------------------------
    @property
    def layout(self) -> str:
        return self._data.layout

    @property
    def doc_lengths(self) -> Tuple[int, ...]:
        return self._data.doc_lengths

    @property
    def total_tokens(self) -> int:
        return sum(self._data.doc_lengths)

    @property
    def tokens_per_rank(self) -> int:
        return self._data.tokens_per_rank

    @property
    def rank_segments(self) -> Tuple[Tuple[Segment, ...], ...]:
        return self._data.rank_segments

    def _rank(self, rank: Optional[int]) -> int:
        rank = self.topology.cp_rank if rank is None else rank
        if rank is None:
            raise ValueError("this plan's topology is offline: pass rank= explicitly")
        return rank

    def _slot_tables(self, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(global index, in-document position) of every local slot of CP rank ``rank``; (-1, 0) on padding."""
        table = self._data.table
        lo, hi = np.searchsorted(table[:, 0], [rank, rank + 1]).tolist()
        _, doc, start, end = table[lo:hi].T
        length = end - start
        doc_starts = np.concatenate([[0], np.cumsum(np.asarray(self._data.doc_lengths, dtype=np.int64))])
        # Slot j of segment k: in-document position start_k + (j - first slot of k).
        positions = np.arange(int(length.sum())) + np.repeat(start - (np.cumsum(length) - length), length)
        indices = positions + np.repeat(doc_starts[doc], length)
        pad = self.tokens_per_rank - len(positions)
        return (torch.from_numpy(np.concatenate([indices, np.full(pad, -1, dtype=np.int64)])),
                torch.from_numpy(np.concatenate([positions, np.zeros(pad, dtype=np.int64)])))

    def global_indices_of(self, rank: Optional[int] = None) -> torch.Tensor:
        """int64 ``[tokens_per_rank]``: global packed index of each local slot, -1 on padding."""
        return self._slot_tables(self._rank(rank))[0]

    def position_ids_of(self, rank: Optional[int] = None) -> torch.Tensor:
        """int64 ``[tokens_per_rank]``: in-document position of each local slot (0 on padding)."""
        return self._slot_tables(self._rank(rank))[1]

    def _local_tables(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._local is None:
            self._local = self._slot_tables(self._rank(None))
        return self._local

    @property
    def global_indices(self) -> torch.Tensor:
        return self._local_tables()[0]

    @property
    def position_ids(self) -> torch.Tensor:
        """This rank's in-document positions ``[tokens_per_rank]`` (for RoPE)."""
        return self._local_tables()[1]

    def position_ids_on(self, device: torch.device) -> torch.Tensor:
        """``position_ids`` on ``device``, copied there once per plan (the plan's device cache): the micro-batch
        moves it when it goes to the device (``PackedMicroBatch.to``) and every layer reuses that copy."""
        device = torch.device(device)
        cached = self._on_device.get(device)
        if cached is None:
            cached = self._on_device[device] = host_to_device(self.position_ids, device)
        return cached

    @property
    def valid_mask(self) -> torch.Tensor:
        """bool ``[tokens_per_rank]``: False on padding slots (mask their loss)."""
        return self.global_indices >= 0

    @property
    def num_padding_tokens(self) -> int:
        return int((self.global_indices < 0).sum())

    def shard(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's part of a global tensor whose ``dim`` has the packed length; zeros on padding."""
        if x.shape[dim] != self.total_tokens:
            raise ValueError(f"x.shape[{dim}]={x.shape[dim]} does not match the packed length {self.total_tokens} "
                             "given by cu_seqlens[-1]")
        index = self.global_indices.to(x.device)
        valid = index >= 0
        local = x.index_select(dim, index.clamp(min=0))
        if not bool(valid.all()):
            shape = [1] * x.dim()
            shape[dim] = -1
            local = local * valid.view(shape).to(local.dtype)
        return local

    def unshard(self, x_local: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Reassemble the global tensor on every rank (collective over the CP group; not differentiable)."""
        if x_local.shape[dim] != self.tokens_per_rank:
            raise ValueError(f"x_local.shape[{dim}]={x_local.shape[dim]} must equal tokens_per_rank={self.tokens_per_rank}")
        x_local = x_local.detach().movedim(dim, 0).contiguous()
        cp = self.topology.cp_size
        if cp == 1:
            gathered = [x_local]
        else:
            if self.topology.cp_group is None:
                raise ValueError("unshard needs an online topology (process groups); this plan's topology is offline")
            gathered = [torch.empty_like(x_local) for _ in range(cp)]
            dist.all_gather(gathered, x_local, group=self.topology.cp_group)
        out = x_local.new_zeros((self.total_tokens,) + tuple(x_local.shape[1:]))
        for rank in range(cp):
            index = self.global_indices_of(rank).to(x_local.device)
            valid = index >= 0
            out[index[valid]] = gathered[rank][valid]
        return out.movedim(0, dim)

    # ---- attention schedule ------------------------------------------------------------------
    def member_schedule(self, causal: bool, member: Optional[int] = None,
                        window_size: Optional[Tuple[int, int]] = None,
                        kv_forwarding: bool = False) -> MemberSchedule:
        """What ring member ``member`` (default: this rank's) computes and exchanges; ``window_size`` as in
        ``context_parallel_attention`` (cached per (causal, window, forwarding)). ``kv_forwarding``:
        node-level K/V forwarding (``ContextParallelConfig.kv_forwarding``); a remote row needed by several
        members of a node crosses the node boundary once (``PlanStats.recv_bytes_inter_forwarded``)."""
        member = self.topology.ring_rank if member is None else member
        if member is None:
            raise ValueError("this plan's topology is offline: pass member= explicitly")
        forwarding = kv_forwarding and self.topology.ring_members_share_nodes()
        return self._data.schedule(member, bool(causal), normalize_window(window_size, bool(causal)),
                                   self.topology.node_of_ring_member if forwarding else None)

    # ---- predicted statistics ---------------------------------------------------------------
    def stats(self, num_heads_q: int, num_heads_kv: int, head_dim: int, dtype: torch.dtype = torch.bfloat16,
              causal: bool = True, window_size: Optional[Tuple[int, int]] = None) -> PlanStats:
        """Predicted per-rank figures of one layer's attention forward (plain Ulysses stages).

        attn_flops = 4 * mask area * heads per rank * head_dim; bytes count the Ulysses
        all-to-alls (q, k, v in and the output back) and the ring's key/value exchanges
        (with a sliding window, only the key rows inside some query's window).
        Computed from the placement alone (not from the compiled blocks), so tests can check
        the compiled schedule and the measured traffic against it.
        """
        topo = self.topology
        ulysses, ring, cp = topo.ulysses_size, topo.ring_size, topo.cp_size
        heads = split_heads(num_heads_q, num_heads_kv, ulysses)
        q_heads, kv_heads = heads.query_counts, heads.kv_counts
        window = normalize_window(window_size, causal)
        bounds = document_bounds(causal, window)
        elem = torch.empty((), dtype=dtype).element_size()
        pieces = self._data.pieces
        lengths = self._data.doc_lengths
        tokens = [sum(e - s for _, s, e in segs) for segs in self._data.rank_segments]
        padding = [self.tokens_per_rank - n for n in tokens]

        area = [0] * ring
        for m in range(ring):
            for doc, doc_pieces in pieces[m].items():
                for _, q0, q1 in doc_pieces:
                    area[m] += band_area(q0, q1, 0, lengths[doc], *bounds)
        flops = [4 * area[c // ulysses] * q_heads[c % ulysses] * head_dim for c in range(cp)]

        send_intra, send_inter = [0] * cp, [0] * cp
        recv_intra, recv_inter = [0] * cp, [0] * cp
        ring_send, ring_recv = [0] * cp, [0] * cp

        def add(src: int, dst: int, nbytes: int) -> None:
            if nbytes == 0:
                return
            if topo.same_node(src, dst):
                send_intra[src] += nbytes
                recv_intra[dst] += nbytes
            else:
                send_inter[src] += nbytes
                recv_inter[dst] += nbytes

        slice_bytes = self.tokens_per_rank * head_dim * elem  # one head of one rank's tokens
        for c in range(cp):
            member = c // ulysses
            for peer in topo.ring_member_ranks(member):
                if peer != c:  # q, k, v of the peer's heads there; the output of this rank's heads back
                    p = peer % ulysses
                    add(c, peer, slice_bytes * (q_heads[p] + 2 * kv_heads[p] + q_heads[c % ulysses]))
        for a in range(ring):
            for b in range(ring):
                if a != b:
                    rows = needed_rows(pieces[a], pieces[b], causal, window)
                    for u in range(ulysses):
                        row_bytes = 2 * kv_heads[u] * head_dim * elem
                        add(b * ulysses + u, a * ulysses + u, rows * row_bytes)
                        ring_send[b * ulysses + u] += rows * row_bytes
                        ring_recv[a * ulysses + u] += rows * row_bytes
        # With forwarding a node receives, from each remote member, the rows any of its members needs:
        # the node's pieces of a document taken together, causal limit = the latest query of any member.
        row_bytes = 2 * sum(kv_heads) * head_dim * elem  # every Ulysses rank's KV heads of one row
        node_of_member = topo.node_of_ring_member
        nodes = sorted(set(node_of_member))
        forwarded = []
        for node in nodes:
            node_docs: Dict[int, List[Piece]] = {}
            for m in range(ring):
                if node_of_member[m] == node:
                    for doc, doc_pieces in pieces[m].items():
                        node_docs.setdefault(doc, []).extend(doc_pieces)
            rows = sum(needed_rows(node_docs, pieces[b], causal, window)
                       for b in range(ring) if node_of_member[b] != node)
            forwarded.append(rows * row_bytes)
        return PlanStats(tokens, padding, flops, send_intra, send_inter, recv_intra, recv_inter, ring_send,
                         forwarded, ring_recv)


def needed_rows(q_docs: Dict[int, List[Piece]], k_docs: Dict[int, List[Piece]], causal: bool,
                window: Window = None) -> int:
    """Key rows of ``k_docs``' member that ``q_docs``' member attends to: keys some query of the same
    document sees (causal: before its last query; with a window (``normalize_window``): within reach)."""
    lo, hi = document_bounds(causal, window)
    rows = 0
    for doc, q_pieces in q_docs.items():
        k_pieces = k_docs.get(doc)
        if not k_pieces:
            continue
        reach = sorted((q0 + lo if lo is not None else -1, q1 + hi if hi is not None else 1 << 62)
                       for _, q0, q1 in q_pieces)  # keys [start, end) some query of the piece sees
        merged: List[List[int]] = []
        for start, end in reach:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        for _, k0, k1 in k_pieces:
            rows += sum(max(0, min(k1, end) - max(k0, start)) for start, end in merged)
    return rows


def validate_head_counts(num_heads_q: int, num_heads_kv: int, ulysses_size: int) -> int:
    """KV heads held over the Ulysses group (``HeadSplit.kv_heads_held``: each rank holds exactly the KV heads
    its query heads use); ValueError naming the argument for zero, non-int or non-GQA head counts."""
    return split_heads(num_heads_q, num_heads_kv, ulysses_size).kv_heads_held
