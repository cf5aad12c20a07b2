"""Realistic packed batches: document lengths sampled from real corpora, as cu_seqlens."""

from __future__ import annotations

import csv
import math
import os
import random
import sysconfig
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

import torch

_BUCKETS_CSV = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "doc_length_buckets.csv")


@lru_cache(maxsize=None)
def length_buckets() -> Tuple[Tuple[int, int, int], ...]:
    """(lo, hi, number_of_documents) rows of the shipped histogram (see megatron_hsap/data/README.md)."""
    rows = []
    with open(_BUCKETS_CSV, newline="") as f:
        for row in csv.DictReader(f):
            lo, hi = (int(x) for x in row["range"].strip("[]").split(","))
            rows.append((max(lo, 1), hi, int(row["number"])))
    return tuple(rows)


def sample_doc_lengths(total_tokens: int, seed: int = 0, max_doc_len: Optional[int] = None) -> List[int]:
    """Document lengths that pack exactly ``total_tokens`` tokens, drawn from the bucket histogram.

    A bucket is chosen by document count, a length uniformly inside it (capped at
    ``max_doc_len``), and the last document is cut so the lengths sum to ``total_tokens``.
    """
    if total_tokens < 0:
        raise ValueError(f"total_tokens={total_tokens} must be >= 0")
    rng = random.Random(seed)
    buckets = length_buckets()
    weights = [b[2] for b in buckets]
    lengths: List[int] = []
    remaining = total_tokens
    while remaining > 0:
        lo, hi, _ = rng.choices(buckets, weights=weights)[0]
        n = rng.randint(lo, hi)
        if max_doc_len is not None:
            n = min(n, max_doc_len)
        n = min(n, remaining)
        lengths.append(n)
        remaining -= n
    return lengths


def _packed(total_tokens: int, draw) -> List[int]:
    """Lengths ``draw()`` (each >= 1) until ``total_tokens`` are packed; the last one cut to fit."""
    if total_tokens < 0:
        raise ValueError(f"total_tokens={total_tokens} must be >= 0")
    lengths: List[int] = []
    remaining = total_tokens
    while remaining > 0:
        n = min(max(1, draw()), remaining)
        lengths.append(n)
        remaining -= n
    return lengths


def lognormal_doc_lengths(total_tokens: int, seed: int = 0, median: int = 3000, sigma: float = 1.5) -> List[int]:
    """Document lengths that pack exactly ``total_tokens`` tokens, log-normally distributed (``median``, ``sigma``
    of the log); the last document is cut so the lengths sum to ``total_tokens``."""
    if median < 1 or not sigma > 0:
        raise ValueError(f"median={median} must be >= 1 and sigma={sigma} > 0")
    rng = random.Random(seed)
    mu = math.log(median)
    return _packed(total_tokens, lambda: int(rng.lognormvariate(mu, sigma)))


def bimodal_doc_lengths(total_tokens: int, seed: int = 0, long_fraction: float = 0.1,
                        short: Tuple[int, int] = (200, 2000), long: Tuple[int, int] = (1 << 16, 1 << 19)) -> List[int]:
    """Document lengths that pack exactly ``total_tokens`` tokens: a fraction ``long_fraction`` of the documents
    uniform in ``long`` (64K-512K tokens), the others uniform in ``short`` (200-2,000); the last one cut."""
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"long_fraction={long_fraction} must be in [0, 1]")
    rng = random.Random(seed)
    return _packed(total_tokens, lambda: rng.randint(*(long if rng.random() < long_fraction else short)))


def pareto_doc_lengths(total_tokens: int, seed: int = 0, alpha: float = 1.1, minimum: int = 256) -> List[int]:
    """Document lengths that pack exactly ``total_tokens`` tokens, Pareto distributed (shape ``alpha``, scale
    ``minimum`` tokens: P(length > x) = (minimum / x) ** alpha); the last one cut."""
    if minimum < 1 or not alpha > 0:
        raise ValueError(f"minimum={minimum} must be >= 1 and alpha={alpha} > 0")
    rng = random.Random(seed)
    return _packed(total_tokens, lambda: int(min(minimum * rng.paretovariate(alpha), total_tokens)))


def stdlib_doc_lengths() -> List[int]:
    """Sizes in bytes of the Python standard library's source files: a real heavy-tailed corpus on every machine."""
    root = sysconfig.get_paths()["stdlib"]
    sizes = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__", "test", "tests"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                size = os.path.getsize(os.path.join(dirpath, name))
                if size > 0:
                    sizes.append(size)
    return sizes


def pack_lengths(lengths: Sequence[int], total_tokens: int, offset: int = 0) -> List[int]:
    """Take documents from ``lengths`` (cyclically from ``offset``) until ``total_tokens`` are packed; cut the last."""
    if not lengths:
        raise ValueError("lengths must not be empty")
    out: List[int] = []
    remaining, i = total_tokens, offset
    while remaining > 0:
        n = min(lengths[i % len(lengths)], remaining)
        out.append(n)
        remaining -= n
        i += 1
    return out


def cu_seqlens_from_lengths(lengths: Sequence[int]) -> torch.Tensor:
    """int32 ``[num_docs + 1]`` prefix sums: the packed batch's document boundaries."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        cu[1:] = torch.cumsum(torch.tensor(list(lengths), dtype=torch.int64), 0).to(torch.int32)
    return cu
