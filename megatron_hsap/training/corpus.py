"""The embedded default corpus: the Python standard library's sources as a Megatron indexed dataset.

Every machine with Python has it. Real pretraining and fine-tuning mixes pack many short
documents next to a few long ones, so the stdlib is cut the way a code corpus of
functions and files is (``source_documents``): every top-level function, every method,
each class's remaining body and each run of other top-level statements is one document,
and every ``WHOLE_FILE_EVERY``-th file is also kept whole (the long tail, longer than a
sample). Generated data tables (``GENERATED_DATA``: codec tables, the pydoc topic dump,
the build's sysconfig data) are left out: they are data, not text, and one of them
alone would fill hundreds of samples. ``docs/training.md`` gives the resulting
documents per sample.

Documents are byte-level tokenized (token id = byte value) and each ends with the
tokenizer's EOD id, exactly what ``tools/preprocess_data.py --append-eod`` writes.
The order is fixed (sorted paths, source order), so every machine with the same Python
builds the same dataset, in a few seconds.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sys
import sysconfig
from typing import Iterable, Iterator, List, Sequence

import torch

__all__ = ["stdlib_source_files", "source_documents", "stdlib_documents", "write_indexed_dataset",
           "ensure_stdlib_corpus", "default_cache_dir", "WHOLE_FILE_EVERY", "GENERATED_DATA"]

#: Every this-many-th source file (in ``stdlib_source_files`` order) is also a document as a whole.
WHOLE_FILE_EVERY = 8
#: Path fragments of generated data modules left out of the corpus.
GENERATED_DATA = ("/encodings/", "/pydoc_data/", "/_sysconfigdata")
#: Bumped when the way files are cut into documents changes (part of the cache name).
_CORPUS_VERSION = 2


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
    return [p for p in paths if os.path.getsize(p) > 0 and not any(part in p for part in GENERATED_DATA)]


def _first_line(node: ast.stmt) -> int:
    """0-based first line of a statement, its decorators included."""
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1


def source_documents(source: bytes) -> List[bytes]:
    """One Python file's documents, in source order: each top-level function; each method, then the rest of
    its class (header, docstring, attributes); each run of the other top-level statements (with the
    comments and blank lines around them). Concatenated, they are the file without the blank-only runs
    between definitions (which are no documents).
    A file that does not parse is one document."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return [source]
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    documents: List[bytes] = []
    run_start = 0  # first line of the current run of other statements

    def take(first: int, last: int) -> None:
        if first < last:
            documents.append(source[offsets[first]:offsets[last]])

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            take(run_start, _first_line(node))
            take(_first_line(node), node.end_lineno)
            run_start = node.end_lineno
        elif isinstance(node, ast.ClassDef):
            take(run_start, _first_line(node))
            rest, cursor = [], _first_line(node)
            for member in node.body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    rest.append(source[offsets[cursor]:offsets[_first_line(member)]])
                    take(_first_line(member), member.end_lineno)
                    cursor = member.end_lineno
            rest.append(source[offsets[cursor]:offsets[node.end_lineno]])
            documents.append(b"".join(rest))
            run_start = node.end_lineno
    take(run_start, len(lines))
    return [d for d in documents if d.strip()]


def stdlib_documents(paths: Sequence[str]) -> Iterator[bytes]:
    """The corpus's documents of ``paths`` (see the module doc): each file's ``source_documents``, then the
    file itself when its index is a multiple of ``WHOLE_FILE_EVERY``."""
    for index, path in enumerate(paths):
        with open(path, "rb") as f:
            source = f.read()
        yield from source_documents(source)
        if index % WHOLE_FILE_EVERY == 0:
            yield source


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
    for document in stdlib_documents(paths):
        yield list(document) + [eod]


def ensure_stdlib_corpus(cache_dir: str, eod: int, vocab_size: int) -> str:
    """Build (once; cached by Python version and file list) the stdlib corpus; returns its path prefix.

    Call on one rank and barrier before the others read it.
    """
    paths = stdlib_source_files()
    if not paths:
        raise RuntimeError(f"no Python standard library sources found under {sysconfig.get_paths()['stdlib']}; "
                           "pass --data-path or --mock-data")
    digest = hashlib.sha1("\n".join(f"{p}:{os.path.getsize(p)}" for p in paths).encode()).hexdigest()[:12]
    prefix = os.path.join(cache_dir, f"stdlib_v{_CORPUS_VERSION}_py{sys.version_info[0]}{sys.version_info[1]}_"
                          f"{digest}_bytes_document")
    if not (os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")):
        os.makedirs(cache_dir, exist_ok=True)
        write_indexed_dataset(prefix, _byte_documents(paths, eod), vocab_size)
    return prefix
