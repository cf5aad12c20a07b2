"""Byte counters for every collective this package issues, split intra-/inter-node.

Counting is a few integer additions per message, so it stays on in production;
tests, tools and the training log read it. Each count is keyed by the operation
("ulysses_a2a", "ring_kv", "ring_dkv", ...) and by whether the peer is on the same node.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Iterator, Tuple


@dataclass
class CommStats:
    """Bytes this rank sent and received, by (operation, 'intra'|'inter')."""

    sent: Dict[Tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    received: Dict[Tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    messages: int = 0

    def _total(self, table: Dict[Tuple[str, str], int], where: str, op: str = "") -> int:
        return sum(v for (o, w), v in table.items() if w == where and (not op or o.startswith(op)))

    def send_bytes(self, where: str, op: str = "") -> int:
        """Bytes sent to peers ``where`` in ('intra', 'inter'); ``op`` filters by operation-name prefix."""
        return self._total(self.sent, where, op)

    def recv_bytes(self, where: str, op: str = "") -> int:
        return self._total(self.received, where, op)

    @property
    def send_bytes_intra(self) -> int:
        return self.send_bytes("intra")

    @property
    def send_bytes_inter(self) -> int:
        return self.send_bytes("inter")

    @property
    def recv_bytes_intra(self) -> int:
        return self.recv_bytes("intra")

    @property
    def recv_bytes_inter(self) -> int:
        return self.recv_bytes("inter")

    def copy(self) -> "CommStats":
        out = CommStats()
        out.sent.update(self.sent)
        out.received.update(self.received)
        out.messages = self.messages
        return out

    def minus(self, earlier: "CommStats") -> "CommStats":
        out = CommStats()
        for key in set(self.sent) | set(earlier.sent):
            out.sent[key] = self.sent.get(key, 0) - earlier.sent.get(key, 0)
        for key in set(self.received) | set(earlier.received):
            out.received[key] = self.received.get(key, 0) - earlier.received.get(key, 0)
        out.messages = self.messages - earlier.messages
        return out

    def summary(self) -> Dict[str, int]:
        return {"send_bytes_intra": self.send_bytes_intra, "send_bytes_inter": self.send_bytes_inter,
                "recv_bytes_intra": self.recv_bytes_intra, "recv_bytes_inter": self.recv_bytes_inter}


_STATS = CommStats()


def record_send(op: str, nbytes: int, intra: bool) -> None:
    """Count one outgoing message of ``nbytes`` bytes (zero-byte messages are never sent)."""
    _STATS.sent[(op, "intra" if intra else "inter")] += nbytes
    _STATS.messages += 1


def record_recv(op: str, nbytes: int, intra: bool) -> None:
    _STATS.received[(op, "intra" if intra else "inter")] += nbytes


def comm_stats() -> CommStats:
    """A snapshot of this rank's counters since the process started (or the last reset)."""
    return _STATS.copy()


def reset_comm_stats() -> None:
    global _STATS
    _STATS = CommStats()


@contextlib.contextmanager
def count_comm() -> Iterator[CommStats]:
    """Counts inside the ``with`` block; the yielded object is filled in when the block exits."""
    before = comm_stats()
    result = CommStats()
    try:
        yield result
    finally:
        delta = comm_stats().minus(before)
        result.sent.update(delta.sent)
        result.received.update(delta.received)
        result.messages = delta.messages
