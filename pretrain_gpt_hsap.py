#!/usr/bin/env python
"""Pretrain a Megatron-Core GPT with HSAP context parallelism (see docs/training.md).

    torchrun --nproc-per-node 8 pretrain_gpt_hsap.py --context-parallel-size 8 ...   # GPUs (NCCL) or CPU (gloo)
    python pretrain_gpt_hsap.py --nproc 8 --context-parallel-size 8 --ranks-per-node 4   # forks 8 CPU ranks itself

With no --data-path and no --mock-data it trains on the Python standard library's
sources (byte-level tokens, packed documents), built once and cached.
"""

import argparse
import sys

from megatron_hsap.training.arguments import parse_args
from megatron_hsap.training.launch import launched_by_torchrun, spawn_local_ranks


def run_rank(args: argparse.Namespace) -> int:
    """Train on this rank; bad input found after start-up becomes one clear line per rank and a non-zero exit."""
    from megatron_hsap.training.loop import pretrain

    try:
        pretrain(args)
    except (ValueError, RuntimeError) as err:
        print(f"pretrain_gpt_hsap.py: error: {err}", file=sys.stderr, flush=True)
        return 2 if isinstance(err, ValueError) else 1
    return 0


def main() -> int:
    args = parse_args()
    if launched_by_torchrun():
        return run_rank(args)
    return spawn_local_ranks(args.nproc or 1, run_rank, args)


if __name__ == "__main__":
    sys.exit(main())
