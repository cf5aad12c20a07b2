"""Which heads each UPipe stage projects, sends and attends (REFERENCE.md section 1.1).

Pure bookkeeping, no tensors: ``HeadSchedule`` maps H query heads and H_kv KV heads
(both per TP rank) onto H/U stages of U query heads over a Ulysses group of P ranks.

KV heads are first made "effective": when H_kv < P every KV head is replicated
P/H_kv times (replicas adjacent, as ``repeat_interleave``), so there are
K' = max(H_kv, P) effective KV heads, each serving G' = H/K' query heads
(query head q uses effective KV head q // G'). Ulysses rank r owns effective KV
heads r, r + P, r + 2P, ... and walks through their query heads in order, U/P
per stage. With U = P this is kv = (s // G') * P + r, q = kv * G' + s % G'.
A KV head crosses the all-to-all once, in the first stage one of its query heads
runs, stays on the receiving rank while later stages use it, and its gradient
goes back once, in the stage of its last use.

Fused QKV weight rows (Megatron's ``linear_qkv``, per TP rank) come in "units" of
head_dim rows: KV group g holds units [g*(G+2), ..., g*(G+2)+G-1] for its G query
heads, then one key unit and one value unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

__all__ = ["HeadSchedule", "Stage", "build_head_schedule", "attention_activation_bytes"]

Heads = Tuple[Tuple[int, ...], ...]  # indexed [ulysses_rank][slot]


@dataclass(frozen=True)
class Stage:
    """One stage; every field is indexed by Ulysses rank (the rank that attends those heads).

    query_heads: original query-head indices (U/P per rank) in the order the rank attends them.
    new_kv: effective KV heads first used in this stage (sent in this stage's all-to-all).
    done_kv: effective KV heads last used in this stage (their gradient goes back in this stage).
    attn_kv: effective KV heads handed to attention, in order: the distinct ones when every one
      serves the same number of adjacent query heads (GQA call), else one per query head.
    """

    query_heads: Heads
    new_kv: Heads
    done_kv: Heads
    attn_kv: Heads


@dataclass(frozen=True)
class HeadSchedule:
    """Stages of head-chunked Ulysses for one TP rank's heads (build with ``build_head_schedule``)."""

    num_heads_q: int
    num_heads_kv: int
    ulysses_size: int
    head_chunk_size: int
    stages: Tuple[Stage, ...]

    @property
    def group_size(self) -> int:
        """G: query heads per original KV head."""
        return self.num_heads_q // self.num_heads_kv

    @property
    def kv_replicas(self) -> int:
        """Copies of each KV head on the Ulysses group (1 unless H_kv < P)."""
        return max(1, self.ulysses_size // self.num_heads_kv)

    @property
    def effective_kv_heads(self) -> int:
        return self.num_heads_kv * self.kv_replicas

    @property
    def heads_per_rank(self) -> int:
        """U/P: query heads each Ulysses rank attends per stage."""
        return self.head_chunk_size // self.ulysses_size

    def kv_head(self, effective: int) -> int:
        """Original KV head of an effective (possibly replicated) KV head."""
        return effective // self.kv_replicas

    def query_kv(self, query_head: int) -> int:
        """Effective KV head that ``query_head`` attends with."""
        return query_head // (self.num_heads_q // self.effective_kv_heads)

    # ---- rows of the fused QKV weight, in units of head_dim rows ----------------------------
    def query_unit(self, query_head: int) -> int:
        g = self.group_size
        return (query_head // g) * (g + 2) + query_head % g

    def key_unit(self, effective: int) -> int:
        g = self.group_size
        return self.kv_head(effective) * (g + 2) + g

    def value_unit(self, effective: int) -> int:
        return self.key_unit(effective) + 1

    def send_units(self, stage: Stage) -> List[int]:
        """Weight units projected for a stage, in all-to-all order: per destination rank
        [its query heads, keys of its new KV heads, values of its new KV heads]."""
        return self._units(stage.query_heads, stage.new_kv)

    def grad_units(self, stage: Stage) -> List[int]:
        """Weight units of the gradients coming back in a stage (per source rank: dq, dk, dv of done KV)."""
        return self._units(stage.query_heads, stage.done_kv)

    def _units(self, query_heads: Heads, kv: Heads) -> List[int]:
        units: List[int] = []
        for r in range(self.ulysses_size):
            units += [self.query_unit(q) for q in query_heads[r]]
            units += [self.key_unit(j) for j in kv[r]]
            units += [self.value_unit(j) for j in kv[r]]
        return units

    # ---- communication volume in head slices -------------------------------------------------
    @property
    def kv_heads_sent(self) -> int:
        """KV heads each rank receives per layer forward (each crosses the all-to-all once)."""
        return sum(len(stage.new_kv[0]) for stage in self.stages)

    @property
    def kv_heads_sent_every_stage(self) -> int:
        """What re-sending every stage's KV heads (no reuse across stages) would cost per rank."""
        return sum(len(set(stage.attn_kv[0])) for stage in self.stages)


def _check_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return value


def build_head_schedule(num_heads_q: int, num_heads_kv: int, ulysses_size: int, head_chunk_size: int) -> HeadSchedule:
    """The stage plan for H = num_heads_q, H_kv = num_heads_kv (per TP rank), P = ulysses_size, U = head_chunk_size.

    Raises ValueError (naming the argument and the allowed values) unless H_kv divides H,
    P divides H, H_kv and P divide one another, U is a multiple of P and U divides H.
    """
    h, h_kv, p, u = (_check_int(n, v) for n, v in (("num_heads_q", num_heads_q), ("num_heads_kv", num_heads_kv),
                                                     ("ulysses_size", ulysses_size),
                                                     ("head_chunk_size", head_chunk_size)))
    if h % h_kv != 0:
        raise ValueError(f"num_heads_kv={h_kv} must divide num_heads_q={h}; allowed num_heads_kv: "
                         f"{[k for k in range(1, h + 1) if h % k == 0]}")
    if h % p != 0:
        raise ValueError(f"num_heads_q={h} (per TP rank) must be divisible by ulysses_size={p}")
    if h_kv % p != 0 and p % h_kv != 0:
        raise ValueError(f"num_heads_kv={h_kv} (per TP rank) must be a multiple of ulysses_size={p} or divide it "
                         "(KV heads are then replicated)")
    allowed = [c for c in range(p, h + 1, p) if h % c == 0]
    if u % p != 0:
        raise ValueError(f"head_chunk_size={u} must be a multiple of ulysses_size={p}; allowed values: {allowed}")
    if h % u != 0:
        raise ValueError(f"head_chunk_size={u} must divide num_heads_q={h} (per TP rank); allowed values: {allowed}")

    k_eff = max(h_kv, p)
    g_eff = h // k_eff
    m = u // p
    # Rank r's walk: its effective KV heads r, r+P, ..., each followed by its G' query heads.
    walks = [[(j, j * g_eff + i) for j in range(r, k_eff, p) for i in range(g_eff)] for r in range(p)]
    first_use = {}
    last_use = {}
    for walk in walks:
        for pos, (j, _) in enumerate(walk):
            first_use.setdefault(j, pos // m)
            last_use[j] = pos // m
    stages = []
    for s in range(h // u):
        chunk = [walk[s * m:(s + 1) * m] for walk in walks]
        query = tuple(tuple(q for _, q in c) for c in chunk)
        used = [[j for j, _ in c] for c in chunk]
        new = tuple(tuple(dict.fromkeys(j for j in js if first_use[j] == s)) for js in used)
        done = tuple(tuple(dict.fromkeys(j for j in js if last_use[j] == s)) for js in used)
        attn = []
        for js in used:
            distinct = list(dict.fromkeys(js))
            per = len(js) // len(distinct)
            grouped = len(js) % len(distinct) == 0 and js == [j for j in distinct for _ in range(per)]
            attn.append(tuple(distinct if grouped else js))
        stages.append(Stage(query, new, done, tuple(attn)))
    return HeadSchedule(h, h_kv, p, u, tuple(stages))


def attention_activation_bytes(tokens_per_rank: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
                               ulysses_size: int, head_chunk_size: int, element_size: int) -> int:
    """REFERENCE.md 1.1's accounting of one layer's attention intermediates per rank, for U heads per stage.

    Q, K, V of the stage's heads for this rank's tokens, plus their all-to-all outputs
    (the same bytes again): 2 * t_local * (U + 2 * kv_U) * d * element_size, where kv_U is the
    number of (replicated) KV heads the stage's U query heads use. With U = H and H_kv = H
    this is the paper's 12 * (S/C) * H * d bytes in bf16.
    """
    k_eff = max(num_heads_kv, ulysses_size)
    kv_per_stage = max(ulysses_size, head_chunk_size * k_eff // num_heads_q)
    return 2 * tokens_per_rank * (head_chunk_size + 2 * kv_per_stage) * head_dim * element_size
