"""Megatron-LM's ``--tokenizer-type`` values, built through Megatron-Core's tokenizer classes; nothing is downloaded.

``check_tokenizer_args`` runs at flag validation (before any process group), so a
missing file or an uninstalled package (transformers, sentencepiece, tiktoken) is one
clear error on every rank instead of a failure inside a rank.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from typing import Any, Dict, Optional, Tuple

from megatron_hsap.megatron import versions

__all__ = ["TOKENIZER_TYPES", "build_tokenizer", "check_tokenizer_args", "resolve_tokenizer_type"]

#: tokenizer type -> (Megatron-Core library, Python package it needs, flags it needs)
_TYPES: Dict[str, Tuple[str, Optional[str], Tuple[str, ...]]] = {
    "ByteLevelTokenizer": ("byte-level", None, ()),
    "NullTokenizer": (versions.NULL_TOKENIZER_LIBRARY, None, ("--vocab-size",)),
    "GPT2BPETokenizer": ("huggingface", "transformers", ("--vocab-file", "--merge-file")),
    "HuggingFaceTokenizer": ("huggingface", "transformers", ("--tokenizer-model",)),
    "SentencePieceTokenizer": ("sentencepiece", "sentencepiece", ("--tokenizer-model",)),
    "GPTSentencePieceTokenizer": ("sentencepiece", "sentencepiece", ("--tokenizer-model",)),
    "Llama2Tokenizer": ("sentencepiece", "sentencepiece", ("--tokenizer-model",)),
    "TikTokenizer": ("tiktoken", "tiktoken", ("--tokenizer-model",)),
}
TOKENIZER_TYPES = tuple(_TYPES)
#: Megatron-LM's --tiktoken-num-special-tokens default.
_TIKTOKEN_SPECIAL_TOKENS = 1000
#: GPT-2's end-of-text token, Megatron-LM's EOD for GPT2BPETokenizer.
_GPT2_EOD = "<|endoftext|>"


def resolve_tokenizer_type(tokenizer_type: Optional[str], vocab_file: Optional[str],
                           merge_file: Optional[str]) -> str:
    """The type to use when ``--tokenizer-type`` is not given: GPT2BPETokenizer with ``--vocab-file`` and
    ``--merge-file`` (how Megatron-LM's GPT-3 example names its tokenizer), else ByteLevelTokenizer."""
    if tokenizer_type is not None:
        return tokenizer_type
    return "GPT2BPETokenizer" if vocab_file and merge_file else "ByteLevelTokenizer"


def check_tokenizer_args(tokenizer_type: str, tokenizer_model: Optional[str] = None, vocab_size: Optional[int] = None,
                         vocab_file: Optional[str] = None, merge_file: Optional[str] = None) -> None:
    """ValueError naming the flag, file or package that ``build_tokenizer`` would miss."""
    if tokenizer_type not in _TYPES:
        raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported; allowed: {', '.join(TOKENIZER_TYPES)}")
    _, package, needed = _TYPES[tokenizer_type]
    given = {"--vocab-size": vocab_size, "--tokenizer-model": tokenizer_model, "--vocab-file": vocab_file,
             "--merge-file": merge_file}
    for flag in needed:
        if given[flag] is None:
            raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag}")
        if flag != "--vocab-size" and not os.path.exists(given[flag]):
            raise ValueError(f"{flag} {given[flag]!r} does not exist (tokenizer files are read locally, never "
                             "downloaded)")
    if package is not None and importlib.util.find_spec(package) is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs the {package!r} Python package, which is not "
                         f"installed (pip install {package})")


def build_tokenizer(tokenizer_type: str, tokenizer_model: Optional[str] = None, vocab_size: Optional[int] = None,
                    vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                    tiktoken_pattern: Optional[str] = None) -> Any:
    """A Megatron-Core tokenizer (``.tokenize``, ``.detokenize``, ``.eod``, ``.vocab_size``).

    tokenizer_type: one of ``TOKENIZER_TYPES``. 'ByteLevelTokenizer': 512 ids, byte b -> id b, EOD = 0;
    'NullTokenizer': text is space-separated ids (vocab_size of them plus EOD); 'GPT2BPETokenizer':
    vocab_file (vocab.json) + merge_file (merges.txt), EOD = ``<|endoftext|>``; 'HuggingFaceTokenizer':
    tokenizer_model is a local directory; the SentencePiece types and 'TikTokenizer': tokenizer_model is the
    model file. The arguments mirror Megatron-Core's ``build_tokenizer`` (its defaults for the rest).
    """
    from megatron.core.tokenizers import MegatronTokenizer

    check_tokenizer_args(tokenizer_type, tokenizer_model, vocab_size, vocab_file, merge_file)
    library = _TYPES[tokenizer_type][0]
    metadata = {"library": library}
    if tokenizer_type == "ByteLevelTokenizer":
        return MegatronTokenizer.from_pretrained(metadata_path=metadata)
    if tokenizer_type == "NullTokenizer":  # ids 0..vocab_size-1 plus EOD = vocab_size, on every release
        ids = vocab_size + 1 if versions.NULL_TOKENIZER_VOCAB_INCLUDES_EOD else vocab_size
        return MegatronTokenizer.from_pretrained(metadata_path=metadata, vocab_size=ids)
    if tokenizer_type == "GPT2BPETokenizer":
        return _gpt2_bpe(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return MegatronTokenizer.from_pretrained(tokenizer_path=tokenizer_model, metadata_path=metadata)
    if library == "sentencepiece":
        return MegatronTokenizer.from_pretrained(tokenizer_path=tokenizer_model, metadata_path=metadata, legacy=False,
                                                 special_tokens=None)
    kwargs: Dict[str, Any] = {"num_special_tokens": _TIKTOKEN_SPECIAL_TOKENS, "special_tokens": None}
    if tiktoken_pattern:
        kwargs["pattern"] = tiktoken_pattern
    if vocab_size:
        kwargs["vocab_size"] = vocab_size
    return MegatronTokenizer.from_pretrained(tokenizer_path=tokenizer_model, metadata_path=metadata, **kwargs)


def _gpt2_bpe(vocab_file: str, merge_file: str) -> Any:
    """GPT-2 BPE from local vocab/merges files, via Megatron-Core's Hugging Face tokenizer class.

    Megatron-Core's own GPT2BPETokenizer entry resolves the ``gpt2`` model on the Hugging Face hub even
    when the files are given; here the files are staged as a local tokenizer directory instead.
    """
    from megatron.core.tokenizers import MegatronTokenizer

    with tempfile.TemporaryDirectory(prefix="gpt2bpe-") as folder:
        os.symlink(os.path.abspath(vocab_file), os.path.join(folder, "vocab.json"))
        os.symlink(os.path.abspath(merge_file), os.path.join(folder, "merges.txt"))
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "GPT2Tokenizer", "unk_token": _GPT2_EOD, "bos_token": _GPT2_EOD,
                       "eos_token": _GPT2_EOD, "model_max_length": 2**62}, f)
        return MegatronTokenizer.from_pretrained(tokenizer_path=folder, metadata_path={"library": "huggingface"})
