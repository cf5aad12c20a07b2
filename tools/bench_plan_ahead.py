"""What planning costs the training process per step: planned inline, in a thread (``plan_ahead``) or in
data-loader workers (``plan_in_workers``).

A stand-in training step does ``--step-ms`` of GIL-holding work (calibrated at start-up; the host side of a
step: Python launching kernels), then the loop takes the next batch and its plan (``plan_batch``). Reported
per mode: wall time per step, and the time the loop spent getting the planned batch (what planning adds to
the critical path), mean / p50 / p99. Figures: docs/sequence_aware.md, "Plan cache and planning ahead".

    python tools/bench_plan_ahead.py --steps 30 --step-ms 100
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from typing import Callable, Dict, Iterator, List

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hsap.parallel_state import CPTopology  # noqa: E402
from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths, sample_doc_lengths  # noqa: E402
from megatron_hsap.sequence.plan import PLAN_CACHE, plan_batch  # noqa: E402
from megatron_hsap.sequence.prefetch import plan_ahead  # noqa: E402
from megatron_hsap.training.plan_workers import plan_in_workers  # noqa: E402


def _read(tokens: int, index: int) -> Dict[str, torch.Tensor]:
    """Batch ``index``: one packed sequence of ``tokens`` tokens with sampled document lengths."""
    return {"cu_seqlens": cu_seqlens_from_lengths(sample_doc_lengths(tokens, seed=index))}


def _cu_of(batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["cu_seqlens"]


def _hold_gil(iterations: int) -> None:
    """A fixed amount of GIL-holding Python work: a planning thread that takes the GIL makes the step longer,
    as it would the host side of a real step (kernel launches)."""
    for _ in range(iterations):
        time.perf_counter()


def _iterations_for(ms: float) -> int:
    """``_hold_gil`` iterations that take ``ms`` milliseconds in this process alone."""
    start = time.perf_counter()
    _hold_gil(200_000)
    return int(200_000 * ms / (1e3 * (time.perf_counter() - start)))


def _run(batches: Iterator[Dict[str, torch.Tensor]], topo: CPTopology, layout: str, steps: int,
         step_iterations: int) -> Dict[str, float]:
    waits: List[float] = []
    start = time.perf_counter()
    for _ in range(steps):
        _hold_gil(step_iterations)
        t0 = time.perf_counter()
        plan_batch(_cu_of(next(batches)), topo, layout)
        waits.append(1e3 * (time.perf_counter() - t0))
    wall = 1e3 * (time.perf_counter() - start) / steps
    return {"step": wall, "mean": float(np.mean(waits)), "p50": float(np.percentile(waits, 50)),
            "p99": float(np.percentile(waits, 99))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=262144)
    p.add_argument("--cp", type=int, default=16)
    p.add_argument("--ulysses", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--layout", default="sequence-aware")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    topo = CPTopology.offline(args.cp, args.ulysses, args.ranks_per_node)
    read: Callable[[int], Dict[str, torch.Tensor]] = partial(_read, args.tokens)
    indices = range(args.steps)
    step_iterations = _iterations_for(args.step_ms)
    modes = {
        "inline": lambda: map(read, indices),
        "thread (--num-workers 0)": lambda: plan_ahead(map(read, indices), _cu_of, topo, args.layout),
        f"workers (--num-workers {args.workers})": lambda: plan_in_workers(read, indices, _cu_of, topo, args.layout,
                                                                          num_workers=args.workers),
    }
    print(f"{args.tokens} tokens, CP {args.cp} (ulysses {args.ulysses}, {args.ranks_per_node} ranks/node), "
          f"{args.layout}, step {args.step_ms:g} ms holding the GIL, {args.steps} steps (same batches, cold cache)")
    for name, make in modes.items():
        PLAN_CACHE.clear()
        r = _run(iter(make()), topo, args.layout, args.steps, step_iterations)
        print(f"{name:>26}: {r['step']:6.1f} ms/step; getting the planned batch: mean {r['mean']:6.2f} ms, "
              f"p50 {r['p50']:6.2f} ms, p99 {r['p99']:6.2f} ms")


if __name__ == "__main__":
    main()
