"""UPipe: head-chunked context-parallel attention fused with the QKV projection (UPipe, arXiv 2602.21196).

``head_chunked_attention`` takes the attention block's input and Megatron's fused
``linear_qkv`` weight and returns what feeds ``linear_proj``. Per stage of U query
heads (see ``head_schedule``) it projects only that stage's weight rows, applies
rotary embeddings, runs the Ulysses all-to-all (keys/values only in the stage that
first needs them), ring attention over the plan's member schedule, and the reverse
all-to-all into the stage's slice of the output. The full-head Q/K/V and their
all-to-all outputs never exist: peak memory follows U, not H.

The backward recomputes each stage's projection and all-to-all (nothing per stage is
saved but its log-sum-exp), brings the stage's output and output gradient over in one
all-to-all, and accumulates the weight, bias and input gradients stage by stage. KV
gradients are summed on the attending rank over the stages that use a KV head and go
back once, in the stage of its last use; a KV head sent to two ranks (its query heads
straddle their ranges) sums in the weight and input gradients. Head counts need not
divide the Ulysses size: the all-to-alls then use uneven split sizes.
With a ring, a stage sends over the ring only the KV heads it attends first, later
stages reuse the received rows, and their gradients go back once, in the stage of last use
(``shared_kv.SharedRemoteKeyValues``): a KV head crosses the ring once per layer in each direction, as
without head chunks.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_hsap.attention.agreement import agree_across_cp_ranks
from megatron_hsap.attention.context_parallel import (
    attend_runs,
    attend_runs_backward,
    check_device_matches_backend,
    fail_with_peers,
)
from megatron_hsap.attention.head_schedule import HeadSchedule, Stage, build_head_schedule
from megatron_hsap.attention.ring_exchange import OP_DKV, OP_DKV_RELAY, OP_KV, OP_KV_BWD, OP_KV_RELAY, OP_KV_RELAY_BWD
from megatron_hsap.attention.shared_kv import SharedRemoteKeyValues
from megatron_hsap.collectives import all_to_all_member
from megatron_hsap.instrumentation.comm import CommStats, comm_stats
from megatron_hsap.kernels import get_kernel
from megatron_hsap.sequence.plan import BatchPlan
from megatron_hsap.sequence.schedule import Window, normalize_window

__all__ = ["head_chunked_attention", "resolve_head_schedule", "predicted_stage_comm", "rope_angles"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Operation names in ``instrumentation.comm`` for UPipe's all-to-alls.
OP_QKV, OP_OUT = "upipe_qkv", "upipe_out"
OP_QKV_BWD, OP_OUT_BWD, OP_DQKV_BWD = "upipe_qkv_bwd", "upipe_out_bwd", "upipe_dqkv_bwd"

CommLog = List[Tuple[str, int, CommStats]]


def rope_angles(position_ids: torch.Tensor, rotary_dim: int, base: float = 10000.0,
                interleaved: bool = False) -> torch.Tensor:
    """Megatron's RoPE angles ``[t, rotary_dim]`` (fp32) for int positions ``[t]``: inv_freq =
    base^(-2i/rotary_dim), angles = cat(pos * inv_freq, pos * inv_freq), or with ``interleaved``
    each angle twice in a row (the layout of Megatron's ``RotaryEmbedding(rotary_interleaved=True)``)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=position_ids.device)
                         / rotary_dim))
    angles = torch.outer(position_ids.to(torch.float32), inv_freq)
    if interleaved:
        return torch.stack((angles, angles), dim=-1).flatten(-2)
    return torch.cat((angles, angles), dim=-1)


class _Rope:
    """RoPE on the first ``rotary_dim`` features of ``[t, ..., d]`` tensors, and its transpose.

    Rotate-half pairs (i, i + rotary_dim/2), or with ``interleaved`` Megatron's pairs (2i, 2i+1).
    Applied one head slice at a time, so its temporaries are a few ``[t, d]`` slices, not the stage's.
    """

    def __init__(self, angles: torch.Tensor, dtype: torch.dtype, interleaved: bool = False) -> None:
        self.dim = angles.shape[-1]
        self.cos = angles.cos().to(dtype)[:, None, None, :]
        self.sin = angles.sin().to(dtype)[:, None, None, :]
        self.interleaved = interleaved

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Megatron's ``_rotate_half``: an antisymmetric map R, so R^T = -R."""
        if self.interleaved:
            return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    @staticmethod
    def _slices(x: torch.Tensor, dim: int):
        """Single-head views ``[t, 1, 1, dim]`` of ``x [t, A, B, d]``."""
        for a in range(x.shape[1]):
            for b in range(x.shape[2]):
                yield x[:, a:a + 1, b:b + 1, :dim]

    def apply_(self, x: torch.Tensor) -> None:
        """In place on ``x [t, A, B, d]`` (bit for bit Megatron's ``t * cos + rotate_half(t) * sin``)."""
        for rot in self._slices(x, self.dim):
            rot.copy_(rot * self.cos + self._rotate(rot) * self.sin)

    def transpose_(self, grad: torch.Tensor) -> None:
        """In place on ``grad [t, A, B, d]``: the gradient w.r.t. RoPE's input from the gradient w.r.t. its output."""
        for rot in self._slices(grad, self.dim):
            rot.copy_(rot * self.cos - self._rotate(rot * self.sin))


def resolve_head_schedule(plan: BatchPlan, num_heads_q: int, num_heads_kv: int,
                          head_chunk_size: Optional[int]) -> HeadSchedule:
    """The stage plan for this TP rank's heads; ``head_chunk_size`` None = the topology config's default."""
    topo = plan.topology
    if head_chunk_size is None:
        head_chunk_size = topo.config.resolve_head_chunk_size(num_heads_q, topo.ulysses_size)
    return build_head_schedule(num_heads_q, num_heads_kv, topo.ulysses_size, head_chunk_size)


def predicted_stage_comm(schedule: HeadSchedule, plan: BatchPlan, head_dim: int, dtype: torch.dtype,
                         causal: bool = True, window_size: Optional[Tuple[int, int]] = None
                         ) -> List[Tuple[Dict[Tuple[str, str], int], Dict[Tuple[str, str], int]]]:
    """Bytes this CP rank sends in each stage: ``[(forward, backward)]``, each ``{(op, 'intra'|'inter'): bytes}``.

    All-to-alls: t_local x (heads) x d per peer of the Ulysses group (forward: the peer's q + new
    k/v, this rank's output back; backward: the same q/k/v again, the peer's output + its gradient,
    then this rank's dq + dk/dv of finished KV heads). Ring: the member schedule's rows x the KV heads
    first attended in the stage (k and v) per exchange, and the received rows' dk/dv of the KV heads last
    attended in the stage back in the backward.
    """
    topo = plan.topology
    me, u = topo.cp_rank, topo.ulysses_rank
    elem = torch.empty((), dtype=dtype).element_size()
    t = plan.tokens_per_rank
    member = plan.member_schedule(causal, window_size=window_size, kv_forwarding=topo.config.kv_forwarding)
    peers = [c for c in topo.ring_member_ranks(topo.ring_rank) if c != me]

    def where(peer: int) -> str:
        return "intra" if topo.same_node(me, peer) else "inter"

    out = []
    for stage in schedule.stages:
        fwd: Dict[Tuple[str, str], int] = defaultdict(int)
        bwd: Dict[Tuple[str, str], int] = defaultdict(int)
        mine, done = len(stage.query_heads[u]), len(stage.done_kv[u])
        for peer in peers:
            v = peer % topo.ulysses_size
            m, n = len(stage.query_heads[v]), len(stage.new_kv[v])
            for table, op, heads in ((fwd, OP_QKV, m + 2 * n), (fwd, OP_OUT, mine), (bwd, OP_QKV_BWD, m + 2 * n),
                                     (bwd, OP_OUT_BWD, 2 * m), (bwd, OP_DQKV_BWD, mine + 2 * done)):
                table[(op, where(peer))] += t * heads * head_dim * elem
        row_bytes, grad_row_bytes = (2 * len(heads[u]) * head_dim * elem for heads in (stage.new_kv, stage.done_kv))
        for _, recv, send in member.steps():
            if send is not None:
                peer = send.dst_member * topo.ulysses_size + u
                fwd[(OP_KV, where(peer))] += send.rows.num_rows * row_bytes
                bwd[(OP_KV_BWD, where(peer))] += send.rows.num_rows * row_bytes
            if recv is not None:
                bwd[(OP_DKV, where(recv.src_member * topo.ulysses_size + u))] += recv.num_rows * grad_row_bytes
        for send in member.relay_sends:  # node-level K/V forwarding (kv_forwarding.NodeForwarding)
            peer = send.dst_member * topo.ulysses_size + u
            fwd[(OP_KV_RELAY, where(peer))] += send.num_rows * row_bytes
            bwd[(OP_KV_RELAY_BWD, where(peer))] += send.num_rows * row_bytes
        for recv in member.relay_recvs:
            bwd[(OP_DKV_RELAY, where(recv.src_member * topo.ulysses_size + u))] += recv.num_rows * grad_row_bytes
        out.append(({k: v for k, v in fwd.items() if v}, {k: v for k, v in bwd.items() if v}))
    return out


Runs = Tuple[Tuple[int, int, int], ...]  # (row in the stage's buffer, row in the fused weight, rows)


def _unit_runs(units: List[int], head_dim: int) -> Runs:
    """Maximal runs of units that are consecutive both in a stage's buffer and in the fused QKV weight."""
    runs: List[Tuple[int, int, int]] = []
    for i, unit in enumerate(units):
        if runs and runs[-1][1] + runs[-1][2] == unit * head_dim:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + head_dim)
        else:
            runs.append((i * head_dim, unit * head_dim, head_dim))
    return tuple(runs)


@dataclass(frozen=True)
class _RankPlan:
    """Host-side per-call constants of one Ulysses rank's walk through a schedule (built once, cached).

    send_runs / grad_runs: per stage, the weight rows of the projected units / of the returned gradients.
    width: the most head slices one rank's share of a stage's all-to-all carries (QKV, output + its
      gradient, or dQKV), over stages and ranks.
    kv_slots: the most KV heads this rank holds at once (slots of the retained-KV buffer).
    attn_width: the most KV heads one stage's attention takes (>1 needs a gathered k/v buffer).
    """

    send_runs: Tuple[Runs, ...]
    grad_runs: Tuple[Runs, ...]
    width: int
    kv_slots: int
    attn_width: int


@functools.lru_cache(maxsize=64)
def _rank_plan(schedule: HeadSchedule, rank: int, head_dim: int) -> _RankPlan:
    live, most = 0, 0
    for stage in schedule.stages:
        live += len(stage.new_kv[rank])
        most = max(most, live)
        live -= len(stage.done_kv[rank])
    width = max(max(len(q) + 2 * max(len(n), len(c)), 2 * len(q)) for s in schedule.stages
                for q, n, c in zip(s.query_heads, s.new_kv, s.done_kv))
    return _RankPlan(tuple(_unit_runs(schedule.send_units(s), head_dim) for s in schedule.stages),
                     tuple(_unit_runs(schedule.grad_units(s), head_dim) for s in schedule.stages),
                     width, most, max(len(s.attn_kv[rank]) for s in schedule.stages))


class _Stages:
    """What forward and backward share: per-call buffers, the per-stage projection + all-to-all, KV retention.

    Buffers (allocated once per forward or backward call, reused by every stage; E = element size of x,
    t = tokens per rank, P = Ulysses size, w = ``_RankPlan.width``, D = head_dim):
      rows   ``[P*w*D, hidden]``  E   the stage's fused-weight rows (projection, and dx in the backward)
      send   ``P * t * w * D``    E   all-to-all send buffer, destination major ([t, w_i, D] per destination i,
                                      w_i that destination's heads): the projection GEMMs write here directly;
                                      backward: token-major staging of dQKV
      recv   ``P * t * w * D``    E   all-to-all receive buffer = the member's [P*t, w_me, D]
      kv     ``[slots, 2, P*t, D]`` E  KV heads kept from their first to their last stage
      k_attn/v_attn ``[P*t, A, D]`` E  only when one stage's attention takes A > 1 KV heads
    backward only:
      pair   ``P * t * 2m * D``   E   the stage's output, then its gradient, after their all-to-alls (m: this
                                      rank's most query heads in one stage)
      dkv    ``[slots, 2, P*t, D]`` fp32  KV gradients summed over the stages sharing a KV head
      dw     ``P*w*D*hidden``     E   one stage's weight gradient (one GEMM), added into main_grad / dweight
    """

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], plan: BatchPlan,
                 schedule: HeadSchedule, head_dim: int, rope: Optional[_Rope], causal: bool, scale: float,
                 backward: bool, window: Window = None) -> None:
        self.x, self.weight, self.bias = x, weight, bias  # x [t_local, hidden]
        self.topo, self.schedule = plan.topology, schedule
        self.d, self.rope, self.scale = head_dim, rope, scale
        self.member = plan.member_schedule(causal, window_size=window, kv_forwarding=self.topo.config.kv_forwarding)
        self.kernel = get_kernel(self.topo.config.kernel)
        self.rank = self.topo.ulysses_rank
        self.plan = _rank_plan(schedule, self.rank, head_dim)
        self.remote_kv = SharedRemoteKeyValues() if self.topo.ring_size > 1 else None
        t, hidden = x.shape
        p, d, w = schedule.ulysses_size, head_dim, self.plan.width
        slab = p * t * w * d
        self.rows = x.new_empty(p * w * d, hidden)
        self.send, self.recv = x.new_empty(slab), x.new_empty(slab)
        self.kv = x.new_empty(self.plan.kv_slots, 2, p * t, d)
        a = self.plan.attn_width
        self.k_attn = x.new_empty(p * t, a, d) if a > 1 else None
        self.v_attn = x.new_empty(p * t, a, d) if a > 1 else None
        self.slot: Dict[int, int] = {}  # KV head -> slot in kv / dkv
        self.free = list(range(self.plan.kv_slots))
        if backward:
            acc = torch.float64 if x.dtype == torch.float64 else torch.float32
            self.pair = x.new_empty(p * t * 2 * max(len(s.query_heads[self.rank]) for s in schedule.stages) * d)
            self.dkv = torch.empty(self.plan.kv_slots, 2, p * t, d, dtype=acc, device=x.device)
            self.dw = x.new_empty(p * w * d * hidden)

    def blocks(self, flat: torch.Tensor, widths: List[int]) -> List[torch.Tensor]:
        """Consecutive ``[t, w_i, D]`` views of ``flat``, one per width (per destination or source rank)."""
        t, d = self.x.shape[0], self.d
        views, at = [], 0
        for w in widths:
            views.append(flat[at:at + t * w * d].view(t, w, d))
            at += t * w * d
        return views

    def a2a(self, send_widths: List[int], recv_widths: List[int], op: str, send: torch.Tensor,
            recv: torch.Tensor) -> torch.Tensor:
        """All-to-all of ``[t, w_i, D]`` blocks: ``send_widths[i]`` head slices go to Ulysses rank i, ``recv_widths[i]``
        come from it (flat buffers; a copy without a Ulysses group). Returns the filled part of ``recv``."""
        row = self.x.shape[0] * self.d
        n_send, n_recv = row * sum(send_widths), row * sum(recv_widths)
        if self.topo.ulysses_size == 1:
            return recv[:n_recv].copy_(send[:n_send])
        return all_to_all_member(send[:n_send], self.topo, op, out=recv[:n_recv],
                                 send_rows=[row * w for w in send_widths], recv_rows=[row * w for w in recv_widths])

    def gather_rows(self, runs: Runs) -> torch.Tensor:
        """The fused weight's rows of a stage's units, in buffer order ``[n*D, hidden]``."""
        for at, row, n in runs:
            self.rows[at:at + n].copy_(self.weight[row:row + n])
        return self.rows[:runs[-1][0] + runs[-1][2]]

    def project(self, index: int, stage: Stage, op: str) -> torch.Tensor:
        """One GEMM per destination for the stage's units, RoPE, all-to-all. Stores the stage's new KV heads
        in ``kv``; returns this rank's stage queries ``[P*t, m, d]`` (a view of ``recv``)."""
        t, p, d = self.x.shape[0], self.schedule.ulysses_size, self.d
        widths = [len(q) + 2 * len(n) for q, n in zip(stage.query_heads, stage.new_kv)]
        runs = self.plan.send_runs[index]
        rows = self.gather_rows(runs)  # [sum(widths)*d, hidden], destination major
        bias = None if self.bias is None else torch.cat([self.bias[row:row + k] for _, row, k in runs])
        at = 0
        # x is shared by every destination; each GEMM writes straight into its block of the send buffer.
        for block, w, q, n in zip(self.blocks(self.send, widths), widths, stage.query_heads, stage.new_kv):
            torch.mm(self.x, rows[at:at + w * d].t(), out=block.view(t, w * d))
            if bias is not None:
                block.view(t, w * d).add_(bias[at:at + w * d])
            if self.rope is not None:
                self.rope.apply_(block.unsqueeze(1)[:, :, :len(q) + len(n)])
            at += w * d
        m, n = len(stage.query_heads[self.rank]), len(stage.new_kv[self.rank])
        mine = widths[self.rank]
        member = self.a2a(widths, [mine] * p, op, self.send, self.recv).view(p * t, mine, d)
        for i, j in enumerate(stage.new_kv[self.rank]):
            slot = self.slot[j] = self.free.pop()
            self.kv[slot, 0].copy_(member[:, m + i])
            self.kv[slot, 1].copy_(member[:, m + n + i])
        return member[:, :m]

    def attention_kv(self, stage: Stage) -> Tuple[torch.Tensor, torch.Tensor]:
        """k, v ``[P*t, h_kv', d]`` for the stage's attention, from the KV heads kept on this rank."""
        slots = [self.slot[j] for j in stage.attn_kv[self.rank]]
        if len(slots) == 1:
            return self.kv[slots[0], 0].unsqueeze(1), self.kv[slots[0], 1].unsqueeze(1)
        if not slots:
            empty = self.kv.new_empty(self.kv.shape[2], 0, self.d)
            return empty, empty
        k, v = self.k_attn[:, :len(slots)], self.v_attn[:, :len(slots)]
        for i, slot in enumerate(slots):
            k[:, i].copy_(self.kv[slot, 0])
            v[:, i].copy_(self.kv[slot, 1])
        return k, v

    def shared_remote_kv(self, stage: Stage) -> Optional[SharedRemoteKeyValues]:
        """The ring's kept remote K/V rows, told which KV heads this stage attends, first and last."""
        if self.remote_kv is not None:
            r = self.rank
            self.remote_kv.begin_stage(stage.attn_kv[r], stage.new_kv[r], stage.done_kv[r])
        return self.remote_kv

    def release(self, stage: Stage) -> None:
        """Free the slots of the KV heads whose last stage this was."""
        for j in stage.done_kv[self.rank]:
            self.free.append(self.slot.pop(j))


def _log_stage(log: Optional[CommLog], direction: str, index: int, before: Optional[CommStats]) -> None:
    if log is not None:
        log.append((direction, index, comm_stats().minus(before)))


def _forward(st: _Stages, num_heads_q: int, log: Optional[CommLog]) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Returns the output ``[t, H, d]`` (original head order) and each stage's lse ``[m, P*t]``."""
    t, d, p = st.x.shape[0], st.d, st.schedule.ulysses_size
    output = st.x.new_empty(t, num_heads_q, d)
    lses = []
    for s, stage in enumerate(st.schedule.stages):
        before = None if log is None else comm_stats()
        q = st.project(s, stage, OP_QKV)
        k, v = st.attention_kv(stage)
        out, lse = attend_runs(q, k, v, stage.runs[st.rank], st.member, st.topo, st.kernel, st.scale,
                               st.shared_remote_kv(stage))
        del q, k, v
        st.release(stage)
        counts = [len(heads) for heads in stage.query_heads]
        back = st.a2a([counts[st.rank]] * p, counts, OP_OUT, out.reshape(-1), st.recv)
        del out
        for heads, block in zip(stage.query_heads, st.blocks(back, counts)):  # each rank's heads are contiguous
            if heads:
                output[:, heads[0]:heads[-1] + 1] = block
        lses.append(lse)
        _log_stage(log, "forward", s, before)
    return output, lses


def _backward(st: _Stages, output: torch.Tensor, grad: torch.Tensor, lses: List[torch.Tensor],
              dweight: Optional[torch.Tensor], need_bias: bool, log: Optional[CommLog]
              ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """grad/output ``[t, H, d]``; adds the weight gradient into ``dweight`` (``[rows, hidden]``, e.g. Megatron's
    fp32 main_grad) when given; returns (dx ``[t, hidden]`` in x's dtype, dbias in the bias dtype or None).

    dx accumulates one GEMM per stage in x's dtype (fp32 accumulation inside each GEMM, one rounding of the
    running sum per stage; docs/upipe.md quotes the measured error against fp64).
    """
    t, d, p = st.x.shape[0], st.d, st.schedule.ulysses_size
    acc = st.dkv.dtype
    dx = torch.zeros_like(st.x)
    dbias = torch.zeros(st.bias.shape, dtype=acc, device=st.x.device) if need_bias else None
    for s, (stage, lse) in enumerate(zip(st.schedule.stages, lses)):
        before = None if log is None else comm_stats()
        q = st.project(s, stage, OP_QKV_BWD)
        m = q.shape[1]
        for j in stage.new_kv[st.rank]:
            st.dkv[st.slot[j]].zero_()
        counts = [len(heads) for heads in stage.query_heads]
        # The output and its gradient in two all-to-alls, each into its own contiguous half of ``pair``:
        # the kernels then read both without a copy (one all-to-all would interleave them per token).
        half = t * sum(counts) * d
        sends = (st.send[:half], st.send[half:2 * half])
        for heads, out_block, grad_block in zip(stage.query_heads, *(st.blocks(x, counts) for x in sends)):
            if heads:
                out_block.copy_(output[:, heads[0]:heads[-1] + 1])
                grad_block.copy_(grad[:, heads[0]:heads[-1] + 1])
        received = p * t * m * d
        out_m, dout_m = (st.a2a(counts, [m] * p, OP_OUT_BWD, send, st.pair[i * received:(i + 1) * received])
                         .view(p * t, m, d) for i, send in enumerate(sends))
        k, v = st.attention_kv(stage)
        done = stage.done_kv[st.rank]
        c = len(done)
        grads = st.send[:p * t * (m + 2 * c) * d].view(p * t, m + 2 * c, d)  # dq, then dk/dv of KV heads done here
        attn_kv = stage.attn_kv[st.rank]
        for (q0, q1, k0, _), dq, dk, dv in attend_runs_backward(dout_m, q, k, v, out_m, lse,
                                                                stage.runs[st.rank], st.member, st.topo,
                                                                st.kernel, st.scale, st.shared_remote_kv(stage)):
            grads[:, q0:q1].copy_(dq)
            for i in range(dk.shape[1]):
                st.dkv[st.slot[attn_kv[k0 + i]], 0] += dk[:, i]
                st.dkv[st.slot[attn_kv[k0 + i]], 1] += dv[:, i]
            del dq, dk, dv  # not alive into the next stage
        del out_m, dout_m, q, k, v
        for i, j in enumerate(done):
            grads[:, m + i].copy_(st.dkv[st.slot[j], 0])
            grads[:, m + c + i].copy_(st.dkv[st.slot[j], 1])
        st.release(stage)
        widths = [len(heads) + 2 * len(kv) for heads, kv in zip(stage.query_heads, stage.done_kv)]
        back = st.a2a([m + 2 * c] * p, widths, OP_DQKV_BWD, st.send, st.recv)
        g = st.send[:back.numel()].view(t, -1, d)  # token-major: the gradient of this stage's projection
        at = 0
        for block, w, heads, kv in zip(st.blocks(back, widths), widths, stage.query_heads, stage.done_kv):
            g[:, at:at + w].copy_(block)
            if st.rope is not None:
                st.rope.transpose_(g[:, at:at + len(heads) + len(kv)].unsqueeze(1))
            at += w
        g = g.view(t, -1)
        runs = st.plan.grad_runs[s]
        dx.addmm_(g, st.gather_rows(runs))
        if dweight is not None:
            dw = st.dw[:g.shape[1] * st.x.shape[1]].view(g.shape[1], st.x.shape[1])
            torch.mm(g.t(), st.x, out=dw)
            for at, row, n in runs:  # KV units returned by two ranks appear twice and sum here
                dweight[row:row + n] += dw[at:at + n]
        if dbias is not None:
            part = g.sum(0, dtype=acc)
            for at, row, n in runs:
                dbias[row:row + n] += part[at:at + n]
        _log_stage(log, "backward", s, before)
    return dx, None if dbias is None else dbias.to(st.bias.dtype)


def _main_grad_target(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """Megatron's fp32 ``main_grad`` buffer of ``weight`` when it has one (set by its DDP wrapper), else None."""
    main_grad = getattr(weight, "main_grad", None)
    return main_grad if isinstance(main_grad, torch.Tensor) and main_grad.shape == weight.shape else None


def _gather_sequence_shards(local: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Megatron's sequence-parallel all-gather: ``[s/n, 1, hidden]`` on each of the n ranks of ``group`` ->
    ``[s, 1, hidden]`` in rank order (``local`` itself without a group)."""
    if group is None:
        return local
    full = local.new_empty(local.shape[0] * dist.get_world_size(group), *local.shape[1:])
    dist.all_gather_into_tensor(full, local.contiguous(), group=group)
    return full


class _HeadChunkedAttention(torch.autograd.Function):
    """Autograd wrapper: saves hidden, weight, bias, the output and the per-stage lse; recomputes the rest.

    With a sequence-parallel group, ``hidden`` is this TP rank's shard: it is all-gathered for the
    forward, only the shard is saved, and the backward gathers it again and reduce-scatters dx, as
    Megatron's ``ColumnParallelLinear`` does (TP times less saved than the gathered input).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], plan: BatchPlan,
                schedule: HeadSchedule, head_dim: int, angles: Optional[torch.Tensor], interleaved: bool,
                causal: bool, scale: float, sp_group: Optional[dist.ProcessGroup],
                log: Optional[CommLog], window: Window) -> torch.Tensor:
        full = _gather_sequence_shards(hidden, sp_group)
        rope = None if angles is None else _Rope(angles, hidden.dtype, interleaved)
        st = _Stages(full[:, 0], weight, bias, plan, schedule, head_dim, rope, causal, scale, backward=False,
                     window=window)
        del full
        output, lses = _forward(st, schedule.num_heads_q, log)
        del st
        ctx.save_for_backward(hidden, weight, bias, output)
        ctx.lses = lses
        ctx.args = (plan, schedule, head_dim, angles, interleaved, causal, scale, sp_group, log, window)
        return output.view(output.shape[0], 1, -1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """Weight gradient: added into ``weight.main_grad`` when Megatron's DDP gave the weight one, with
        Megatron's gradient-accumulation-fusion contract (``grad_added_to_main_grad`` set, a dummy gradient
        returned so DDP's hook does not add it again; None without that attribute); else returned."""
        hidden, weight, bias, output = ctx.saved_tensors
        plan, schedule, head_dim, angles, interleaved, causal, scale, sp_group, log, window = ctx.args
        rope = None if angles is None else _Rope(angles, hidden.dtype, interleaved)
        full = _gather_sequence_shards(hidden, sp_group)
        st = _Stages(full[:, 0], weight, bias, plan, schedule, head_dim, rope, causal, scale, backward=True,
                     window=window)
        del full
        grad = grad.reshape(output.shape).to(output.dtype)
        main_grad = _main_grad_target(weight) if ctx.needs_input_grad[1] else None
        target = main_grad
        if ctx.needs_input_grad[1] and main_grad is None:
            target = torch.zeros_like(weight)
        dx, dbias = _backward(st, output, grad, ctx.lses, target, bias is not None and ctx.needs_input_grad[2], log)
        ctx.lses = None
        dweight = target
        if main_grad is not None:
            dweight = None
            if hasattr(weight, "grad_added_to_main_grad"):
                weight.grad_added_to_main_grad = True
                dweight = (torch.zeros_like if getattr(weight, "zero_out_wgrad", False) else torch.empty_like)(weight)
        if sp_group is not None:
            dx_full, dx = dx, dx.new_empty(hidden.shape[0], dx.shape[1])
            dist.reduce_scatter_tensor(dx, dx_full, group=sp_group)
            del dx_full
        return dx.unsqueeze(1), dweight, dbias, None, None, None, None, None, None, None, None, None, None


def _check_tensor(name: str, t: object, layout: str, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != dims:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a tensor of layout {layout}, got {got}")
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name}.dtype={t.dtype} is not supported; allowed: {', '.join(map(str, _DTYPES))}")
    return t


def _check_inputs(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], plan: BatchPlan,
                  schedule: HeadSchedule, head_dim: int, rotary_freqs: Optional[torch.Tensor],
                  sp_size: int) -> None:
    topo = plan.topology
    if topo.is_offline:
        raise ValueError("plan was built on an offline CPTopology; attention needs get_cp_topology()")
    _check_tensor("hidden", hidden, "[s_local, b, hidden]", 3)
    _check_tensor("qkv_weight", weight, "[(G + 2) * H_kv * d, hidden]", 2)
    shard, b, size = hidden.shape
    s = shard * sp_size
    if b != 1:
        raise ValueError(f"hidden has batch size b={b}; head_chunked_attention takes one packed stream, b=1 "
                         "(pack the micro-batch's sequences into one stream with plan_batch)")
    if s != plan.tokens_per_rank:
        per = f" x sequence-parallel size {sp_size}" if sp_size > 1 else ""
        raise ValueError(f"hidden.shape[0]={shard}{per} must equal plan.tokens_per_rank={plan.tokens_per_rank}")
    g, h_kv = schedule.group_size, schedule.num_heads_kv
    rows = (g + 2) * h_kv * head_dim
    if tuple(weight.shape) != (rows, size):
        raise ValueError(f"qkv_weight.shape={tuple(weight.shape)} must be [(G + 2) * H_kv * d, hidden] = "
                         f"[{rows}, {size}] for num_heads_q={schedule.num_heads_q}, num_heads_kv={h_kv}, "
                         f"head_dim={head_dim}")
    if bias is not None:
        _check_tensor("qkv_bias", bias, f"[{rows}]", 1)
        if bias.shape[0] != rows:
            raise ValueError(f"qkv_bias.shape={tuple(bias.shape)} must be [{rows}]")
    for name, t in (("qkv_weight", weight), ("qkv_bias", bias)):
        if t is not None and (t.dtype != hidden.dtype or t.device != hidden.device):
            raise ValueError(f"{name} ({t.dtype}, {t.device}) must match hidden ({hidden.dtype}, {hidden.device})")
    if rotary_freqs is not None:
        if not isinstance(rotary_freqs, torch.Tensor) or rotary_freqs.shape[0] != s or \
                rotary_freqs.numel() != s * rotary_freqs.shape[-1]:
            raise ValueError("rotary_freqs must be per-token angles [s_local, d_rot] (or [s_local, 1, 1, d_rot]), got "
                             f"{tuple(rotary_freqs.shape) if isinstance(rotary_freqs, torch.Tensor) else rotary_freqs}")
        d_rot = rotary_freqs.shape[-1]
        if d_rot % 2 != 0 or d_rot > head_dim:
            raise ValueError(f"rotary_freqs last dim {d_rot} must be even and <= head_dim={head_dim}")
    check_device_matches_backend("hidden", hidden, topo)


def head_chunked_attention(hidden: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: Optional[torch.Tensor],
                           plan: BatchPlan, *, num_heads_q: int, num_heads_kv: int, head_dim: int,
                           rotary_freqs: Optional[torch.Tensor] = None, rope_base: Optional[float] = 10000.0,
                           causal: bool = True, softmax_scale: Optional[float] = None,
                           head_chunk_size: Optional[int] = None, comm_log: Optional[CommLog] = None,
                           rotary_interleaved: bool = False,
                           sequence_parallel_group: Optional[dist.ProcessGroup] = None,
                           window_size: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """QKV projection + rotary embeddings + context-parallel attention, U query heads at a time.

    hidden ``[s_local, 1, hidden]``: this rank's tokens of the packed stream as laid out by
    ``plan`` (s_local = plan.tokens_per_rank), the input of Megatron's SelfAttention. With
    ``sequence_parallel_group`` (Megatron's TP group under sequence parallelism, n ranks) hidden
    is this TP rank's shard ``[s_local / n, 1, hidden]`` (rows rank * s_local / n onwards); it is
    all-gathered inside, only the shard is kept for the backward, the input gradient comes back
    reduce-scattered, and the output still covers all s_local tokens (ColumnParallelLinear's contract).
    qkv_weight ``[(G + 2) * H_kv * d, hidden]`` / qkv_bias ``[(G + 2) * H_kv * d]`` or None:
    this TP rank's shard of Megatron's ``linear_qkv``, per KV group [G query heads, key, value].
    num_heads_q / num_heads_kv: heads of this TP rank. rotary_freqs: per-token RoPE angles
    ``[s_local, d_rot]`` in Megatron's layout (e.g. GPTModel's table indexed by
    ``plan.position_ids``); None = ``rope_angles(plan.position_ids, head_dim, rope_base)``;
    both None = no rotary embedding. rotary_interleaved: Megatron's ``rotary_interleaved`` RoPE
    (rotated pairs (2i, 2i+1), angles each repeated twice in a row) instead of rotate-half.
    Any head counts with num_heads_q a multiple of num_heads_kv
    (each Ulysses rank attends floor or ceil of num_heads_q / P of them, see ``head_split``).
    head_chunk_size U: query heads per stage (a multiple of the Ulysses size P below
    num_heads_q, or num_heads_q; each rank attends ceil(U / P) heads per stage, the last stage
    may hold fewer); None = the topology config's default (``hsap``: P; other modes: all heads,
    i.e. plain Ulysses). comm_log: a list that receives
    ``(direction, stage, CommStats)`` per stage. window_size: sliding window as in
    ``context_parallel_attention``. Returns ``[s_local, 1, H * d]`` in the original
    head order (the input of ``linear_proj``). Bad or mismatched input (e.g. one rank's dtype or
    head_chunk_size) raises the same ValueError on every CP rank before any collective.
    """
    if not isinstance(plan, BatchPlan):
        fail_with_peers(ValueError(f"plan must be a BatchPlan from plan_batch(...), got {type(plan).__name__}"))
    sp_group = sequence_parallel_group
    if sp_group is not None and dist.get_world_size(sp_group) == 1:
        sp_group = None
    error, window, schedule = None, None, None
    try:  # checked locally without raising, then agreed on across the CP ranks (attention/agreement.py)
        if not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"head_dim={head_dim!r} must be a positive int")
        window = normalize_window(window_size, bool(causal))
        schedule = resolve_head_schedule(plan, num_heads_q, num_heads_kv, head_chunk_size)
        _check_inputs(hidden, qkv_weight, qkv_bias, plan, schedule, head_dim, rotary_freqs,
                      1 if sp_group is None else dist.get_world_size(sp_group))
    except ValueError as err:
        error = err
    topo = plan.topology
    if topo.is_offline:
        fail_with_peers(error)
    fields = {"cu_seqlens": plan.doc_lengths, "layout": plan.layout, "topology": topo.signature(),
              "causal": bool(causal), "softmax_scale": softmax_scale, "window_size": window,
              "heads": (num_heads_q, num_heads_kv, head_dim),
              "rotary": (rotary_freqs is None, rope_base, bool(rotary_interleaved)),
              "sequence_parallel_size": 1 if sp_group is None else dist.get_world_size(sp_group)}
    if error is None:
        fields.update(head_schedule=repr(schedule), hidden_shape=tuple(hidden.shape[1:]), dtype=(str(hidden.dtype), str(qkv_weight.dtype)),
                      qkv_bias=qkv_bias is not None, tokens_per_rank=hidden.shape[0])
    agree_across_cp_ranks(topo, fields, error, hidden.device if error is None else None, plan.verified_signatures)
    if rotary_freqs is not None:
        angles = rotary_freqs.reshape(plan.tokens_per_rank, -1)
    elif rope_base is not None:
        angles = rope_angles(plan.position_ids_on(hidden.device), head_dim, rope_base, rotary_interleaved)
    else:
        angles = None
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    return _HeadChunkedAttention.apply(hidden, qkv_weight, qkv_bias, plan, schedule, head_dim, angles,
                                       bool(rotary_interleaved), bool(causal), scale, sp_group, comm_log, window)
