"""Tokenizers that need no download: byte-level (ids = bytes), null, or a Hugging Face one from a local path."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["build_tokenizer"]


def build_tokenizer(tokenizer_type: str, tokenizer_model: Optional[str] = None,
                    vocab_size: Optional[int] = None) -> Any:
    """A Megatron-Core tokenizer (``.tokenize``, ``.eod``, ``.vocab_size``).

    tokenizer_type: 'ByteLevelTokenizer' (512 ids, byte b -> id b, EOD = 0), 'NullTokenizer'
    (text is space-separated ids; needs vocab_size) or 'HuggingFaceTokenizer' (tokenizer_model:
    a local directory; nothing is downloaded).
    """
    from megatron.core.tokenizers import MegatronTokenizer

    if tokenizer_type == "ByteLevelTokenizer":
        return MegatronTokenizer.from_pretrained(metadata_path={"library": "byte-level"})
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("NullTokenizer needs vocab_size")
        return MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=vocab_size)
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ValueError("HuggingFaceTokenizer needs tokenizer_model, a local path")
        return MegatronTokenizer.from_pretrained(tokenizer_path=tokenizer_model,
                                                 metadata_path={"library": "huggingface"}, local_files_only=True)
    raise ValueError(f"tokenizer_type={tokenizer_type!r} is not supported; allowed: 'ByteLevelTokenizer', "
                     "'NullTokenizer', 'HuggingFaceTokenizer'")
