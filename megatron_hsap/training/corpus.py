"""The embedded default corpus: the Python standard library's source files as a Megatron indexed dataset.

Every machine with Python has it; its files are real documents with a heavy-tailed
length distribution, which is what packed-sequence context parallelism is about.
Documents are byte-level tokenized (token id = byte value) and each ends with the
tokenizer's EOD id, exactly what ``tools/preprocess_data.py --append-eod`` writes.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from typing import Iterable, Iterator, List

import torch

__all__ = ["stdlib_source_files", "write_indexed_dataset", "ensure_stdlib_corpus", "default_cache_dir"]


def default_cache_dir() -> str:
    """``$MEGATRON_HSAP_CACHE`` or ``~/.cache/megatron_hsap``: where the corpus and dataset indices are kept."""
    return os.environ.get("MEGATRON_HSAP_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "megatron_hsap"))


def stdlib_source_files() -> List[str]:
    """Paths of the standard library's ``.py`` files in a fixed order (no tests, no site-packages)."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__", "test", "tests"))
        paths.extend(os.path.join(dirpath, n) for n in sorted(filenames) if n.endswith(".py"))
    return [p for p in paths if os.path.getsize(p) > 0]


def write_indexed_dataset(prefix: str, documents: Iterable[List[int]], vocab_size: int) -> int:
    """Write token-id documents (each already ending in EOD if wanted) as ``prefix.bin/.idx``; returns the count.

    Written to temporary names first and renamed, so a reader never sees half a dataset.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=DType.optimal_dtype(vocab_size))
    count = 0
    for doc in documents:
        builder.add_item(torch.tensor(doc, dtype=torch.int64))
        builder.end_document()
        count += 1
    builder.finalize(tmp + ".idx")
    os.replace(tmp + ".bin", prefix + ".bin")
    os.replace(tmp + ".idx", prefix + ".idx")
    return count


def _byte_documents(paths: List[str], eod: int) -> Iterator[List[int]]:
    for path in paths:
        with open(path, "rb") as f:
            yield list(f.read()) + [eod]


def ensure_stdlib_corpus(cache_dir: str, eod: int, vocab_size: int) -> str:
    """Build (once; cached by Python version and file list) the stdlib corpus; returns its path prefix.

    Call on one rank and barrier before the others read it.
    """
    paths = stdlib_source_files()
    if not paths:
        raise RuntimeError(f"no Python standard library sources found under {sysconfig.get_paths()['stdlib']}; "
                           "pass --data-path or --mock-data")
    digest = hashlib.sha1("\n".join(f"{p}:{os.path.getsize(p)}" for p in paths).encode()).hexdigest()[:12]
    prefix = os.path.join(cache_dir, f"stdlib_py{sys.version_info[0]}{sys.version_info[1]}_{digest}_bytes_document")
    if not (os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")):
        os.makedirs(cache_dir, exist_ok=True)
        write_indexed_dataset(prefix, _byte_documents(paths, eod), vocab_size)
    return prefix
