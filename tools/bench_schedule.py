#!/usr/bin/env python
"""Per-step kernel work of compiled schedules, and what building them costs (issue: hybrid zigzag).

For each CP layout (nodes x ranks per node) and batch (one document of all tokens, or a
packed mix from the bundled length histogram), it plans the batch offline and compiles
every ring member's schedule, then prints per token layout:

- plan ms: ``plan_batch`` (placement; cold cache);
- schedule ms: compiling the slowest member's schedule (what a rank does per batch);
  with ``--batches N``, the median over N packed mixes (seeds ``--seed`` on) of this time and
  of the plan time, and the maximum of the block and call counts; with ``--repeats R``, each
  batch planned and compiled R times from cold caches, keeping each member's least time
  (shared machines are noisy: one load spike in any of 64 members sets the slowest); ``--clock cpu``
  times with the process's CPU time (``time.process_time``) instead of wall time, which a loaded
  machine inflates by the share of the cores other processes take;
- blocks/step: attention blocks of the busiest (member, ring step), local step included;
- varlen calls/step: flash-attn/TE calls the busiest step needs (blocks split into
  minimal varlen passes, ``kernels.gpu_common.split_into_passes``).

``--mode`` sets Ulysses inside a node: hybrid (all ranks of a node, ring across nodes),
ring (Ulysses 1: a pure ring, every rank a ring member) or u2 (Ulysses pairs).
``--kv-forwarding`` compiles the schedules with node-level K/V forwarding.

    python tools/bench_schedule.py                       # CP 16 (2 x 8) and CP 64 (8 x 8), 1M tokens
    python tools/bench_schedule.py --tokens 262144 --layouts zigzag
    python tools/bench_schedule.py --cp 8x8 --mode ring --kv-forwarding --batches 3 --repeats 3
    python tools/bench_schedule.py --cp 8x8 --mode ring --layouts zigzag --batches 3 --repeats 2 --clock cpu
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from statistics import median
from typing import Callable, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hsap.kernels.gpu_common import split_into_passes  # noqa: E402
from megatron_hsap.parallel_state import CPTopology  # noqa: E402
from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths, sample_doc_lengths  # noqa: E402
from megatron_hsap.sequence.plan import PLAN_CACHE, plan_batch  # noqa: E402


#: Per mode: Ulysses size from the ranks per node, and how the header describes it.
MODES = {"hybrid": (lambda per_node: per_node, "hybrid: Ulysses inside a node, ring across nodes"),
         "ring": (lambda per_node: 1, "ring: Ulysses 1, every rank a ring member"),
         "u2": (lambda per_node: 2, "u2: Ulysses pairs, ring across them")}


def measure(lengths: List[int], topo: CPTopology, layout: str, kv_forwarding: bool = False,
            repeats: int = 1, clock: Callable[[], float] = time.perf_counter) -> Dict[str, float]:
    """Plan and schedule times (cold caches; the least of ``repeats`` runs, per member for schedules) and the
    busiest step's blocks and varlen calls."""
    cu = cu_seqlens_from_lengths(lengths)
    plan_ms, member_ms = float("inf"), [float("inf")] * topo.ring_size
    for _ in range(repeats):
        PLAN_CACHE.clear()
        start = clock()
        plan = plan_batch(cu, topo, layout)
        plan_ms = min(plan_ms, 1e3 * (clock() - start))
        for member in range(topo.ring_size):
            start = clock()
            plan.member_schedule(True, member=member, kv_forwarding=kv_forwarding)
            member_ms[member] = min(member_ms[member], 1e3 * (clock() - start))
    blocks, calls = 0, 0
    for member in range(topo.ring_size):
        schedule = plan.member_schedule(True, member=member, kv_forwarding=kv_forwarding)
        for step_blocks in [schedule.local_blocks] + [r.blocks for r in schedule.recv_steps + schedule.relay_recvs]:
            blocks = max(blocks, len(step_blocks))
            calls = max(calls, len(split_into_passes(step_blocks)))
    return {"plan_ms": plan_ms, "schedule_ms": max(member_ms), "blocks": blocks, "calls": calls}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--layouts", default="zigzag,sequence-aware")
    parser.add_argument("--cp", default="2x8,8x8", help="comma-separated NODESxRANKS_PER_NODE")
    parser.add_argument("--mode", choices=sorted(MODES), default="hybrid",
                        help="Ulysses inside a node: hybrid (the whole node), ring (1), u2 (2)")
    parser.add_argument("--kv-forwarding", action="store_true", help="node-level K/V forwarding")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batches", type=int, default=1,
                        help="packed mixes (seeds from --seed); times are medians over them")
    parser.add_argument("--repeats", type=int, default=1,
                        help="plan and compile each batch this many times from cold caches, keeping the least "
                             "time (per member): filters load spikes of a shared machine")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time with wall time (perf_counter) or this process's CPU time (process_time)")
    args = parser.parse_args(argv)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    batches = {"one document": [[args.tokens]],
               "packed mix": [sample_doc_lengths(args.tokens, seed=args.seed + i) for i in range(args.batches)]}
    ulysses_of, description = MODES[args.mode]
    print(f"{args.tokens} tokens; {description}; causal{'; K/V forwarding' if args.kv_forwarding else ''}"
          + (f"; median of {args.batches} packed mixes" if args.batches > 1 else "")
          + (f"; least of {args.repeats} runs" if args.repeats > 1 else "")
          + ("; CPU time" if args.clock == "cpu" else ""))
    print(f"{'CP (nodes x ranks)':<20}{'batch':<14}{'layout':<16}{'plan ms':>9}{'schedule ms':>13}"
          f"{'blocks/step':>13}{'varlen calls/step':>20}")
    for shape in args.cp.split(","):
        nodes, per_node = (int(x) for x in shape.split("x"))
        topo = CPTopology.offline(nodes * per_node, ulysses_of(per_node), per_node)
        for name, mixes in batches.items():
            for layout in args.layouts.split(","):
                runs = [measure(lengths, topo, layout, args.kv_forwarding, args.repeats, clock) for lengths in mixes]
                r = {key: (median if key.endswith("_ms") else max)(x[key] for x in runs) for key in runs[0]}
                print(f"{nodes * per_node:>3} ({shape}){'':<11}{name:<14}{layout:<16}{r['plan_ms']:>9.1f}"
                      f"{r['schedule_ms']:>13.1f}{r['blocks']:>13}{r['calls']:>20}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
