#!/usr/bin/env python
"""Compare how packed batches are placed on CP ranks: sequence-aware vs per-document zigzag vs contiguous.

Everything is computed offline from ``plan_batch`` and ``BatchPlan.stats`` on ``CPTopology.offline``
layouts, so any cluster shape can be studied on one CPU (REFERENCE.md section 5). Batches come from
the shipped document-length histogram (``sample_doc_lengths``) and from a real corpus available on
every machine, the Python standard library's source files as documents (``stdlib_doc_lengths``,
bytes as tokens). Figures are for one layer's attention forward with the cost model's geometry
(``CostModel()``: Llama-3-8B, 32 query heads, 8 KV heads, head_dim 128, bf16).

Columns: attn imb = max/mean attention FLOPs over CP ranks; layer imb = the same with the linear
(projection + MLP) FLOPs of every rank's token slots added; inter MiB / total MiB = bytes sent between
nodes / in all per layer (all-to-alls + key/value exchanges); vs zigzag = inter-node bytes relative to
per-document zigzag; pad = padding tokens; plan ms = CPU time of cold planning, ``plan_batch`` on a
new batch (cached ms: the same batch again, served from the plan cache).

    .venv/bin/python tools/plan_report.py                      # full table (~20 s on an idle 2-core CPU)
    .venv/bin/python tools/plan_report.py --sizes 1M --layouts 2x8 --png docs/placement_1m_2x8.png
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_hsap.parallel_state import CPTopology  # noqa: E402
from megatron_hsap.sequence.cost_model import CostModel  # noqa: E402
from megatron_hsap.sequence.doc_lengths import (  # noqa: E402
    cu_seqlens_from_lengths, pack_lengths, sample_doc_lengths, stdlib_doc_lengths)
from megatron_hsap.sequence.plan import BatchPlan, plan_batch  # noqa: E402

SIZES: Dict[str, int] = {"128K": 1 << 17, "1M": 1 << 20, "4M": 1 << 22}
LAYOUTS: Dict[str, Tuple[int, int]] = {"8": (1, 8), "2x8": (2, 8), "4x8": (4, 8)}  # (nodes, CP ranks per node)
MODES = ("hybrid", "ring")  # Ulysses over the node's ranks + ring across nodes, or a pure ring
PLACEMENTS = ("sequence-aware", "zigzag", "contiguous")
SOURCES = ("buckets", "stdlib")
MIB = float(1 << 20)


@dataclass
class Row:
    source: str
    size: str
    layout: str
    mode: str
    placement: str
    docs: int
    attn_imbalance: float
    layer_imbalance: float
    inter_bytes: int
    total_bytes: int
    padding: int
    plan_ms: float
    cached_ms: float
    inter_vs_zigzag: Optional[float] = None


def batch_lengths(source: str, tokens: int, seed: int) -> List[int]:
    """Document lengths of one packed batch of exactly ``tokens`` tokens."""
    if source == "buckets":
        return sample_doc_lengths(tokens, seed=seed)
    corpus = stdlib_doc_lengths()
    return pack_lengths(corpus, tokens, offset=(seed * 7919) % len(corpus))


def topology(layout: str, mode: str) -> CPTopology:
    nodes, per_node = LAYOUTS[layout]
    return CPTopology.offline(nodes * per_node, per_node if mode == "hybrid" else 1, per_node)


def _imbalance(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def measure(lengths: List[int], topo: CPTopology, placement: str, model: CostModel) -> Tuple[BatchPlan, dict]:
    """Plan one batch (cold, then from the cache) and summarise ``BatchPlan.stats``."""
    cu = cu_seqlens_from_lengths(lengths)
    # CPU time of this process: on a shared machine wall time mostly measures the other processes.
    start = time.process_time()
    plan = plan_batch(cu, topo, layout=placement)
    plan_ms = (time.process_time() - start) * 1e3
    start = time.process_time()
    plan_batch(cu, topo, layout=placement)
    cached_ms = (time.process_time() - start) * 1e3
    stats = plan.stats(model.num_heads_q, model.num_heads_kv, model.head_dim, torch.bfloat16)
    # Every rank runs the projections and the MLP on all of its token slots, padding included.
    layer = [f + model.token_flops * plan.tokens_per_rank for f in stats.attn_flops]
    inter = sum(stats.send_bytes_inter)
    return plan, dict(attn_imbalance=stats.flops_imbalance, layer_imbalance=_imbalance(layer), inter_bytes=inter,
                      total_bytes=inter + sum(stats.send_bytes_intra), padding=sum(stats.padding_tokens),
                      plan_ms=plan_ms, cached_ms=cached_ms)


def run(sources: Sequence[str], sizes: Sequence[str], layouts: Sequence[str], modes: Sequence[str],
        seed: int, model: CostModel) -> Iterator[Row]:
    for source in sources:
        for size in sizes:
            lengths = batch_lengths(source, SIZES[size], seed)
            for layout in layouts:
                for mode in modes:
                    rows = [Row(source, size, layout, mode, p, len(lengths),
                                **measure(lengths, topology(layout, mode), p, model)[1]) for p in PLACEMENTS]
                    zigzag = next(r for r in rows if r.placement == "zigzag")
                    for r in rows:
                        r.inter_vs_zigzag = r.inter_bytes / zigzag.inter_bytes if zigzag.inter_bytes else None
                    yield from rows


def format_table(rows: Sequence[Row]) -> str:
    head = ("| source | tokens | layout | mode | placement | docs | attn imb | layer imb | inter MiB | vs zigzag "
            "| total MiB | pad | plan ms | cached ms |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        vs = "-" if r.inter_vs_zigzag is None else f"{100 * r.inter_vs_zigzag:.1f} %"
        lines.append(f"| {r.source} | {r.size} | {r.layout} | {r.mode} | {r.placement} | {r.docs} "
                     f"| {r.attn_imbalance:.3f} | {r.layer_imbalance:.3f} | {r.inter_bytes / MIB:.1f} | {vs} "
                     f"| {r.total_bytes / MIB:.1f} | {r.padding} | {r.plan_ms:.1f} | {r.cached_ms:.2f} |")
    return "\n".join(lines)


def check_targets(rows: Sequence[Row]) -> List[str]:
    """The issue's targets for sequence-aware placement on the bucket histogram at 1M tokens, 2x8 hybrid."""
    row = next((r for r in rows if (r.source, r.size, r.layout, r.mode, r.placement)
                == ("buckets", "1M", "2x8", "hybrid", "sequence-aware")), None)
    if row is None:
        return []
    checks = [("attention imbalance <= 1.05", row.attn_imbalance <= 1.05, f"{row.attn_imbalance:.3f}"),
              ("inter-node bytes <= 20 % of zigzag", row.inter_vs_zigzag is not None and row.inter_vs_zigzag <= 0.2,
               "-" if row.inter_vs_zigzag is None else f"{100 * row.inter_vs_zigzag:.1f} %"),
              ("zero padding", row.padding == 0, str(row.padding)),
              ("planning < 50 ms", row.plan_ms < 50, f"{row.plan_ms:.1f} ms")]
    return [f"target {name}: {value} {'PASS' if ok else 'FAIL'}" for name, ok, value in checks]


def draw(path: str, lengths: List[int], layout: str, mode: str, model: CostModel) -> None:
    """Placement (tokens of each CP rank, coloured by document) and member-to-member key/value traffic."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_hsap.sequence.plan import needed_rows
    from megatron_hsap.sequence.schedule import member_pieces

    topo = topology(layout, mode)
    long_docs = sorted(range(len(lengths)), key=lambda d: -lengths[d])[:12]
    colours = {d: plt.cm.tab20(i % 20) for i, d in enumerate(long_docs)}
    fig, axes = plt.subplots(2, len(PLACEMENTS), figsize=(6 * len(PLACEMENTS), 10))
    for col, placement in enumerate(PLACEMENTS):
        plan, summary = measure(lengths, topo, placement, model)
        ax = axes[0][col]
        for rank, segments in enumerate(plan.rank_segments):
            spans, faces, left = [], [], 0
            for doc, start, end in segments:
                spans.append((left, end - start))
                faces.append(colours.get(doc, (0.8, 0.8, 0.8, 1.0)))
                left += end - start
            spans.append((left, plan.tokens_per_rank - left))
            faces.append("black")
            ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=faces)
        ax.invert_yaxis()
        ax.set_title(f"{placement}: attn imb {summary['attn_imbalance']:.3f}, pad {summary['padding']}")
        ax.set_xlabel("token slot (coloured: the 12 longest documents; black: padding)")
        ax.set_ylabel("CP rank")
        pieces = member_pieces(plan.rank_segments, plan.tokens_per_rank, topo.ulysses_size)
        ring = topo.ring_size
        rows = [[needed_rows(pieces[dst], pieces[src], True) if src != dst else 0 for src in range(ring)]
                for dst in range(ring)]
        image = axes[1][col].imshow(rows, cmap="viridis")
        fig.colorbar(image, ax=axes[1][col], label="key/value rows")
        axes[1][col].set_title(f"{placement}: inter-node {summary['inter_bytes'] / MIB:.1f} MiB/layer")
        axes[1][col].set_xlabel("source ring member")
        axes[1][col].set_ylabel("destination ring member")
        axes[1][col].set_xticks(range(ring))
        axes[1][col].set_yticks(range(ring))
    fig.suptitle(f"{len(lengths)} documents, {sum(lengths)} tokens, layout {layout} ({mode})")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--seed", type=int, default=0, help="batch sampling seed")
    parser.add_argument("--png", help="draw placement and traffic of the first source/size/layout/mode here")
    args = parser.parse_args(argv)
    model = CostModel()
    rows = list(run(args.sources, args.sizes, args.layouts, args.modes, args.seed, model))
    print(format_table(rows))
    for line in check_targets(rows):
        print(line)
    if args.png:
        draw(args.png, batch_lengths(args.sources[0], SIZES[args.sizes[0]], args.seed), args.layouts[0],
             args.modes[0], model)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
