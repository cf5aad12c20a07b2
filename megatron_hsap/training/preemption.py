"""Leaving a run cleanly on request: ``--exit-signal-handler``, ``--exit-duration-in-mins``, ``--exit-interval``.

As in Megatron-LM, a rank that receives one of the exit signals only records it;
at the end of every iteration the ranks agree (one small all-reduce) whether any
rank received one or the time is up, and then all of them save a checkpoint and
exit 0 together. A cluster's preemption notice (SLURM sends SIGTERM, or SIGUSR1
with ``--signal=USR1@<seconds>``) therefore costs at most the current iteration.
"""

from __future__ import annotations

import signal
import time
from typing import List, Optional

import torch
import torch.distributed as dist

__all__ = ["ExitSignalHandler", "exit_reason"]


class ExitSignalHandler:
    """Records the first of ``names`` (e.g. ``["SIGTERM", "SIGUSR1"]``) this rank receives."""

    def __init__(self, names: List[str]) -> None:
        self.received = 0
        self._previous = {getattr(signal, n): signal.signal(getattr(signal, n), self._handle) for n in names}

    def _handle(self, signum: int, _frame: object) -> None:
        self.received = self.received or signum

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def exit_reason(handler: Optional[ExitSignalHandler], started: float, exit_duration_in_mins: Optional[float],
                device: torch.device) -> str:
    """Collective: why all ranks should stop now ('' to go on). ``started``: this rank's ``time.time()`` at start."""
    world = dist.get_world_size()
    flags = torch.zeros(world + 1, dtype=torch.float64, device=device)
    if handler is not None:
        flags[dist.get_rank()] = handler.received
    minutes = (time.time() - started) / 60.0
    if exit_duration_in_mins is not None and minutes >= exit_duration_in_mins:
        flags[world] = 1
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    received = flags[:world].tolist()
    reasons = [f"{signal.Signals(int(s)).name} received by rank {r}" for r, s in enumerate(received) if s]
    if flags[world]:
        reasons.append(f"--exit-duration-in-mins {exit_duration_in_mins:g} reached")
    return "; ".join(reasons)
