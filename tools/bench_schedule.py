#!/usr/bin/env python
"""Per-step kernel work of compiled schedules, and what building them costs (issue: hybrid zigzag).

For each CP layout (nodes x ranks per node, hybrid: Ulysses inside a node, ring across)
and batch (one document of all tokens, or a packed mix from the bundled length histogram),
it plans the batch offline and compiles every ring member's schedule, then prints per
token layout:

- plan ms: ``plan_batch`` (placement; cold cache);
- schedule ms: compiling the slowest member's schedule (what a rank does per batch);
- blocks/step: attention blocks of the busiest (member, ring step), local step included;
- varlen calls/step: flash-attn/TE calls the busiest step needs (blocks split into
  minimal varlen passes, ``kernels.gpu_common.split_into_passes``).

    python tools/bench_schedule.py                       # CP 16 (2 x 8) and CP 64 (8 x 8), 1M tokens
    python tools/bench_schedule.py --tokens 262144 --layouts zigzag
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hsap.kernels.gpu_common import split_into_passes  # noqa: E402
from megatron_hsap.parallel_state import CPTopology  # noqa: E402
from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths, sample_doc_lengths  # noqa: E402
from megatron_hsap.sequence.plan import PLAN_CACHE, plan_batch  # noqa: E402


def measure(lengths: List[int], topo: CPTopology, layout: str) -> Dict[str, float]:
    PLAN_CACHE.clear()
    cu = cu_seqlens_from_lengths(lengths)
    start = time.perf_counter()
    plan = plan_batch(cu, topo, layout)
    plan_ms = 1e3 * (time.perf_counter() - start)
    worst_ms, blocks, calls = 0.0, 0, 0
    for member in range(topo.ring_size):
        start = time.perf_counter()
        schedule = plan.member_schedule(True, member=member)
        worst_ms = max(worst_ms, 1e3 * (time.perf_counter() - start))
        for step_blocks in [schedule.local_blocks] + [r.blocks for r in schedule.recv_steps]:
            blocks = max(blocks, len(step_blocks))
            calls = max(calls, len(split_into_passes(step_blocks)))
    return {"plan_ms": plan_ms, "schedule_ms": worst_ms, "blocks": blocks, "calls": calls}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--layouts", default="zigzag,sequence-aware")
    parser.add_argument("--cp", default="2x8,8x8", help="comma-separated NODESxRANKS_PER_NODE")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    batches = {"one document": [args.tokens], "packed mix": sample_doc_lengths(args.tokens, seed=args.seed)}
    print(f"{args.tokens} tokens; hybrid: Ulysses inside a node, ring across nodes; causal")
    print(f"{'CP (nodes x ranks)':<20}{'batch':<14}{'layout':<16}{'plan ms':>9}{'schedule ms':>13}"
          f"{'blocks/step':>13}{'varlen calls/step':>20}")
    for shape in args.cp.split(","):
        nodes, per_node = (int(x) for x in shape.split("x"))
        topo = CPTopology.offline(nodes * per_node, per_node, per_node)
        for name, lengths in batches.items():
            for layout in args.layouts.split(","):
                r = measure(lengths, topo, layout)
                print(f"{nodes * per_node:>3} ({shape}){'':<11}{name:<14}{layout:<16}{r['plan_ms']:>9.1f}"
                      f"{r['schedule_ms']:>13.1f}{r['blocks']:>13}{r['calls']:>20}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
