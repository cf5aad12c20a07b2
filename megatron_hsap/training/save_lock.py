"""One job per ``--save`` directory: an exclusive ``fcntl.flock`` on ``<save>/.hsap_lock`` for the job's life.

Two jobs writing the same directory would overwrite each other's checkpoints and
tracker. The launcher (or torchrun's rank 0) takes the lock before any rank starts;
a second job fails at start-up with the first one's pid, host and start time, which
the holder writes into the lock file. The kernel releases the lock when the holder
and every process that inherited the descriptor exit, even after a SIGKILL.
Taking the lock also checks that ``--save`` is a writable directory (created if
missing), so a bad path fails at start-up rather than at the first save.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from typing import IO

__all__ = ["LOCK_FILE", "lock_save_directory"]

LOCK_FILE = ".hsap_lock"


def lock_save_directory(save: str) -> IO[str]:
    """Lock ``save`` for this job; keep the returned file open for the job's life. ValueError naming the path
    when ``save`` is not a writable directory or another job holds it (naming that job)."""
    try:
        os.makedirs(save, exist_ok=True)
        handle = open(os.path.join(save, LOCK_FILE), "a+")
    except OSError as err:
        raise ValueError(f"--save {save!r} is not a writable directory ({err.strerror or err})") from err
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ValueError(f"--save {save!r} is in use by another job ({holder}); two jobs would overwrite each "
                         "other's checkpoints") from err
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime())}\n")
    handle.flush()
    return handle
