"""TEST-ONLY fault injection for the failure tests (tests/test_fault_tolerance.py); inert unless the variable is set.

``HSAP_TEST_FAULT="<kind>@<rank>:<iteration>[,...]"`` makes rank ``<rank>`` misbehave
at iteration ``<iteration>``:

| kind | where | what |
|---|---|---|
| ``kill`` | forward | SIGKILL itself (a crash that leaves no message) |
| ``stop`` | forward | SIGSTOP itself, and stay there once continued (a rank that stops advancing without dying) |
| ``raise`` | forward | raise RuntimeError (an exception in one rank's forward) |
| ``SIGTERM``, ``SIGUSR1``, ``SIGINT`` | forward | send itself the signal (preemption; SIGINT: Ctrl-C) |
| ``parent-SIGTERM``, ``parent-SIGUSR1`` | forward | send the signal to its parent, the ``--nproc`` launcher |
| ``group-SIGTERM``, ``group-SIGUSR1`` | forward | send the signal to its process group: itself and its helpers |
| ``parent-SIGTERM-in-save``, ``parent-SIGUSR1-in-save`` | save | the same after writing its checkpoint shards |
| ``nan-attention`` | forward | write NaN into the last local layer's ``linear_qkv`` weight |
| ``nan-loss`` | forward | write NaN into the micro-batch's loss mask |
| ``kill-in-save`` | save | SIGKILL itself after writing its checkpoint shards, before the save completes |
| ``disk-full-in-save`` | before-save | its checkpoint writer fails with ``OSError(ENOSPC)`` (a full disk) |

Not a user feature: it exists so that tests exercise real failures (a real SIGKILL,
a real signal, a real NaN) at a deterministic point.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, List, Optional, Tuple

__all__ = ["ENV", "inject", "planned"]

ENV = "HSAP_TEST_FAULT"
_WHERE = {"kill": "forward", "stop": "forward", "raise": "forward", "SIGTERM": "forward", "SIGUSR1": "forward",
          "SIGINT": "forward", "group-SIGTERM": "forward", "group-SIGUSR1": "forward",
          "nan-attention": "forward", "nan-loss": "forward", "kill-in-save": "save",
          "parent-SIGTERM": "forward", "parent-SIGUSR1": "forward",
          "parent-SIGTERM-in-save": "save", "parent-SIGUSR1-in-save": "save", "disk-full-in-save": "before-save"}


def _parse(text: str) -> List[Tuple[str, int, int]]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            kind, at = item.split("@")
            rank, iteration = (int(x) for x in at.split(":"))
        except ValueError as err:
            raise ValueError(f"{ENV}: cannot parse {item!r}; expected <kind>@<rank>:<iteration>") from err
        if kind not in _WHERE:
            raise ValueError(f"{ENV}: unknown kind {kind!r}; allowed: {', '.join(_WHERE)}")
        faults.append((kind, rank, iteration))
    return faults


def planned(point: str, iteration: int) -> List[str]:
    """The fault kinds planned for this rank at ``point`` ('forward', 'before-save' or 'save') of ``iteration``."""
    text = os.environ.get(ENV)
    if not text:
        return []
    rank = int(os.environ.get("RANK", "0"))
    return [k for k, r, i in _parse(text) if r == rank and i == iteration and _WHERE[k] == point]


def inject(point: str, iteration: int, model: Optional[List[Any]] = None, loss_mask: Any = None) -> None:
    """Carry out the faults planned here (see the module doc); a no-op without ``HSAP_TEST_FAULT``."""
    for kind in planned(point, iteration):
        if kind in ("kill", "kill-in-save"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            # Continued (the stall watchdog continues a stopped rank so that it prints its stack): still stuck
            # here, so the stack names this point whichever thread prints it and however late.
            while True:
                time.sleep(3600)
        elif kind == "raise":
            raise RuntimeError(f"{ENV}: injected exception in the forward step of iteration {iteration}")
        elif kind in ("SIGTERM", "SIGUSR1", "SIGINT"):
            if kind == "SIGINT" and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
                # Started in the background (``cmd &`` in a script), a process inherits SIGINT ignored and Python
                # keeps it so; a Ctrl-C reaches a foreground process, where Python raises KeyboardInterrupt.
                signal.signal(signal.SIGINT, signal.default_int_handler)
            os.kill(os.getpid(), getattr(signal, kind))
        elif kind.startswith("parent-"):
            os.kill(os.getppid(), getattr(signal, kind.split("-")[1]))
        elif kind.startswith("group-"):
            os.killpg(0, getattr(signal, kind.split("-")[1]))
        elif kind == "nan-loss":
            loss_mask.fill_(float("nan"))
        elif kind == "nan-attention":
            import torch

            layers = [m for chunk in model for name, m in chunk.named_modules() if name.endswith("self_attention")]
            with torch.no_grad():
                layers[-1].linear_qkv.weight.view(-1)[0] = float("nan")
        elif kind == "disk-full-in-save":
            from megatron.core.dist_checkpointing.strategies import filesystem_async

            filesystem_async._write_item = _disk_full  # the writer processes are forked after this


def _disk_full(*args: Any, **kwargs: Any) -> None:
    """Stands in for torch's ``_write_item``: the write fails as on a full disk, naming the file."""
    import errno

    stream = next(a for a in args if hasattr(a, "fileno"))
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), stream.name)
