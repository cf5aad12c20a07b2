"""An ordered trace of communication posts/waits and kernel calls, for tests that guard overlap.

Overlap is a property of *order*: an exchange overlaps a kernel call only if it was
posted before the call and waited on after it. ``record_trace()`` collects
``(kind, name, label)`` events in program order (kind is 'post', 'wait' or 'kernel');
outside it ``trace_event`` is one global lookup, so it stays in production code.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Tuple

Event = Tuple[str, str, object]

_EVENTS: Optional[List[Event]] = None


def trace_event(kind: str, name: str, label: object = None) -> None:
    """Append one event while a ``record_trace()`` block is active."""
    if _EVENTS is not None:
        _EVENTS.append((kind, name, label))


@contextlib.contextmanager
def record_trace() -> Iterator[List[Event]]:
    """Collect this process's events inside the ``with`` block into the yielded list."""
    global _EVENTS
    previous, _EVENTS = _EVENTS, []
    events = _EVENTS
    try:
        yield events
    finally:
        _EVENTS = previous
