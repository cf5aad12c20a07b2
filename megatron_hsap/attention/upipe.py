"""UPipe: head-chunked context-parallel attention fused with the QKV projection (REFERENCE.md 1.1).

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
back once, in the stage of its last use; replicated KV heads (H_kv < P) sum in the
weight gradient.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch

from megatron_hsap.attention.context_parallel import check_device_matches_backend
from megatron_hsap.attention.head_schedule import HeadSchedule, Stage, build_head_schedule
from megatron_hsap.attention.ring import ring_attention_backward, ring_attention_forward
from megatron_hsap.collectives import heads_to_sequence, sequence_to_heads
from megatron_hsap.instrumentation.comm import CommStats, comm_stats
from megatron_hsap.kernels import get_kernel
from megatron_hsap.sequence.plan import BatchPlan

__all__ = ["head_chunked_attention", "resolve_head_schedule", "predicted_stage_comm", "rope_angles"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Operation names in ``instrumentation.comm`` for UPipe's all-to-alls.
OP_QKV, OP_OUT = "upipe_qkv", "upipe_out"
OP_QKV_BWD, OP_OUT_BWD, OP_DQKV_BWD = "upipe_qkv_bwd", "upipe_out_bwd", "upipe_dqkv_bwd"

CommLog = List[Tuple[str, int, CommStats]]


def rope_angles(position_ids: torch.Tensor, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    """Megatron's non-interleaved RoPE angles ``[t, rotary_dim]`` (fp32) for int positions ``[t]``:
    inv_freq = base^(-2i/rotary_dim), angles = cat(pos * inv_freq, pos * inv_freq)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = torch.outer(position_ids.to(torch.float32), inv_freq)
    return torch.cat((angles, angles), dim=-1)


class _Rope:
    """Rotate-half RoPE on the first ``rotary_dim`` features of ``[t, ..., d]`` tensors, and its transpose."""

    def __init__(self, angles: torch.Tensor, dtype: torch.dtype) -> None:
        self.dim = angles.shape[-1]
        self.cos = angles.cos().to(dtype)[:, None, None, :]
        self.sin = angles.sin().to(dtype)[:, None, None, :]

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def apply_(self, x: torch.Tensor) -> None:
        """In place on ``x [t, P, h, d]``."""
        rot = x[..., :self.dim]
        rot.copy_(rot * self.cos + self._rotate_half(rot) * self.sin)

    def transpose_(self, grad: torch.Tensor) -> None:
        """In place: the gradient w.r.t. RoPE's input from the gradient w.r.t. its output."""
        rot = grad[..., :self.dim]
        g1, g2 = (rot * self.sin).chunk(2, dim=-1)
        rot.copy_(rot * self.cos + torch.cat((g2, -g1), dim=-1))


def resolve_head_schedule(plan: BatchPlan, num_heads_q: int, num_heads_kv: int,
                          head_chunk_size: Optional[int]) -> HeadSchedule:
    """The stage plan for this TP rank's heads; ``head_chunk_size`` None = the topology config's default."""
    topo = plan.topology
    if head_chunk_size is None:
        head_chunk_size = topo.config.resolve_head_chunk_size(num_heads_q, topo.ulysses_size)
    return build_head_schedule(num_heads_q, num_heads_kv, topo.ulysses_size, head_chunk_size)


def predicted_stage_comm(schedule: HeadSchedule, plan: BatchPlan, head_dim: int, dtype: torch.dtype,
                         causal: bool = True) -> List[Tuple[Dict[Tuple[str, str], int], Dict[Tuple[str, str], int]]]:
    """Bytes this CP rank sends in each stage: ``[(forward, backward)]``, each ``{(op, 'intra'|'inter'): bytes}``.

    All-to-alls: t_local x (heads per destination) x d per peer of the Ulysses group (forward:
    q + new k/v in, output back; backward: the same q/k/v again, output + its gradient, then
    dq + dk/dv of finished KV heads). Ring: the member schedule's rows x the stage's KV heads
    (k and v) per exchange, and the same rows of dk/dv back in the backward.
    """
    topo = plan.topology
    me, u = topo.cp_rank, topo.ulysses_rank
    elem = torch.empty((), dtype=dtype).element_size()
    t = plan.tokens_per_rank
    member = plan.member_schedule(causal)
    peers = [c for c in topo.ring_member_ranks(topo.ring_rank) if c != me]

    def where(peer: int) -> str:
        return "intra" if topo.same_node(me, peer) else "inter"

    out = []
    for stage in schedule.stages:
        fwd: Dict[Tuple[str, str], int] = defaultdict(int)
        bwd: Dict[Tuple[str, str], int] = defaultdict(int)
        m, n, c = len(stage.query_heads[0]), len(stage.new_kv[0]), len(stage.done_kv[0])
        for peer in peers:
            for table, op, heads in ((fwd, OP_QKV, m + 2 * n), (fwd, OP_OUT, m), (bwd, OP_QKV_BWD, m + 2 * n),
                                     (bwd, OP_OUT_BWD, 2 * m), (bwd, OP_DQKV_BWD, m + 2 * c)):
                table[(op, where(peer))] += t * heads * head_dim * elem
        row_bytes = 2 * len(stage.attn_kv[u]) * head_dim * elem
        for _, recv, send in member.steps():
            if send is not None:
                peer = send.dst_member * topo.ulysses_size + u
                fwd[("ring_kv", where(peer))] += send.rows.num_rows * row_bytes
                bwd[("ring_kv_bwd", where(peer))] += send.rows.num_rows * row_bytes
            if recv is not None:
                bwd[("ring_dkv", where(recv.src_member * topo.ulysses_size + u))] += recv.num_rows * row_bytes
        out.append(({k: v for k, v in fwd.items() if v}, {k: v for k, v in bwd.items() if v}))
    return out


class _Stages:
    """What forward and backward share: the per-stage projection + all-to-all, and KV retention."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], plan: BatchPlan,
                 schedule: HeadSchedule, head_dim: int, rope: Optional[_Rope], causal: bool, scale: float) -> None:
        self.x, self.weight, self.bias = x, weight, bias  # x [t_local, hidden]
        self.topo, self.schedule = plan.topology, schedule
        self.d, self.rope, self.scale = head_dim, rope, scale
        self.member = plan.member_schedule(causal)
        self.kernel = get_kernel(self.topo.config.kernel)
        self.rank = self.topo.ulysses_rank
        p, m = schedule.ulysses_size, schedule.heads_per_rank
        most_kv = max(len(s.new_kv[0]) for s in schedule.stages)
        # One projection buffer for every stage (its heads vary only in the number of new KV heads).
        self._proj = x.new_empty(p * (m + 2 * most_kv) * x.shape[0] * head_dim)

    def block(self, unit: int) -> slice:
        """Rows of one head unit in the fused QKV weight."""
        return slice(unit * self.d, (unit + 1) * self.d)

    def a2a_in(self, packed: torch.Tensor, op: str) -> torch.Tensor:
        """``[t, P, h, d]`` -> ``[P*t, h, d]`` (identity reshape without a Ulysses group)."""
        if self.topo.ulysses_size == 1:
            return packed.reshape(-1, *packed.shape[2:])
        return sequence_to_heads(packed, self.topo, op)

    def a2a_out(self, heads: torch.Tensor, op: str) -> torch.Tensor:
        """``[P*t, h, d]`` -> ``[t, P, h, d]``."""
        if self.topo.ulysses_size == 1:
            return heads.reshape(heads.shape[0], 1, *heads.shape[1:])
        return heads_to_sequence(heads.contiguous(), self.topo, op)

    def project(self, stage: Stage, op: str) -> Tuple[torch.Tensor, Dict[int, Tuple[torch.Tensor, torch.Tensor]]]:
        """This rank's stage queries ``[P*t, m, d]`` and its new KV heads {effective id: (k, v) ``[P*t, d]``}."""
        t, p = self.x.shape[0], self.schedule.ulysses_size
        m, n = len(stage.query_heads[0]), len(stage.new_kv[0])
        units = self.schedule.send_units(stage)
        # Unit-major buffer: each head's projection is one matmul straight from the weight rows, no weight copy.
        proj = self._proj[:len(units) * t * self.d].view(len(units), t, self.d)
        for i, unit in enumerate(units):
            torch.mm(self.x, self.weight[self.block(unit)].t(), out=proj[i])
            if self.bias is not None:
                proj[i] += self.bias[self.block(unit)]
        packed = proj.view(p, m + 2 * n, t, self.d).permute(2, 0, 1, 3)  # [t, P, m + 2n, d]
        if self.rope is not None:
            self.rope.apply_(packed[:, :, :m + n])
        member = self.a2a_in(packed, op)
        q = member[:, :m].contiguous()
        new = stage.new_kv[self.rank]
        kv = {j: (member[:, m + i].clone(), member[:, m + n + i].clone()) for i, j in enumerate(new)}
        return q, kv

    def attention_kv(self, stage: Stage, live: Dict[int, Tuple[torch.Tensor, torch.Tensor]]
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
        """k, v ``[P*t, h_kv', d]`` for the stage's attention call, from the KV heads held on this rank."""
        ids = stage.attn_kv[self.rank]
        return (torch.stack([live[j][0] for j in ids], dim=1), torch.stack([live[j][1] for j in ids], dim=1))

    def query_index(self, stage: Stage) -> torch.Tensor:
        """Original query heads of a stage in all-to-all order (destination rank major)."""
        return torch.tensor([q for heads in stage.query_heads for q in heads], dtype=torch.long,
                            device=self.x.device)


def _log_stage(log: Optional[CommLog], direction: str, index: int, before: Optional[CommStats]) -> None:
    if log is not None:
        log.append((direction, index, comm_stats().minus(before)))


def _forward(st: _Stages, num_heads_q: int, log: Optional[CommLog]) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Returns the output ``[t, H, d]`` (original head order) and each stage's lse ``[m, P*t]``."""
    t, d = st.x.shape[0], st.d
    output = st.x.new_empty(t, num_heads_q, d)
    lses = []
    live: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # KV heads held on this rank: id -> (k, v) [P*t, d]
    for s, stage in enumerate(st.schedule.stages):
        before = None if log is None else comm_stats()
        q, new = st.project(stage, OP_QKV)
        live.update(new)
        k, v = st.attention_kv(stage, live)
        out, lse = ring_attention_forward(q, k, v, st.member, st.topo, st.kernel, st.scale)
        del q, k, v
        for j in stage.done_kv[st.rank]:
            del live[j]
        back = st.a2a_out(out, OP_OUT)  # [t, P, m, d]
        output.index_copy_(1, st.query_index(stage), back.reshape(t, -1, d))
        lses.append(lse)
        _log_stage(log, "forward", s, before)
    return output, lses


def _backward(st: _Stages, output: torch.Tensor, grad: torch.Tensor, lses: List[torch.Tensor], need_weight: bool,
              need_bias: bool, log: Optional[CommLog]
              ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """grad/output ``[t, H, d]``; returns (dx ``[t, hidden]``, dweight, dbias) in the inputs' dtypes."""
    acc = torch.float64 if st.x.dtype == torch.float64 else torch.float32
    t, d = st.x.shape[0], st.d
    x = st.x.to(acc)
    dx = torch.zeros(st.x.shape, dtype=acc, device=st.x.device)
    dweight = torch.zeros(st.weight.shape, dtype=acc, device=st.x.device) if need_weight else None
    dbias = torch.zeros(st.bias.shape, dtype=acc, device=st.x.device) if need_bias else None
    live: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
    dkv: Dict[int, torch.Tensor] = {}  # effective KV id -> [P*t, 2, d] gradient summed over the stages using it
    for s, (stage, lse) in enumerate(zip(st.schedule.stages, lses)):
        before = None if log is None else comm_stats()
        q, new = st.project(stage, OP_QKV_BWD)
        live.update(new)
        for j, (k_j, _) in new.items():
            dkv[j] = torch.zeros((k_j.shape[0], 2, d), dtype=acc, device=k_j.device)
        index = st.query_index(stage)
        m = q.shape[1]
        pair = torch.cat((output.index_select(1, index).view(t, -1, m, d),
                          grad.index_select(1, index).view(t, -1, m, d)), dim=2)
        pair = st.a2a_in(pair, OP_OUT_BWD)  # [P*t, 2m, d]: stage output, then its gradient
        k, v = st.attention_kv(stage, live)
        dq, dk, dv = ring_attention_backward(pair[:, m:], q, k, v, pair[:, :m].contiguous(), lse, st.member,
                                             st.topo, st.kernel, st.scale)
        del pair, q, k, v
        for i, j in enumerate(stage.attn_kv[st.rank]):
            dkv[j][:, 0] += dk[:, i]
            dkv[j][:, 1] += dv[:, i]
        done = stage.done_kv[st.rank]
        grads = torch.cat([dq] + [dkv[j][:, 0:1].to(dq.dtype) for j in done]
                          + [dkv[j][:, 1:2].to(dq.dtype) for j in done], dim=1)
        del dq, dk, dv
        for j in done:
            del live[j], dkv[j]
        back = st.a2a_out(grads, OP_DQKV_BWD)  # [t, P, m + 2c, d]: gradients of this rank's projections
        del grads
        if st.rope is not None:
            st.rope.transpose_(back[:, :, :m + len(done)])
        width = back.shape[2]
        for i, unit in enumerate(st.schedule.grad_units(stage)):
            g = back[:, i // width, i % width].to(acc)  # [t, d]: gradient of one head unit's projection
            rows = st.block(unit)
            dx.addmm_(g, st.weight[rows].to(acc))
            if dweight is not None:
                dweight[rows].addmm_(g.t(), x)  # replicated KV units appear twice and sum here
            if dbias is not None:
                dbias[rows] += g.sum(0)
        del back
        _log_stage(log, "backward", s, before)
    return (dx.to(st.x.dtype), None if dweight is None else dweight.to(st.weight.dtype),
            None if dbias is None else dbias.to(st.bias.dtype))


class _HeadChunkedAttention(torch.autograd.Function):
    """Autograd wrapper: saves hidden, weight, bias, the output and the per-stage lse; recomputes the rest."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], plan: BatchPlan,
                schedule: HeadSchedule, head_dim: int, angles: Optional[torch.Tensor], causal: bool, scale: float,
                log: Optional[CommLog]) -> torch.Tensor:
        rope = None if angles is None else _Rope(angles, hidden.dtype)
        st = _Stages(hidden[:, 0], weight, bias, plan, schedule, head_dim, rope, causal, scale)
        output, lses = _forward(st, schedule.num_heads_q, log)
        ctx.save_for_backward(hidden, weight, bias, output)
        ctx.lses = lses
        ctx.args = (plan, schedule, head_dim, angles, causal, scale, log)
        return output.view(hidden.shape[0], 1, -1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, bias, output = ctx.saved_tensors
        plan, schedule, head_dim, angles, causal, scale, log = ctx.args
        rope = None if angles is None else _Rope(angles, hidden.dtype)
        st = _Stages(hidden[:, 0], weight, bias, plan, schedule, head_dim, rope, causal, scale)
        grad = grad.reshape(output.shape).to(output.dtype)
        dx, dweight, dbias = _backward(st, output, grad, ctx.lses, ctx.needs_input_grad[1],
                                       bias is not None and ctx.needs_input_grad[2], log)
        ctx.lses = None
        return dx.unsqueeze(1), dweight, dbias, None, None, None, None, None, None, None


def _check_tensor(name: str, t: object, layout: str, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != dims:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a tensor of layout {layout}, got {got}")
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name}.dtype={t.dtype} is not supported; allowed: {', '.join(map(str, _DTYPES))}")
    return t


def _check_inputs(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], plan: BatchPlan,
                  schedule: HeadSchedule, head_dim: int, rotary_freqs: Optional[torch.Tensor]) -> None:
    topo = plan.topology
    if topo.is_offline:
        raise ValueError("plan was built on an offline CPTopology; attention needs get_cp_topology()")
    _check_tensor("hidden", hidden, "[s_local, b, hidden]", 3)
    _check_tensor("qkv_weight", weight, "[(G + 2) * H_kv * d, hidden]", 2)
    s, b, size = hidden.shape
    if b != 1:
        raise ValueError(f"hidden has batch size b={b}; head_chunked_attention takes one packed stream, b=1 "
                         "(pack the micro-batch's sequences into one stream with plan_batch)")
    if s != plan.tokens_per_rank:
        raise ValueError(f"hidden.shape[0]={s} must equal plan.tokens_per_rank={plan.tokens_per_rank}")
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
                           head_chunk_size: Optional[int] = None, comm_log: Optional[CommLog] = None) -> torch.Tensor:
    """QKV projection + rotary embeddings + context-parallel attention, U query heads at a time.

    hidden ``[s_local, 1, hidden]``: this rank's tokens of the packed stream as laid out by
    ``plan`` (s_local = plan.tokens_per_rank), the input of Megatron's SelfAttention.
    qkv_weight ``[(G + 2) * H_kv * d, hidden]`` / qkv_bias ``[(G + 2) * H_kv * d]`` or None:
    this TP rank's shard of Megatron's ``linear_qkv``, per KV group [G query heads, key, value].
    num_heads_q / num_heads_kv: heads of this TP rank. rotary_freqs: per-token RoPE angles
    ``[s_local, d_rot]`` in Megatron's non-interleaved layout (e.g. GPTModel's table indexed by
    ``plan.position_ids``); None = ``rope_angles(plan.position_ids, head_dim, rope_base)``;
    both None = no rotary embedding. head_chunk_size U: query heads per stage (multiple of the
    Ulysses size, dividing num_heads_q); None = the topology config's default (``hsap``: the
    Ulysses size; other modes: all heads, i.e. plain Ulysses). comm_log: a list that receives
    ``(direction, stage, CommStats)`` per stage. Returns ``[s_local, 1, H * d]`` in the original
    head order (the input of ``linear_proj``). Everything is validated before any collective.
    """
    if not isinstance(plan, BatchPlan):
        raise ValueError(f"plan must be a BatchPlan from plan_batch(...), got {type(plan).__name__}")
    if not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim={head_dim!r} must be a positive int")
    schedule = resolve_head_schedule(plan, num_heads_q, num_heads_kv, head_chunk_size)
    _check_inputs(hidden, qkv_weight, qkv_bias, plan, schedule, head_dim, rotary_freqs)
    if rotary_freqs is not None:
        angles = rotary_freqs.reshape(hidden.shape[0], -1)
    elif rope_base is not None:
        angles = rope_angles(plan.position_ids, head_dim, rope_base).to(hidden.device)
    else:
        angles = None
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    return _HeadChunkedAttention.apply(hidden, qkv_weight, qkv_bias, plan, schedule, head_dim, angles, bool(causal),
                                       scale, comm_log)
