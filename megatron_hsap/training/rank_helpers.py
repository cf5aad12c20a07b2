"""The helper processes of a rank die with it and leave the preemption signals to it.

A rank starts helpers: megatron-core's checkpoint writer forks writer processes and
spawns a ``multiprocessing`` Manager (which starts Python's ``resource_tracker``),
and the data loader forks its workers. Two failures followed:
- a cluster that signals every process of a job (``scancel --signal``, a SIGTERM to
  the process group) killed the Manager before the rank could write its preemption
  checkpoint;
- when the ``--nproc`` launcher was SIGKILLed, its ranks died (``PR_SET_PDEATHSIG``)
  but the spawned Manager and the resource tracker lived on.

So, in every rank (``shield_helpers``, ``start_group_reaper``):
- helpers start with the preemption signals (``PREEMPTION_SIGNALS``) blocked: a
  spawned helper inherits the blocked mask through ``exec`` (it is set around
  ``multiprocessing``'s spawn only, so the rank itself never misses a signal: one that
  arrives meanwhile is delivered when the mask is restored), a forked one blocks them
  when it starts; they end when the rank asks or dies, not on a preemption notice;
- a forked helper dies with the rank (``PR_SET_PDEATHSIG``);
- a reaper process in the rank's process group SIGKILLs the group when the rank dies,
  spawned helpers included (a spawned process cannot be given a parent-death signal
  from outside). Its own parent-death signal is a real-time signal it handles while it
  has nothing else to do, so it acts at once.
Linux only (``prctl``); elsewhere the helpers behave as before.
"""

from __future__ import annotations

import ctypes
import multiprocessing.util
import os
import signal
from functools import wraps
from typing import Any, Callable

__all__ = ["PREEMPTION_SIGNALS", "die_with_parent", "block_preemption_signals", "shield_helpers",
           "start_group_reaper"]

#: Signals that announce a preemption (or ask a job to stop): the rank's to handle, never a helper's.
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1
#: The reaper's parent-death signal (real-time: nothing else sends it).
_REAPER_SIGNAL = signal.SIGRTMIN + 3


def _set_parent_death_signal(signum: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when its parent ``parent`` (the launcher, a rank) dies (no-op elsewhere)."""
    if _set_parent_death_signal(signal.SIGKILL) and os.getppid() != parent:  # the parent died before the request
        os._exit(128 + signal.SIGKILL)


def block_preemption_signals() -> None:
    """In a helper process: leave ``PREEMPTION_SIGNALS`` to the rank (blocked, so they stay pending, unhandled)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)


def _forked_helper_start(rank: int) -> None:
    block_preemption_signals()
    die_with_parent(rank)


def _spawn_with_signals_blocked(spawn: Callable[..., int]) -> Callable[..., int]:
    """``multiprocessing.util.spawnv_passfds`` (every spawn of a Manager, a spawn-context process or the resource
    tracker) with ``PREEMPTION_SIGNALS`` blocked for the call: the new process starts with them blocked."""
    if getattr(spawn, "_hsap_shielded", False):
        return spawn

    @wraps(spawn)
    def shielded(*args: Any, **kwargs: Any) -> int:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
        try:
            return spawn(*args, **kwargs)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    shielded._hsap_shielded = True  # type: ignore[attr-defined]
    return shielded


class _ForkHook:
    """Owner of the ``register_after_fork`` entry (the registry holds its owner weakly)."""


_FORK_HOOK = _ForkHook()


def shield_helpers() -> None:
    """In a rank: every helper it starts through ``multiprocessing`` from now on blocks the preemption signals;
    forked ones also die with it."""
    multiprocessing.util.spawnv_passfds = _spawn_with_signals_blocked(multiprocessing.util.spawnv_passfds)
    rank = os.getpid()
    multiprocessing.util.register_after_fork(_FORK_HOOK, lambda _: _forked_helper_start(rank))


def start_group_reaper() -> int:
    """Fork the reaper of this process's group (see the module doc); returns its pid."""
    rank = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:  # the reaper: nothing but waiting for the rank's death
        block_preemption_signals()
        signal.signal(_REAPER_SIGNAL, lambda *_: os.killpg(0, signal.SIGKILL))
        if not _set_parent_death_signal(_REAPER_SIGNAL):
            os._exit(0)
        if os.getppid() != rank:
            os.killpg(0, signal.SIGKILL)
        while True:
            signal.pause()
    finally:
        os._exit(0)
