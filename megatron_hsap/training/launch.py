"""Start the CPU ranks ourselves when the script was not launched by torchrun (``--nproc N``).

The parent imports Megatron-Core once (~6 s and ~360 MB per process otherwise)
and forks the ranks, each with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT) and one compute thread. If any
rank fails, the others get ``FAILURE_GRACE_SECONDS`` to report and exit, then are
stopped, and the first failing exit status is returned, so a bad run never hangs. GPU runs use torchrun instead.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import sys
import time
from typing import Callable

__all__ = ["launched_by_torchrun", "spawn_local_ranks", "FAILURE_GRACE_SECONDS"]

#: After the first rank fails, seconds the others get to exit on their own before they are stopped.
FAILURE_GRACE_SECONDS = 10.0


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, nproc: int, port: int, main: Callable[[argparse.Namespace], int],
               args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    # sys.exit (not os._exit) so multiprocessing's exit hooks stop helper processes, e.g. the
    # Manager dist_checkpointing starts, which would otherwise outlive the run holding its pipes.
    sys.exit(main(args))


def spawn_local_ranks(nproc: int, main: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run ``main(args)`` on ``nproc`` forked ranks; returns the first non-zero exit code (or 0)."""
    import megatron.core.models.gpt  # noqa: F401  (warm the import for the forked ranks)

    ctx = multiprocessing.get_context("fork")
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, nproc, port, main, args)) for rank in range(nproc)]
    for p in procs:
        p.start()
    status, deadline = 0, None
    try:
        while any(p.exitcode is None for p in procs):
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed and deadline is None:  # let the others report their own error, then stop them
                status, deadline = failed[0], time.monotonic() + FAILURE_GRACE_SECONDS
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.terminate()
        for p in procs:
            p.join()
    return status or next((p.exitcode for p in procs if p.exitcode), 0)
