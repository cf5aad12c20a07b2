#!/usr/bin/env python
"""Pretrain a Megatron-Core GPT with HSAP context parallelism (see docs/training.md).

    torchrun --nproc-per-node 8 pretrain_gpt_hsap.py --context-parallel-size 8 ...   # GPUs (NCCL) or CPU (gloo)
    python pretrain_gpt_hsap.py --nproc 8 --context-parallel-size 8 --ranks-per-node 4   # forks 8 CPU ranks itself

With no --data-path and no --mock-data it trains on the Python standard library's
sources (byte-level tokens, packed documents), built once and cached.
"""

import argparse
import os
import sys
import traceback

from megatron_hsap.training.quiet import fallback_summary, quiet_rank

quiet_rank(int(os.environ.get("RANK", "0")))  # before anything imports Megatron-Core (as Megatron-LM's pretrain_gpt)

from megatron_hsap.training import progress  # noqa: E402
from megatron_hsap.training.arguments import parse_args  # noqa: E402
from megatron_hsap.training.save_lock import lock_save_directory  # noqa: E402
from megatron_hsap.training.launch import (  # noqa: E402
    adopt_torchrun_rank,
    freeze_imported_objects,
    launched_by_torchrun,
    spawn_local_ranks,
)


def run_rank(args: argparse.Namespace) -> int:
    """Train on this rank. A failure becomes one line naming the rank and where it was, and a non-zero exit:
    2 for bad input (ValueError), 1 otherwise (with the traceback unless it is a RuntimeError we raised or
    a collective's error)."""
    from megatron_hsap.training.loop import pretrain

    freeze_imported_objects()  # torchrun ranks import here; forked ranks inherit the launcher's frozen objects
    try:
        pretrain(args)
    except BaseException as err:  # noqa: BLE001 - every failure is reported with its rank and position
        if isinstance(err, SystemExit):
            raise
        progress.mark_failed()
        where = f"rank {os.environ.get('RANK', '0')}, {progress.describe()}"
        if not isinstance(err, (ValueError, RuntimeError)):
            traceback.print_exc()
        sys.stderr.flush()  # then the line in one write: the lines of several failing ranks never interleave
        os.write(sys.stderr.fileno(), f"pretrain_gpt_hsap.py: error: {where}: {error_text(err)}\n".encode())
        return 2 if isinstance(err, ValueError) else 1
    return 0


def error_text(err: BaseException) -> str:
    """What went wrong, never empty: an exception without a message is named by its type (SIGINT by the signal)."""
    if isinstance(err, KeyboardInterrupt):
        return "interrupted by SIGINT (KeyboardInterrupt)" + (f": {err}" if str(err) else "")
    return str(err) or f"{type(err).__name__} (raised without a message)"


def main() -> int:
    args = parse_args()
    if args.dry_run:
        from megatron_hsap.training.startup import dry_run_lines

        print("\n".join(dry_run_lines(args)), flush=True)
        return 0
    if int(os.environ.get("RANK", "0")) == 0:
        for line in filter(None, [fallback_summary()] + [f"megatron-hsap: {note}" for note in args.compat_notes]):
            print(line, flush=True)
        if args.print_args:
            from megatron_hsap.training.startup import arguments_block

            print(arguments_block(args), flush=True)
    if args.save is not None and int(os.environ.get("RANK", "0")) == 0:
        try:
            save_lock = lock_save_directory(args.save)  # noqa: F841 - held until this process exits
        except ValueError as err:
            print(f"pretrain_gpt_hsap.py: error: {err}", file=sys.stderr, flush=True)
            return 2
    if launched_by_torchrun():
        adopt_torchrun_rank()
        return run_rank(args)
    stall = 2 * args.distributed_timeout_minutes if args.stall_timeout_minutes is None else args.stall_timeout_minutes
    return spawn_local_ranks(args.nproc or 1, run_rank, args, args.rank_failure_grace_seconds,
                             stall_seconds=60.0 * stall if stall else None)


if __name__ == "__main__":
    sys.exit(main())
