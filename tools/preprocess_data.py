#!/usr/bin/env python
"""Turn JSONL or a folder of text files into Megatron's indexed dataset format (``.bin`` + ``.idx``).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus --append-eod
    python tools/preprocess_data.py --input my_texts/ --output-prefix data/texts --append-eod \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model /path/to/local/tokenizer
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/gpt2 --json-keys text title \
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --tokenizer-type GPT2BPETokenizer \
        --append-eod --workers 4          # Megatron-LM's tools/preprocess_data.py command line

Writes ``<output-prefix>_<json-key>_document.{bin,idx}`` for each ``--json-keys`` key
(Megatron-LM's naming), one document per JSON line (or per file), ready for
``pretrain_gpt_hsap.py --data-path``. The default tokenizer is byte-level (token = byte,
EOD = 0): nothing is downloaded. Tokenizer flags are the trainer's (``--tokenizer-type``,
``--tokenizer-model``, ``--vocab-file``, ``--merge-file``, ``--vocab-size``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import sys
from typing import Any, Iterator, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hsap.training.quiet import quiet_rank  # noqa: E402

quiet_rank(0)  # Megatron-Core's optimizer notices (TE/Apex missing) say nothing about tokenizing

from megatron_hsap.training.arguments import add_tokenizer_args  # noqa: E402
from megatron_hsap.training.corpus import write_indexed_dataset  # noqa: E402
from megatron_hsap.training.tokenizer import build_tokenizer, resolve_tokenizer_type  # noqa: E402

#: Texts handed to the worker pool at a time (read, and checked, in the main process).
_BATCH = 256
#: The tokenizer the forked workers inherit.
_TOKENIZER: Any = None


def _texts(path: str, json_key: str) -> Iterator[str]:
    """Documents of a JSONL file (field ``json_key`` of each line) or of a folder (each file, sorted, recursively)."""
    if os.path.isdir(path):
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames.sort()
            for name in sorted(filenames):
                with open(os.path.join(dirpath, name), encoding="utf-8", errors="replace") as f:
                    yield f.read()
        return
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"--input {path}: line {number} is not valid JSON ({err})") from err
            if json_key not in record:
                raise ValueError(f"--input {path}: line {number} has no key {json_key!r} (see --json-keys)")
            yield record[json_key]


def _checked(docs: Iterator[List[int]], vocab_size: int) -> Iterator[List[int]]:
    """The documents, with a ValueError for a token id outside ``[0, vocab_size)`` (it would be stored wrapped)."""
    for number, doc in enumerate(docs, 1):
        bad = [t for t in doc if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"document {number} has token id {bad[0]}, outside the tokenizer's vocabulary "
                             f"[0, {vocab_size}) (--vocab-size)")
        yield doc


def _encode(text: str) -> List[int]:
    return _TOKENIZER.tokenize(text)


def _tokenized(texts: Iterator[str], workers: int, log_interval: int) -> Iterator[List[int]]:
    """Token ids of each text, in order; with ``workers`` > 1 a forked pool tokenizes batches of texts."""
    pool = multiprocessing.get_context("fork").Pool(workers) if workers > 1 else None
    try:
        done = 0
        while True:
            batch = list(itertools.islice(texts, _BATCH))
            if not batch:
                return
            yield from (pool.map(_encode, batch) if pool is not None else map(_encode, batch))
            if done // log_interval != (done + len(batch)) // log_interval:
                print(f"processed {done + len(batch)} documents", file=sys.stderr, flush=True)
            done += len(batch)
    finally:
        if pool is not None:
            pool.terminate()


def build_parser() -> argparse.ArgumentParser:
    """Megatron-LM's ``tools/preprocess_data.py`` flags (those without effect here are accepted, see help)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    g = p.add_argument_group("input")
    g.add_argument("--input", required=True, help="a .jsonl file or a folder of text files")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="JSONL fields to write, one dataset each")
    g.add_argument("--split-sentences", action="store_true", help="not supported (an error)")
    g.add_argument("--keep-newlines", action="store_true", help="only with --split-sentences; no effect here")
    g.add_argument("--lang", default="english", help="only with --split-sentences; no effect here")
    g = p.add_argument_group("tokenizer")
    add_tokenizer_args(g)
    g.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True)
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    g.add_argument("--partitions", type=int, default=1, help="only 1 is supported")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines (stderr)")
    g.add_argument("--keep-sequential-samples", action="store_true", help="no effect with one partition")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    global _TOKENIZER
    p = build_parser()
    args = p.parse_args(argv)
    if not os.path.exists(args.input):
        p.error(f"--input {args.input!r} does not exist")
    if args.partitions != 1:
        p.error(f"--partitions {args.partitions} is not supported; allowed: 1")
    if args.split_sentences:
        p.error("--split-sentences is not supported (documents are not split into sentences)")
    if args.workers < 1 or args.log_interval < 1:
        p.error("--workers and --log-interval must be positive")
    if os.path.isdir(args.input) and len(args.json_keys) > 1:
        p.error("--json-keys: a folder --input holds plain text, one key only")
    try:
        tokenizer_type = resolve_tokenizer_type(args.tokenizer_type, args.vocab_file, args.merge_file)
        _TOKENIZER = build_tokenizer(tokenizer_type, args.tokenizer_model, args.vocab_size, args.vocab_file,
                                     args.merge_file, args.tiktoken_pattern)
        eod = [_TOKENIZER.eod] if args.append_eod else []
        vocab_size = _TOKENIZER.vocab_size
        for key in args.json_keys:
            docs = (d + eod for d in _tokenized(_texts(args.input, key), args.workers, args.log_interval))
            prefix = f"{args.output_prefix}_{key}_document"
            os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
            count = write_indexed_dataset(prefix, _checked((d for d in docs if d), vocab_size), vocab_size)
            print(f"wrote {count} documents to {prefix}.bin/.idx")
    except ValueError as err:
        p.error(str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
