"""Megatron-Bridge tests: collected only where megatron-bridge is installed (``make test-bridge`` uses
.venv-bridge); the main suite's environment skips this directory without importing anything from it.

Workers of tests/distributed.py are forked from a forkserver; adding ``tests.bridge.bridge_cases`` to
its preload list (``tests.cli_runs.PRELOAD``) imports Bridge (~1 min on a busy 2-core machine) once
instead of once per rank.
"""

import importlib.util

import pytest

if importlib.util.find_spec("megatron.bridge") is None:
    collect_ignore_glob = ["*"]

    class _BridgeNotInstalled(pytest.Item):
        """One skipped line in the summary for the directory, so its tests are not left out silently."""

        def runtest(self) -> None:
            pytest.skip("tests/bridge not collected: megatron-bridge is not installed here (`make test-bridge` "
                        "runs them in .venv-bridge)")

        def reportinfo(self):
            return self.path, None, self.name

    def pytest_collection_modifyitems(session, config, items) -> None:
        if not config.getoption("keyword") and not config.getoption("markexpr"):
            items.append(_BridgeNotInstalled.from_parent(session, name="tests/bridge"))
else:
    from tests import cli_runs

    if "tests.bridge.bridge_cases" not in cli_runs.PRELOAD:
        cli_runs.PRELOAD.append("tests.bridge.bridge_cases")
