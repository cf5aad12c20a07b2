"""Run ``pretrain_gpt_hsap.py``'s command line in a process forked from a warm forkserver.

A fresh interpreter spends ~6 s of a tiny 2-rank run (~7 s on the 2-core CI machine)
importing torch, Megatron-Core and the training loop before it parses a flag. The
end-to-end training tests run ~20 such runs, so ``run_warm`` forks each run from the
forkserver of ``tests/distributed.py``, which has those modules imported
(``PRELOAD``), and calls the script's ``main()`` there with the run's arguments,
environment, working directory, stdout and stderr. Everything after the imports is
the real command line: the launcher forks and watches the ranks as it does in a
fresh process.

What a fork cannot reproduce stays on ``subprocess`` (``run_fresh``): output printed
while importing (the demo test counts the console lines), the environment of
``/proc/<pid>/environ`` (the rank-kill test finds a run's processes by a variable
there), and torchrun.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import subprocess
import sys
import tempfile
import warnings
from typing import Dict, List

from megatron_hsap.training.launch import RANK_IMPORTS

#: Imported once by the forkserver (torch and Megatron-Core cost ~5 s per process, what the launcher imports for
#: its ranks ~2 s more), shared by the gloo worker pools and the warm CLI runs.
PRELOAD = ["torch", "torch.distributed", "megatron.core.parallel_state", *RANK_IMPORTS]


def forkserver_context() -> multiprocessing.context.BaseContext:
    """The forkserver context with ``PRELOAD`` (only the first call before the server starts sets it)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_fresh(script: str, argv: List[str], env: Dict[str, str], cwd: str, timeout: float
              ) -> subprocess.CompletedProcess:
    """``python script argv`` in a new interpreter."""
    return subprocess.run([sys.executable, script] + argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_warm(script: str, argv: List[str], env: Dict[str, str], cwd: str, timeout: float
             ) -> subprocess.CompletedProcess:
    """``python script argv`` as ``run_fresh`` returns it, forked from the warm forkserver; a run still going
    after ``timeout`` seconds is killed (its ranks die with it) and raises ``subprocess.TimeoutExpired``."""
    with tempfile.TemporaryDirectory(prefix="hsap-cli-") as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        proc = forkserver_context().Process(target=_script_main, args=(script, argv, env, cwd, out, err),
                                            name="hsap-test-cli")
        proc.start()
        try:
            proc.join(timeout)
        finally:  # also when interrupted (Ctrl-C, pytest-timeout): the run is a child of the forkserver, not ours
            timed_out = proc.exitcode is None
            if timed_out:
                proc.kill()
                proc.join()
        if timed_out:
            raise subprocess.TimeoutExpired([script] + argv, timeout, _read(out), _read(err))
        return subprocess.CompletedProcess([script] + argv, proc.exitcode, _read(out), _read(err))


def _read(path: str) -> str:
    """The captured stream ('' when the forked process died before it opened it)."""
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()


def _script_main(script: str, argv: List[str], env: Dict[str, str], cwd: str, out: str, err: str) -> None:
    """In the forked process: become ``python script argv`` with ``env`` and exit with the script's status."""
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("PYTHONWARNINGS", "ignore") not in ("ignore", ""):
        raise ValueError(f"PYTHONWARNINGS={env['PYTHONWARNINGS']!r}: only 'ignore' and '' are emulated; use "
                         "run_fresh")
    if env.get("PYTHONWARNINGS") == "ignore":  # what the interpreter would have read at startup
        warnings.simplefilter("ignore")
    elif env.get("PYTHONWARNINGS") == "":
        _default_warning_filters()
    sys.argv = [script] + argv
    spec = importlib.util.spec_from_file_location("_hsap_cli_script", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its ``if __name__ == "__main__"`` block does not run
    # As the interpreter: multiprocessing exits with a SystemExit's code (argparse's 2), prints an uncaught
    # error's traceback with status 1, and flushes stdout and stderr.
    sys.exit(module.main())


def _default_warning_filters() -> None:
    """The warning filters of a new interpreter without ``-W`` or ``PYTHONWARNINGS`` (CPython's ``warnings``
    defaults, release build), replacing the forkserver's; resetting them also forgets which warnings the
    forkserver has shown, so each shows again once. Warnings printed while the forkserver imported ``PRELOAD``
    are not repeated: a test that checks import-time warnings runs a fresh interpreter (``run_fresh``)."""
    warnings.resetwarnings()
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.filterwarnings("ignore", category=category, append=True)
