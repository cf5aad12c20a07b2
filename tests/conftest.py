"""Test-suite setup: make ``tests.distributed``/``tests.reference`` importable and stop worker pools at the end."""

from __future__ import annotations

import os
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


@pytest.fixture(scope="session", autouse=True)
def _shutdown_distributed_workers():
    """Pooled gloo workers (tests/distributed.py) live for the session; stop them when it ends."""
    yield
    from tests.distributed import shutdown_pools

    shutdown_pools()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """``--data-cache-path`` of the session's training runs. A cached dataset index is keyed by the data's content
    and the dataset's configuration (tests/test_reliability.py checks it), so the runs of one configuration (the
    tiny GPT of tests/test_fault_tolerance.py, in several modules) build it once, not once per module."""
    return str(tmp_path_factory.mktemp("hsap_cache"))
