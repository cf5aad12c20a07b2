"""Start the CPU ranks ourselves when the script was not launched by torchrun (``--nproc N``).

The parent imports the training loop, Megatron-Core and its tokenizer libraries
once (seconds and hundreds of MB per process otherwise; docs/training.md) and forks the ranks, each with
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR/PORT) and one compute thread.

The parent is the run's watchdog, as torchrun's elastic agent is for GPU runs:
- when a rank exits non-zero or is killed, it prints which rank failed, how, and
  where (iteration and phase, from ``progress``'s shared array); the other ranks
  get ``--rank-failure-grace-seconds`` to report their own error and exit, then
  are killed (SIGKILL); it returns the failed rank's status (128 + signal for a
  killed rank, as a shell reports it), so a bad run never hangs;
- each rank is the leader of its own process group, and every group is killed at
  the end, so no helper a rank started (e.g. dist_checkpointing's Manager) survives;
  a rank is also SIGKILLed by the kernel if the launcher itself dies (Linux
  ``PR_SET_PDEATHSIG``), and its helpers die with it (``rank_helpers``: a reaper
  kills the rank's process group);
- when no rank has advanced (changed phase, see ``progress``) for ``--stall-timeout-minutes``
  (a stopped rank, a deadlock outside a collective's timeout), it prints every rank's
  Python stack (``faulthandler`` on SIGQUIT; a stopped rank is continued so that it
  can), names the rank that advanced least recently, kills every rank and returns
  ``STALL_STATUS``;
- SIGTERM, SIGUSR1, SIGUSR2, SIGINT and SIGHUP sent to the parent are forwarded to
  the rank processes only, never to their process groups: helpers a rank started
  (the checkpoint writer's Manager, the resource tracker) must live until the rank's
  preemption checkpoint is written (with ``--exit-signal-handler`` the ranks then
  save and exit 0); the helpers block these signals (``rank_helpers``), so one sent
  to every process of the job reaches only the ranks' handlers.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib
import multiprocessing
import os
import signal
import socket
import sys
import time
from typing import Callable, List, Optional

from megatron_hsap.training import progress
from megatron_hsap.training.quiet import quiet_rank
from megatron_hsap.training.rank_helpers import PREEMPTION_SIGNALS, die_with_parent, shield_helpers, start_group_reaper

__all__ = ["adopt_torchrun_rank", "freeze_imported_objects", "launched_by_torchrun", "spawn_local_ranks",
           "FORWARDED_SIGNALS", "RANK_IMPORTS", "STACK_SIGNAL", "STALL_STATUS"]

#: Imported by the launcher before it forks, once instead of once per rank: the training loop (Megatron-Core's
#: models and optimizer with it) and Megatron-Core's text tokenizer classes, whose libraries (transformers among
#: them) take seconds.
RANK_IMPORTS = ("megatron.core.tokenizers.text.models", "megatron_hsap.training.loop")
#: Signals the launcher passes on to every rank.
FORWARDED_SIGNALS = PREEMPTION_SIGNALS
#: Makes a rank print every thread's Python stack to stderr (faulthandler).
STACK_SIGNAL = signal.SIGQUIT
#: The launcher's exit status when its stall watchdog stopped the run (as ``timeout(1)`` reports a timeout).
STALL_STATUS = 124
#: How long the watchdog waits for each rank's stack.
_STACK_SECONDS = 0.5
#: After the first failures are seen, how long to wait for a signal death that explains them.
_SETTLE_SECONDS = 0.5
_POLL_SECONDS = 0.05


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def adopt_torchrun_rank() -> None:
    """In a rank torchrun started, the rules of this launcher's ranks: die with torchrun's agent, helpers that
    leave the preemption signals to the rank, and a reaper of the rank's process group. torchrun starts each
    worker in a session of its own (and stops it with a signal to that group, which without the shield would
    also stop the checkpoint writer's helpers); elsewhere (RANK/WORLD_SIZE set by hand or another launcher)
    nothing changes."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or os.getpgid(0) != os.getpid():
        return
    die_with_parent(os.getppid())
    shield_helpers()
    start_group_reaper()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, nproc: int, port: int, main: Callable[[argparse.Namespace], int],
               args: argparse.Namespace, shared_progress: object, parent: int) -> None:
    os.setpgid(0, 0)  # own process group: the launcher can kill the rank with everything it started
    quiet_rank(rank)
    die_with_parent(parent)
    shield_helpers()
    start_group_reaper()
    faulthandler.register(STACK_SIGNAL, all_threads=True)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    progress.share(shared_progress, rank)
    # sys.exit (not os._exit) so multiprocessing's exit hooks stop helper processes, e.g. the
    # Manager dist_checkpointing starts, which would otherwise outlive the run holding its pipes.
    sys.exit(main(args))


def _how(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with status {exitcode}"


def _shell_status(exitcode: int) -> int:
    """A child's exit code as a shell reports it (128 + N for a child killed by signal N)."""
    return 128 - exitcode if exitcode < 0 else exitcode


def _kill(pid: int, sig: int) -> None:
    """Signal the process ``pid`` only (not the helpers in its process group)."""
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(pid: Optional[int], sig: int) -> None:
    if pid is None:
        return
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _say(message: str) -> None:
    print(f"pretrain_gpt_hsap.py: {message}", file=sys.stderr, flush=True)


def freeze_imported_objects() -> None:
    """Move everything allocated so far (torch's and Megatron-Core's import graph, about a million objects)
    to the garbage collector's permanent generation: neither the collections during training nor the
    interpreter's shutdown walk it again (shutdown alone took seconds per process), and forked ranks
    share those pages instead of copying them when the collector touches them."""
    gc.freeze()


def spawn_local_ranks(nproc: int, main: Callable[[argparse.Namespace], int], args: argparse.Namespace,
                      grace_seconds: float, stall_seconds: Optional[float] = None) -> int:
    """Run ``main(args)`` on ``nproc`` forked ranks and watch them; returns 0 or the first failure's status.

    grace_seconds: after the first rank fails, how long the others may take to exit on their own.
    stall_seconds: when no rank has changed phase for this long, dump every rank's stack and stop the run
    (``STALL_STATUS``); None: no stall watchdog.
    """
    for module in RANK_IMPORTS:
        importlib.import_module(module)

    freeze_imported_objects()

    ctx = multiprocessing.get_context("fork")
    port = _free_port()
    shared = ctx.Array("d", progress.FIELDS * nproc, lock=False)
    procs = [ctx.Process(target=_rank_main, args=(rank, nproc, port, main, args, shared, os.getpid()))
             for rank in range(nproc)]
    for p in procs:
        p.start()
    for p in procs:  # also here: a signal may come before a child ran its own setpgid
        try:
            os.setpgid(p.pid, p.pid)
        except (ProcessLookupError, PermissionError):
            pass

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.exitcode is None:
                _kill(p.pid, signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    try:
        return _watch(procs, shared, grace_seconds, stall_seconds)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in procs:
            _kill_group(p.pid, signal.SIGKILL)
            p.join()


def _is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, a debugger), from Linux's /proc (False elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _stop_stalled(procs: List[multiprocessing.process.BaseProcess], shared: object, stall_seconds: float) -> None:
    """Name the rank that stopped advancing, print every rank's stack, then kill every rank."""
    running = [(rank, p) for rank, p in enumerate(procs) if p.exitcode is None]
    stopped = [r for r, q in running if _is_stopped(q.pid)]
    # A stopped rank is the cause; else the rank behind the others; else the one whose last step was longest ago.
    rank, p = min(running, key=lambda rp: (rp[0] not in stopped, progress.iteration_shared(shared, rp[0]),
                                           progress.last_progress(shared, rp[0])))
    how = f"; stopped (SIGSTOP or a debugger): rank(s) {', '.join(map(str, stopped))}" if stopped else ""
    _say(f"no rank advanced for {stall_seconds:g} s (--stall-timeout-minutes): rank {rank} (pid {p.pid}) stopped "
         f"advancing first, during {progress.describe_shared(shared, rank)}{how}; every rank's stack follows, "
         "then the job is stopped")
    for r, q in running:  # one after another: stacks written at once would interleave
        _say(f"stack of rank {r} (pid {q.pid}):")
        _kill(q.pid, STACK_SIGNAL)
        _kill(q.pid, signal.SIGCONT)  # a stopped rank prints its stack only once continued
        time.sleep(_STACK_SECONDS)
    for _, q in running:
        _kill_group(q.pid, signal.SIGKILL)
    for _, q in running:
        q.join()


def _watch(procs: List[multiprocessing.process.BaseProcess], shared: object, grace_seconds: float,
           stall_seconds: Optional[float] = None) -> int:
    failed_at, status = None, 0
    started = time.monotonic()
    while any(p.exitcode is None for p in procs):
        latest = max([started] + [progress.last_progress(shared, r) for r in range(len(procs))])
        if failed_at is None and stall_seconds is not None and time.monotonic() - latest > stall_seconds:
            _stop_stalled(procs, shared, stall_seconds)
            return STALL_STATUS
        if failed_at is None:
            failed = [(rank, p) for rank, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed and all(p.exitcode > 0 for _, p in failed):
                # A rank killed by a signal closes its sockets before it can be reaped: its peers may exit with a
                # collective error first. Give the cause a moment to show before naming one.
                time.sleep(_SETTLE_SECONDS)
                failed = [(rank, p) for rank, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                # The cause, when several failed since the last poll: a rank killed by a signal (it recorded
                # nothing), else the one that caught its error first (the others' errors are consequences).
                rank, p = min(failed, key=lambda rp: (rp[1].exitcode > 0, progress.failed_at(shared, rp[0])))
                failed_at, status = time.monotonic(), _shell_status(p.exitcode)
                running = sum(q.exitcode is None for q in procs)
                also = "".join(f"; rank {r} {_how(q.exitcode)} after it" for r, q in failed if r != rank)
                _say(f"rank {rank} (pid {p.pid}) {_how(p.exitcode)} during {progress.describe_shared(shared, rank)}"
                     f"{also}; stopping the job: {running} other rank(s) get {grace_seconds:g} s to exit, "
                     "then are killed")
        elif time.monotonic() > failed_at + grace_seconds:
            for rank, p in enumerate(procs):
                if p.exitcode is None:
                    _say(f"rank {rank} (pid {p.pid}) still running {grace_seconds:g} s after the failure, during "
                         f"{progress.describe_shared(shared, rank)}; killing it")
                    _kill_group(p.pid, signal.SIGKILL)
            for p in procs:
                p.join()
            break
        time.sleep(_POLL_SECONDS)
    if failed_at is not None:
        _say(f"all ranks stopped {time.monotonic() - failed_at:.2f} s after the first failure")
    return status or next((_shell_status(p.exitcode) for p in procs if p.exitcode), 0)
