"""Which heads each UPipe stage projects, sends and attends (UPipe, arXiv 2602.21196).

Pure bookkeeping, no tensors: ``HeadSchedule`` maps H query heads and H_kv KV heads
(both per TP rank) onto stages of about U query heads over a Ulysses group of P ranks.

Ulysses rank r attends the contiguous query-head range of ``head_split.split_heads``
(floor or ceil of H/P heads, any H, H_kv and P) and walks through it in order,
ceil(U/P) heads per stage, so the last stage may hold fewer heads (or none on some
ranks). Query head q uses KV head q // G (G = H/H_kv). A rank receives a KV head once,
in the first stage one of its query heads uses it, keeps it while later stages use it,
and sends its gradient back once, in the stage of its last use: each KV head crosses
the all-to-all once per layer towards each rank that needs it (twice only when its G
query heads straddle two ranks' ranges, which the split minimises). With U = P and G
dividing H/P this is the UPipe paper's GQA schedule: stage 0 sends one KV head per rank,
the next G-1 stages reuse it.

Fused QKV weight rows (Megatron's ``linear_qkv``, per TP rank) come in "units" of
head_dim rows: KV group g holds units [g*(G+2), ..., g*(G+2)+G-1] for its G query
heads, then one key unit and one value unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from megatron_hsap.head_split import Run, check_head_chunk_size, gqa_runs, split_heads

__all__ = ["HeadSchedule", "Stage", "build_head_schedule", "attention_activation_bytes"]

Heads = Tuple[Tuple[int, ...], ...]  # indexed [ulysses_rank][slot]


@dataclass(frozen=True)
class Stage:
    """One stage; every field is indexed by Ulysses rank (the rank that attends those heads).

    query_heads: original query-head indices (ceil(U/P) or fewer, contiguous ascending) the rank attends.
    new_kv: KV heads first used by the rank in this stage (sent in this stage's all-to-all).
    done_kv: KV heads last used by the rank in this stage (their gradient goes back in this stage).
    attn_kv: the distinct KV heads of the stage's query heads, in order (handed to attention).
    runs: ``gqa_runs`` of the stage's query heads over ``attn_kv`` (one attention call each).
    """

    query_heads: Heads
    new_kv: Heads
    done_kv: Heads
    attn_kv: Heads
    runs: Tuple[Tuple[Run, ...], ...]


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
        """G: query heads per KV head."""
        return self.num_heads_q // self.num_heads_kv

    def query_kv(self, query_head: int) -> int:
        """KV head that ``query_head`` attends with."""
        return query_head // self.group_size

    # ---- rows of the fused QKV weight, in units of head_dim rows ----------------------------
    def query_unit(self, query_head: int) -> int:
        g = self.group_size
        return (query_head // g) * (g + 2) + query_head % g

    def key_unit(self, kv_head: int) -> int:
        g = self.group_size
        return kv_head * (g + 2) + g

    def value_unit(self, kv_head: int) -> int:
        return self.key_unit(kv_head) + 1

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
        """KV heads the Ulysses group receives per layer forward, over all ranks (each once per rank using it)."""
        return sum(len(kv) for stage in self.stages for kv in stage.new_kv)

    @property
    def kv_heads_sent_every_stage(self) -> int:
        """What re-sending every stage's KV heads (no reuse across stages) would cost, over all ranks."""
        return sum(len(kv) for stage in self.stages for kv in stage.attn_kv)


def build_head_schedule(num_heads_q: int, num_heads_kv: int, ulysses_size: int, head_chunk_size: int) -> HeadSchedule:
    """The stage plan for H = num_heads_q, H_kv = num_heads_kv (per TP rank), P = ulysses_size, U = head_chunk_size.

    Raises ValueError (naming the argument and the allowed values) unless the head counts are valid for
    ``head_split.split_heads`` and U for ``head_split.check_head_chunk_size``.
    """
    split = split_heads(num_heads_q, num_heads_kv, ulysses_size)
    h, p = num_heads_q, ulysses_size
    u = check_head_chunk_size(head_chunk_size, h, p)
    g = split.group_size
    m = -(-u // p)
    walks = [list(split.query_range(r)) for r in range(p)]
    first_use, last_use = [], []
    for walk in walks:
        first, last = {}, {}
        for pos, q in enumerate(walk):
            first.setdefault(q // g, pos // m)
            last[q // g] = pos // m
        first_use.append(first)
        last_use.append(last)
    stages = []
    for s in range(-(-max(len(w) for w in walks) // m)):
        query = tuple(tuple(walk[s * m:(s + 1) * m]) for walk in walks)
        used = [[q // g for q in heads] for heads in query]
        attn = tuple(tuple(dict.fromkeys(js)) for js in used)
        new = tuple(tuple(j for j in js if first_use[r][j] == s) for r, js in enumerate(attn))
        done = tuple(tuple(j for j in js if last_use[r][j] == s) for r, js in enumerate(attn))
        stages.append(Stage(query, new, done, attn, tuple(gqa_runs(js) for js in used)))
    return HeadSchedule(h, num_heads_kv, p, u, tuple(stages))


def attention_activation_bytes(tokens_per_rank: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
                               ulysses_size: int, head_chunk_size: int, element_size: int) -> int:
    """The UPipe paper's accounting of one layer's attention intermediates per rank, for U heads per stage.

    Q, K, V of the stage's heads for this rank's tokens, plus their all-to-all outputs
    (the same bytes again): 2 * t_local * (U + 2 * kv_U) * d * element_size, where kv_U is the
    number of KV heads the stage's U query heads use over the Ulysses group (the largest stage's).
    With U = H and H_kv = H this is the paper's 12 * (S/C) * H * d bytes in bf16.
    """
    schedule = build_head_schedule(num_heads_q, num_heads_kv, ulysses_size, head_chunk_size)
    largest = max(schedule.stages, key=lambda s: sum(map(len, s.query_heads)) + 2 * sum(map(len, s.attn_kv)))
    heads = sum(map(len, largest.query_heads)) + 2 * sum(map(len, largest.attn_kv))
    return 2 * tokens_per_rank * heads * head_dim * element_size
