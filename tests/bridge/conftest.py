"""Megatron-Bridge tests: collected only where megatron-bridge is installed (``make test-bridge`` uses
.venv-bridge); the main suite's environment skips this directory without importing anything from it.

Workers of tests/distributed.py are forked from a forkserver; adding ``tests.bridge.bridge_cases`` to
its preload list (``tests.cli_runs.PRELOAD``) imports Bridge (~1 min on a busy 2-core machine) once
instead of once per rank.
"""

import importlib.util

if importlib.util.find_spec("megatron.bridge") is None:
    collect_ignore_glob = ["*"]
else:
    from tests import cli_runs

    if "tests.bridge.bridge_cases" not in cli_runs.PRELOAD:
        cli_runs.PRELOAD.append("tests.bridge.bridge_cases")
