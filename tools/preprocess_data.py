#!/usr/bin/env python
"""Turn JSONL or a folder of text files into Megatron's indexed dataset format (``.bin`` + ``.idx``).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus --append-eod
    python tools/preprocess_data.py --input my_texts/ --output-prefix data/texts --append-eod \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model /path/to/local/tokenizer

Writes ``<output-prefix>_<json-key>_document.{bin,idx}`` (Megatron-LM's naming), one
document per JSON line (or per file), ready for ``pretrain_gpt_hsap.py --data-path``.
The default tokenizer is byte-level (token = byte, EOD = 0): nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterator, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hsap.training.corpus import write_indexed_dataset  # noqa: E402
from megatron_hsap.training.tokenizer import build_tokenizer  # noqa: E402


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


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--input", required=True, help="a .jsonl file or a folder of text files")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--json-keys", default="text", help="JSONL field holding the text")
    p.add_argument("--tokenizer-type", choices=("ByteLevelTokenizer", "HuggingFaceTokenizer", "NullTokenizer"),
                   default="ByteLevelTokenizer")
    p.add_argument("--tokenizer-model", default=None, help="local path of a Hugging Face tokenizer")
    p.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    p.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    args = p.parse_args(argv)
    if not os.path.exists(args.input):
        p.error(f"--input {args.input!r} does not exist")
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
        eod = [tokenizer.eod] if args.append_eod else []
        docs = (tokenizer.tokenize(text) + eod for text in _texts(args.input, args.json_keys))
        prefix = f"{args.output_prefix}_{args.json_keys}_document"
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        count = write_indexed_dataset(prefix, _checked((d for d in docs if d), tokenizer.vocab_size),
                                      tokenizer.vocab_size)
    except ValueError as err:
        p.error(str(err))
    print(f"wrote {count} documents to {prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
