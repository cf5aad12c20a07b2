"""Run a test body on N gloo ranks, reusing warm worker processes across tests.

Starting 8 fresh torch processes costs ~15 s on the CI machine, so every world
size keeps one pool of workers for the whole pytest session. A worker joins a
gloo process group once, then executes ``(fn, args, kwargs)`` jobs sent through a
pipe and cleans up Megatron's (and this package's) parallel state after each.

Failure handling, so that one broken test never hangs or poisons the next:
- a rank that raises: the call fails with an AssertionError that holds every
  failing rank's traceback; the other ranks get ``GRACE_SECONDS`` to finish
  (they may be stuck in a collective with the failed rank), then the whole pool
  is killed and respawned on next use;
- ``timeout`` expires: the pool is killed and the message names the ranks that
  did not finish.
Any failure discards the pool (a rank that failed half-way through a p2p
exchange could leave stale messages behind). Tests that *expect* an exception
should catch it inside ``fn`` (``with pytest.raises(...)``) and return normally.

Point-to-point tags are forced to 0 in every worker (``force_p2p_tags_to_zero``): gloo then
matches the messages between two ranks in posting order, as NCCL always does, so a
protocol that relies on tags fails here instead of hanging on GPUs.

Workers are forked from a forkserver that has torch and Megatron-Core preloaded
(``tests.cli_runs.PRELOAD``, shared with the warm command-line runs), which makes
(re)starting a pool cheap. Set ``HSAP_TEST_FRESH_WORKERS=1`` to give every call
its own fresh pool, or call ``run_distributed_fresh`` for one call.
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import sys
import time
import traceback
from typing import Any, Callable, Dict, List

from tests.cli_runs import forkserver_context

#: Seconds the other ranks get to finish after the first rank failed.
GRACE_SECONDS = 10.0
#: Seconds a new pool may take to start and join its process group.
STARTUP_TIMEOUT = 120.0
#: Environment variable: "1" runs every call on a fresh, non-pooled set of workers.
FRESH_ENV = "HSAP_TEST_FRESH_WORKERS"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cleanup_parallel_state() -> None:
    """Undo what a test body set up, for the modules it actually imported, and destroy every
    process group it created: Megatron creates dozens per initialisation and each gloo group
    keeps its own threads, so a long-lived worker would otherwise accumulate hundreds."""
    for module_name in ("megatron_hsap.parallel_state", "megatron.core.parallel_state"):
        module = sys.modules.get(module_name)
        destroy = getattr(module, "destroy_model_parallel", None)
        if destroy is not None:
            destroy()
    import gc

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    gc.collect()  # tracebacks kept by pytest.raises form cycles that still reference groups
    if dist.is_initialized():
        default = distributed_c10d._get_default_group()
        for group in list(distributed_c10d._world.pg_map):
            if group is not default:
                dist.destroy_process_group(group)


def force_p2p_tags_to_zero() -> None:
    """Make every ``dist.P2POp`` carry tag 0, whatever its caller asked for (NCCL ignores tags)."""
    import torch.distributed as dist

    if getattr(dist.P2POp, "_hsap_tag_zero", False):
        return
    original = dist.P2POp.__init__

    def init_with_tag_zero(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.tag = 0

    dist.P2POp.__init__ = init_with_tag_zero
    dist.P2POp._hsap_tag_zero = True


def _worker_main(rank: int, world_size: int, port: int, conn: multiprocessing.connection.Connection) -> None:
    """Worker loop: join the gloo group, then run pickled jobs until told to stop (None)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    force_p2p_tags_to_zero()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc(), False)))
        return
    conn.send_bytes(pickle.dumps(("ready", None, False)))
    while True:
        try:
            job = conn.recv_bytes()
        except EOFError:
            break
        if not job:
            break
        status, payload = "ok", None
        try:
            fn, args, kwargs = pickle.loads(job)
            payload = pickle.dumps(fn(*args, **kwargs))
        except BaseException:
            status, payload = "error", traceback.format_exc()
        try:
            _cleanup_parallel_state()
        except BaseException:
            if status == "ok":
                status, payload = "error", "cleanup after the test body failed:\n" + traceback.format_exc()
        # a body that tore down the default group leaves this worker unusable: ask to be retired
        conn.send_bytes(pickle.dumps((status, payload, not dist.is_initialized())))
    if dist.is_initialized():
        dist.destroy_process_group()


class _Pool:
    """``world_size`` worker processes that share one gloo process group."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        ctx = forkserver_context()
        port = _free_port()
        self.procs: List[multiprocessing.process.BaseProcess] = []
        self.conns: List[multiprocessing.connection.Connection] = []
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, world_size, port, child_end), daemon=True,
                               name=f"hsap-test-rank{rank}")
            proc.start()
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
        replies = self._collect(STARTUP_TIMEOUT, GRACE_SECONDS)
        failed = {r: msg for r, (status, msg, _) in replies.items() if status != "ready"}
        if failed or len(replies) < world_size:
            self.kill()
            missing = sorted(set(range(world_size)) - set(replies))
            raise RuntimeError(f"could not start {world_size} gloo workers (missing ranks {missing}):\n"
                               + "\n".join(f"rank {r}:\n{m}" for r, m in sorted(failed.items())))

    def _collect(self, timeout: float, grace: float) -> Dict[int, tuple]:
        """One reply per rank until all replied, ``timeout`` passed, or ``grace`` after a first error."""
        deadline = time.monotonic() + timeout
        replies: Dict[int, tuple] = {}
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for conn in multiprocessing.connection.wait(list(pending), remaining):
                rank = pending.pop(conn)
                try:
                    replies[rank] = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self.procs[rank].join(1.0)
                    replies[rank] = ("error", f"worker process died (exit code {self.procs[rank].exitcode})", True)
                if replies[rank][0] == "error":
                    deadline = min(deadline, time.monotonic() + grace)
        return replies

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> List[Any]:
        job = pickle.dumps((fn, args, kwargs))
        try:
            for conn in self.conns:
                conn.send_bytes(job)
            replies = self._collect(timeout, GRACE_SECONDS)
        except BaseException:  # interrupted (Ctrl-C, pytest-timeout): workers are mid-job, unusable
            self.kill()
            raise
        errors = {r: msg for r, (status, msg, _) in replies.items() if status == "error"}
        missing = sorted(set(range(self.world_size)) - set(replies))
        healthy = not errors and not missing and not any(retire for _, _, retire in replies.values())
        if not healthy:
            self.kill()
        if errors or missing:
            parts = [f"{getattr(fn, '__qualname__', repr(fn))} failed on {self.world_size} ranks"]
            parts += [f"--- rank {r} raised:\n{msg}" for r, msg in sorted(errors.items())]
            if missing and errors:
                parts.append(f"--- ranks {missing} did not finish within {GRACE_SECONDS:g} s after the failure "
                             "(probably waiting in a collective); the worker pool was killed")
            elif missing:
                parts.append(f"--- timed out after {timeout:g} s: ranks {missing} did not finish; "
                             "the worker pool was killed")
            raise AssertionError("\n".join(parts))
        return [pickle.loads(replies[r][1]) for r in range(self.world_size)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def shutdown(self) -> None:
        """Ask workers to leave their process group and exit; kill those that do not."""
        for conn in self.conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        for proc in self.procs:
            proc.join(5.0)
        self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5.0)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []


_pools: Dict[int, _Pool] = {}


def _start_pool(world_size: int) -> _Pool:
    """A new pool; retried once because the free port can be taken between probing and binding."""
    try:
        return _Pool(world_size)
    except RuntimeError:
        return _Pool(world_size)


def _check_call(fn: Callable, world_size: int, timeout: float) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    qualname = getattr(fn, "__qualname__", "")
    if not callable(fn) or "<" in qualname or "." in qualname:
        raise ValueError(f"fn must be a module-level function (workers import it by name), got {fn!r}")


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120, **kwargs: Any) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks and return the per-rank results (rank order).

    ``fn`` must be a module-level function; arguments and results travel by pickle.
    Each rank sees RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE and an initialised default
    process group. Raises AssertionError with the failing ranks' tracebacks on failure or timeout.
    """
    _check_call(fn, world_size, timeout)
    if os.environ.get(FRESH_ENV) == "1":
        return run_distributed_fresh(fn, world_size, *args, timeout=timeout, **kwargs)
    pool = _pools.get(world_size)
    if pool is None or not pool.alive:
        if pool is not None:
            pool.kill()
        pool = _pools[world_size] = _start_pool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout)
    finally:
        if not pool.procs:  # killed after a failure: respawn on next use
            _pools.pop(world_size, None)


def run_distributed_fresh(fn: Callable, world_size: int, *args: Any, timeout: float = 120,
                          **kwargs: Any) -> List[Any]:
    """Like ``run_distributed`` but on new worker processes that are shut down afterwards."""
    _check_call(fn, world_size, timeout)
    pool = _start_pool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout)
    finally:
        pool.shutdown()


def shutdown_pools() -> None:
    """Stop every pooled worker (called at the end of the pytest session and at exit)."""
    while _pools:
        _pools.popitem()[1].shutdown()


atexit.register(shutdown_pools)
