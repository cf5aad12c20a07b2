"""Where this rank is in the run (iteration and phase), for failure messages.

The training loop calls ``set_phase`` at each phase change; error messages on the
rank quote ``describe()``. When the ``--nproc`` launcher forked the rank it shares
a small array with it (``share``), so the launcher can say where a rank was when it
died, even when the rank was killed without a chance to print anything, and
which rank failed first when several did (``mark_failed`` records the time), and
which rank stopped advancing when the run stalls (the time of every phase change).
"""

from __future__ import annotations

import time
from typing import Any, Optional

__all__ = ["PHASES", "FIELDS", "set_phase", "current_iteration", "mark_failed", "describe", "share",
           "describe_shared", "failed_at", "iteration_shared", "last_progress"]

#: Phase names, indexed by the code stored in the shared array.
PHASES = ("start-up", "loading checkpoint", "forward-backward", "optimizer step", "saving checkpoint", "finished",
          "evaluation")

_state = {"iteration": 0, "phase": 0}
#: Values per rank in the launcher's shared array: iteration, phase code, time.monotonic() of the failure (0: none),
#: time.monotonic() of the last phase change (the launcher's stall watchdog reads it).
FIELDS = 4
_shared: Optional[Any] = None  # multiprocessing.Array('d', FIELDS * nproc) from the launcher
_slot = 0


def share(array: Any, rank: int) -> None:
    """Mirror this rank's progress into its ``FIELDS`` slots of ``array`` (called in the rank the launcher forked)."""
    global _shared, _slot
    _shared, _slot = array, FIELDS * rank


def set_phase(phase: str, iteration: Optional[int] = None) -> None:
    """Record that this rank entered ``phase`` (one of ``PHASES``), optionally of ``iteration``."""
    _state["phase"] = PHASES.index(phase)
    if iteration is not None:
        _state["iteration"] = iteration
    if _shared is not None:
        _shared[_slot], _shared[_slot + 1] = _state["iteration"], _state["phase"]
        _shared[_slot + 3] = time.monotonic()


def mark_failed() -> None:
    """Record the moment this rank caught its failure (the launcher names the earliest as the cause)."""
    if _shared is not None:
        _shared[_slot + 2] = time.monotonic()


def current_iteration() -> int:
    return _state["iteration"]


def _text(iteration: int, phase: int) -> str:
    name = PHASES[phase]
    return f"iteration {iteration} ({name})" if name in ("forward-backward", "optimizer step",
                                                         "saving checkpoint", "evaluation") else name


def describe() -> str:
    """This rank's position, e.g. ``iteration 3 (forward-backward)`` or ``start-up``."""
    return _text(_state["iteration"], _state["phase"])


def describe_shared(array: Any, rank: int) -> str:
    """Rank ``rank``'s last recorded position in a launcher's shared ``array``."""
    return _text(int(array[FIELDS * rank]), int(array[FIELDS * rank + 1]))


def iteration_shared(array: Any, rank: int) -> int:
    """Rank ``rank``'s last recorded iteration in a launcher's shared ``array``."""
    return int(array[FIELDS * rank])


def last_progress(array: Any, rank: int) -> float:
    """When rank ``rank`` last changed phase (``time.monotonic()``; 0.0 before its first)."""
    return array[FIELDS * rank + 3]


def failed_at(array: Any, rank: int) -> float:
    """When rank ``rank`` caught a failure (``time.monotonic()``), 0.0 if it did not record one."""
    return array[FIELDS * rank + 2]
