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
