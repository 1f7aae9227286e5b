"""Tokenizers for a model path: transformers' AutoTokenizer for a directory, the GGUF's own for a .gguf."""

from __future__ import annotations

import functools
import os

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(path: str):
    """The tokenizer for `path`, or None when a directory ships no tokenizer files.

    Cached per (path, modification time): a GGUF tokenizer takes seconds to build.
    """
    return _load(os.path.abspath(path), os.path.getmtime(path))


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime: float):
    from tp_jax.loaders.sources import is_gguf
    if is_gguf(path):
        from tp_jax.loaders.gguf import load_gguf_tokenizer
        return load_gguf_tokenizer(path)
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)
