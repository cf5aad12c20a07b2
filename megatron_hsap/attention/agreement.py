"""Cross-rank agreement before the first collective of a batch: one error on every rank, never a hang.

A rank whose inputs are bad (or merely different: another ``cu_seqlens``, another head
count) must not let its peers enter an all-to-all or a ring exchange it will never join.
So every attention entry point validates locally *without raising*, then all CP ranks
exchange a small fingerprint (one hash per field that must agree, plus whether the local
checks failed) in one all_gather, and every rank raises the same ValueError naming the
ranks and fields that differ. The exchange runs once per (plan, call signature): the plan
object remembers what it verified, so the other layers of the batch pay nothing. It
needs every rank to call attention with its plans in the same order, which any correct
program does.
"""

from __future__ import annotations

import hashlib
from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron_hsap.parallel_state import CPTopology

__all__ = ["agree_across_cp_ranks"]

#: Fingerprint length is fixed, so ranks that fail early (with fewer fields known) still match shapes.
MAX_FIELDS = 15


def _hash(value: object) -> int:
    """A process-independent 63-bit hash (Python's hash() of str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 1


def _collective_device(topology: CPTopology, device: Optional[torch.device]) -> torch.device:
    if device is not None:
        return device
    if dist.get_backend(topology.cp_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_across_cp_ranks(topology: CPTopology, fields: Dict[str, object], local_error: Optional[ValueError],
                          device: Optional[torch.device], verified: Optional[set] = None) -> None:
    """Raise the same ValueError on every CP rank unless all of them passed their local checks and hold
    equal ``fields``; ``local_error`` is this rank's validation failure (None if it passed).

    device: where the fingerprint lives (take it from an input tensor; None = the backend's default).
    verified: a set owned by the plan; a signature already in it skips the exchange (and its host sync).
    """
    signature = _hash(sorted(fields.items()))
    if local_error is None and verified is not None and signature in verified:
        return
    if topology.cp_size == 1 or topology.cp_group is None:
        if local_error is not None:
            raise local_error
        return
    names = sorted(fields)
    if len(names) > MAX_FIELDS:
        raise ValueError(f"at most {MAX_FIELDS} fields can be agreed on, got {len(names)}")
    hashes = [_hash((n, fields[n])) for n in names] + [0] * (MAX_FIELDS - len(names))
    mine = torch.tensor([int(local_error is not None)] + hashes, dtype=torch.int64,
                        device=_collective_device(topology, device))
    gathered = [torch.empty_like(mine) for _ in range(topology.cp_size)]
    dist.all_gather(gathered, mine, group=topology.cp_group)
    table = torch.stack(gathered).cpu().tolist()
    failed = [c for c, row in enumerate(table) if row[0]]
    if local_error is not None:
        raise ValueError(f"{local_error} (inputs rejected on CP ranks {failed})") from local_error
    if failed:
        raise ValueError(f"CP rank(s) {failed} rejected their attention inputs (their error names the argument); "
                         "no collective was started on any rank")
    differing = []
    for i, name in enumerate(names, start=1):
        reference = table[0][i]
        ranks = [c for c, row in enumerate(table) if row[i] != reference]
        if ranks:
            differing.append(f"{name} (CP ranks {ranks} differ from CP rank 0)")
    if differing:
        raise ValueError("attention inputs must agree on every CP rank, but these differ: " + "; ".join(differing)
                         + "; no collective was started on any rank")
    if verified is not None:
        verified.add(signature)
