"""Integrity checks of Megatron indexed datasets (``prefix.bin`` + ``prefix.idx``) before training reads them.

Megatron-Core memory-maps the files and trusts the index: a truncated ``.bin``, an
index of another dtype than the data, or token ids beyond the vocabulary would
crash deep inside numpy or the embedding, or train silently on garbage. These
checks read only the index and the file sizes (``check_indexed_dataset``, every
rank, before any process group exists) or scan the tokens once
(``token_id_range``, one rank, before training).
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import List, Tuple

import numpy

__all__ = ["check_indexed_dataset", "token_id_range", "check_token_ids", "dataset_fingerprint"]

_HEADER = b"MMIDIDX\x00\x00"
_HEADER_BYTES = 34  # magic (9) + version (8) + dtype code (1) + sequence count (8) + document count (8)
_DTYPES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64, 6: numpy.float64,
           7: numpy.float32, 8: numpy.uint16}
_SCAN_TOKENS = 1 << 24  # tokens per chunk of the vocabulary scan
_HASH_CHUNK = 1 << 24  # bytes per read of the index hash


def check_indexed_dataset(prefix: str) -> numpy.dtype:
    """The token dtype of ``prefix``; ValueError naming the file when the index or the data is damaged."""
    idx, data = prefix + ".idx", prefix + ".bin"
    idx_bytes = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(_HEADER_BYTES)
    if len(head) < _HEADER_BYTES or head[:9] != _HEADER:
        problem = "truncated header" if len(head) < _HEADER_BYTES else "bad magic bytes"
        raise ValueError(f"{idx} is not a Megatron indexed-dataset index ({problem}); rebuild it with "
                         "tools/preprocess_data.py")
    version, code, sequences, documents = struct.unpack("<QBQQ", head[9:])
    if version != 1 or code not in _DTYPES:
        raise ValueError(f"{idx}: unsupported index (version {version}, dtype code {code})")
    dtype = numpy.dtype(_DTYPES[code])
    if dtype.kind == "f":
        raise ValueError(f"{idx}: token dtype {dtype} is not an integer type")
    expected = _HEADER_BYTES + 12 * sequences + 8 * documents
    if idx_bytes not in (expected, expected + sequences):  # + one mode byte per sequence for multimodal data
        raise ValueError(f"{idx} is {idx_bytes} bytes but its header describes {sequences} sequences and "
                         f"{documents} document boundaries ({expected} bytes): the index is truncated or damaged")
    sizes, pointers, doc_idx = _entries(idx, sequences, documents)
    _check_sizes_and_documents(idx, sizes, doc_idx, sequences)
    data_bytes = os.path.getsize(data)
    needed = 0
    if sequences:
        last_size = numpy.fromfile(idx, dtype=numpy.int32, count=1, offset=_HEADER_BYTES + 4 * (sequences - 1))[0]
        last_pointer = numpy.fromfile(idx, dtype=numpy.int64, count=1,
                                      offset=_HEADER_BYTES + 4 * sequences + 8 * (sequences - 1))[0]
        needed = int(last_pointer) + int(last_size) * dtype.itemsize
    if data_bytes != needed:
        hint = "truncated" if data_bytes < needed else "longer than its index"
        for other in (1, 2, 4, 8):
            if other != dtype.itemsize and data_bytes * dtype.itemsize == needed * other:
                hint = (f"its size fits {other}-byte tokens: written with another dtype than the index's "
                        f"{dtype.name}?")
        raise ValueError(f"{data} is {data_bytes} bytes but {idx} describes {sequences} sequences of {dtype.name} "
                         f"tokens ending at byte {needed} ({hint}); rebuild both with tools/preprocess_data.py")
    _check_pointers(idx, data, data_bytes, sizes, pointers, dtype.itemsize)
    return dtype


def _entries(idx: str, sequences: int, documents: int) -> Tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
    """The index's sequence sizes (int32), byte pointers (int64) and document index (int64), memory-mapped."""
    def view(dtype: type, offset: int, count: int) -> numpy.ndarray:
        if not count:
            return numpy.zeros(0, dtype)
        return numpy.memmap(idx, dtype=dtype, mode="r", offset=offset, shape=(count,))

    return (view(numpy.int32, _HEADER_BYTES, sequences), view(numpy.int64, _HEADER_BYTES + 4 * sequences, sequences),
            view(numpy.int64, _HEADER_BYTES + 12 * sequences, documents))


def _check_sizes_and_documents(idx: str, sizes: numpy.ndarray, doc_idx: numpy.ndarray, sequences: int) -> None:
    """No negative sequence size; the document index rises from 0 to the sequence count (vectorised)."""
    negative = numpy.flatnonzero(sizes < 0)
    if len(negative):
        i = int(negative[0])
        raise ValueError(f"{idx}: sequence {i} has a negative size ({int(sizes[i])} tokens; {len(negative)} such): "
                         "the index is damaged; rebuild it with tools/preprocess_data.py")
    if len(doc_idx):
        wild = numpy.flatnonzero((doc_idx < 0) | (doc_idx > sequences))
        falls = numpy.flatnonzero(numpy.diff(doc_idx) < 0)
        wrong = (int(wild[0]) if len(wild) else 0 if doc_idx[0] != 0 else int(falls[0]) + 1 if len(falls)
                 else len(doc_idx) - 1 if doc_idx[-1] != sequences else None)
        if wrong is not None:
            raise ValueError(f"{idx}: document-index entry {wrong} is {int(doc_idx[wrong])}; the entries must rise "
                             f"from 0 to the sequence count ({sequences}): the index is damaged or claims documents "
                             "it does not hold; rebuild it with tools/preprocess_data.py")


def _check_pointers(idx: str, data: str, data_bytes: int, sizes: numpy.ndarray, pointers: numpy.ndarray,
                    itemsize: int) -> None:
    """Every sequence lies inside ``data`` (vectorised)."""
    outside = numpy.flatnonzero((pointers < 0) | (pointers > data_bytes - sizes.astype(numpy.int64) * itemsize))
    if len(outside):
        i = int(outside[0])
        raise ValueError(f"{idx}: sequence {i} ({int(sizes[i])} tokens at byte {int(pointers[i])}; {len(outside)} "
                         f"such) lies outside {data} ({data_bytes} bytes): the index is damaged; rebuild both with "
                         "tools/preprocess_data.py")


def token_id_range(prefix: str) -> Tuple[int, int]:
    """Smallest and largest token id in ``prefix.bin`` (a chunked scan of the whole file; (0, -1) if empty)."""
    dtype = check_indexed_dataset(prefix)
    tokens = numpy.memmap(prefix + ".bin", dtype=dtype, mode="r")
    if len(tokens) == 0:
        return 0, -1
    chunks = [tokens[start:start + _SCAN_TOKENS] for start in range(0, len(tokens), _SCAN_TOKENS)]
    return min(int(c.min()) for c in chunks), max(int(c.max()) for c in chunks)


def check_token_ids(prefix: str, vocab_size: int) -> None:
    """ValueError naming the dataset when a token id of ``prefix`` is negative or >= ``vocab_size``."""
    low, high = token_id_range(prefix)
    if high >= vocab_size or low < 0:
        bad = high if high >= vocab_size else low
        raise ValueError(f"{prefix}.bin holds token id {bad}, outside the tokenizer's vocabulary [0, {vocab_size}) "
                         "(--vocab-size / --tokenizer-type): the data was tokenized with another vocabulary")


def dataset_fingerprint(prefixes: List[str]) -> str:
    """16 hex digits that change when any dataset of ``prefixes`` is rewritten: each ``.idx`` and ``.bin``'s size
    and modification time, and a hash of each ``.idx`` (sequence sizes, pointers, document boundaries)."""
    digest = hashlib.blake2b(digest_size=8)
    for prefix in prefixes:
        if not (os.path.isfile(prefix + ".idx") and os.path.isfile(prefix + ".bin")):
            digest.update(f"{prefix}: missing;".encode())  # the dataset builder names it
            continue
        for ext in (".idx", ".bin"):
            stat = os.stat(prefix + ext)
            digest.update(f"{prefix}{ext}:{stat.st_size}:{stat.st_mtime_ns};".encode())
        with open(prefix + ".idx", "rb") as f:
            for block in iter(lambda: f.read(_HASH_CHUNK), b""):
                digest.update(block)
    return digest.hexdigest()
