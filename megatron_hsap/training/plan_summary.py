"""What the batch plans did, next to what the zigzag layout would have done with the same samples.

The run's layout decides where each packed micro-batch's tokens live; its value shows in
attention balance, padding, documents cut across ring members, and the bytes attention
moves between and inside nodes. Plans are cheap, so for every micro-batch the summary
also plans the same ``cu_seqlens`` with ``layout="zigzag"`` (the default layout of ring
attention) and reports both: ``inter-node bytes 0.24 x zigzag``.

Figures are the plans' predictions (``BatchPlan.stats``) for one layer's attention forward
pass, summed over micro-batches and CP ranks; byte figures count the Ulysses all-to-alls
and the ring's key/value exchanges without node-level K/V forwarding. ``PlanSummary`` keeps
the run's totals and, separately, the totals since the last ``take_interval`` (for a
per-logging-interval figure).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, Optional

import torch

from megatron_hsap.sequence.plan import BatchPlan, plan_batch
from megatron_hsap.sequence.plan_cache import PlanCache

__all__ = ["PlanFigures", "PlanTotals", "PlanSummary", "plan_figures", "plan_cache_line"]

BASELINE_LAYOUT = "zigzag"


@dataclass
class PlanFigures:
    """One layout's figures summed over micro-batches.

    ``busiest_attn_flops``: per micro-batch the largest rank's attention FLOPs, summed (what the step waits
    for); ``mean_attn_flops``: per micro-batch the mean over ranks, summed. ``documents_split``: non-empty
    documents whose tokens sit on more than one ring member (each needs key/value rows moved by the ring).
    """

    micro_batches: int = 0
    busiest_attn_flops: int = 0
    mean_attn_flops: float = 0.0
    padding_tokens: int = 0
    token_slots: int = 0
    documents: int = 0
    documents_split: int = 0
    bytes_inter: int = 0
    bytes_intra: int = 0

    def __iadd__(self, other: "PlanFigures") -> "PlanFigures":
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self

    @property
    def attention_imbalance(self) -> float:
        """Busiest rank's attention over the mean rank's, over the summed micro-batches (1.0: balanced)."""
        return self.busiest_attn_flops / self.mean_attn_flops if self.mean_attn_flops > 0 else 1.0

    @property
    def padding_fraction(self) -> float:
        return self.padding_tokens / self.token_slots if self.token_slots else 0.0

    @property
    def split_fraction(self) -> float:
        return self.documents_split / self.documents if self.documents else 0.0


def plan_figures(plan: BatchPlan, num_heads_q: int, num_heads_kv: int, head_dim: int, dtype: torch.dtype
                 ) -> PlanFigures:
    """One micro-batch's ``PlanFigures`` from its plan (heads of one tensor-parallel rank, ``dtype`` of q/k/v)."""
    stats = plan.stats(num_heads_q, num_heads_kv, head_dim, dtype)
    topology = plan.topology
    members: Dict[int, set] = {}
    for rank, segments in enumerate(plan.rank_segments):
        for doc, start, end in segments:
            if end > start:
                members.setdefault(doc, set()).add(rank // topology.ulysses_size)
    return PlanFigures(micro_batches=1, busiest_attn_flops=max(stats.attn_flops),
                       mean_attn_flops=sum(stats.attn_flops) / len(stats.attn_flops),
                       padding_tokens=sum(stats.padding_tokens), token_slots=plan.tokens_per_rank * topology.cp_size,
                       documents=len(members), documents_split=sum(len(m) > 1 for m in members.values()),
                       bytes_inter=sum(stats.send_bytes_inter), bytes_intra=sum(stats.send_bytes_intra))


@dataclass
class PlanTotals:
    """The run's layout (``planned``) and zigzag on the same micro-batches (``zigzag``)."""

    layout: str
    planned: PlanFigures = field(default_factory=PlanFigures)
    zigzag: PlanFigures = field(default_factory=PlanFigures)

    def add(self, planned: PlanFigures, zigzag: PlanFigures) -> None:
        self.planned += planned
        self.zigzag += zigzag

    def line(self) -> str:
        """One log line: each figure for the run's layout, then zigzag's (bytes as a ratio)."""
        p, z = self.planned, self.zigzag

        def ratio(a: int, b: int) -> str:
            return f"{a / b:.2f} x zigzag" if b else "- x zigzag"

        return (f"plan over {p.micro_batches} micro-batches, {self.layout} vs zigzag on the same samples (one layer's "
                f"attention forward, all CP ranks): attention imbalance {p.attention_imbalance:.3f} vs "
                f"{z.attention_imbalance:.3f} | padding {100 * p.padding_fraction:.1f}% vs "
                f"{100 * z.padding_fraction:.1f}% | documents split {p.documents_split}/{p.documents} vs "
                f"{z.documents_split}/{z.documents} | inter-node bytes {ratio(p.bytes_inter, z.bytes_inter)} "
                f"({p.bytes_inter / 1e6:.2f} MB vs {z.bytes_inter / 1e6:.2f} MB) | intra-node bytes "
                f"{ratio(p.bytes_intra, z.bytes_intra)} ({p.bytes_intra / 1e6:.2f} MB vs "
                f"{z.bytes_intra / 1e6:.2f} MB)")

    def as_dict(self) -> Dict[str, object]:
        """JSON form: both layouts' sums and derived fractions, and the byte ratios (None when zigzag moves none)."""
        out: Dict[str, object] = {"layout": self.layout}
        for name, figures in (("planned", self.planned), ("zigzag", self.zigzag)):
            out[name] = dict(asdict(figures), attention_imbalance=figures.attention_imbalance,
                             padding_fraction=figures.padding_fraction, split_fraction=figures.split_fraction)
        for key in ("bytes_inter", "bytes_intra"):
            base = getattr(self.zigzag, key)
            out[f"{key}_vs_zigzag"] = getattr(self.planned, key) / base if base else None
        return out


class PlanSummary:
    """Accumulates ``PlanFigures`` of every planned micro-batch and of its zigzag counterpart.

    ``num_heads_q``/``num_heads_kv``: attention heads of one tensor-parallel rank; ``head_dim``; ``dtype``: of
    q/k/v (bytes per element).
    """

    def __init__(self, layout: str, num_heads_q: int, num_heads_kv: int, head_dim: int, dtype: torch.dtype) -> None:
        self.layout = layout
        self._geometry = (num_heads_q, num_heads_kv, head_dim, dtype)
        self.run = PlanTotals(layout)
        self._interval = PlanTotals(layout)

    def add(self, plan: BatchPlan, cu_seqlens: torch.Tensor) -> None:
        """Count one micro-batch: ``plan`` (the run's layout) of the packed stream with boundaries ``cu_seqlens``
        (int ``[num_docs + 1]``, the plan's input)."""
        planned = plan_figures(plan, *self._geometry)
        zigzag = planned if plan.layout == BASELINE_LAYOUT else plan_figures(
            plan_batch(cu_seqlens.cpu(), plan.topology, BASELINE_LAYOUT), *self._geometry)
        self.run.add(planned, zigzag)
        self._interval.add(planned, zigzag)

    def take_interval(self) -> Optional[PlanTotals]:
        """Totals since the previous call (None if no micro-batch was added), then starts a new interval."""
        interval, self._interval = self._interval, PlanTotals(self.layout)
        return interval if interval.planned.micro_batches else None


def plan_cache_line(cache: PlanCache) -> str:
    """One log line on this process's plan cache: how often a plan was found instead of made, what it holds
    against its budget (``--plan-cache-mb``) and how many plans the budget pushed out."""
    lookups = cache.hits + cache.misses
    budget = "no byte bound" if cache.max_bytes is None else f"{cache.max_bytes / (1 << 20):.2f} MiB (--plan-cache-mb)"
    return (f"plan cache of rank 0's training process: {cache.hits} of {lookups} lookups found a plan | holds "
            f"{len(cache)} plans, {cache.bytes / 1024:.1f} KiB of {budget} | {cache.evictions} evicted")
