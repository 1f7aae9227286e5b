"""Tokenizers for a model path: transformers' AutoTokenizer for a directory, the GGUF's own for a .gguf.

Building a GGUF file's tokenizer means parsing its metadata (tens of thousands of token
strings) twice, about 10 s for SmolLM2. The result is saved once under
`$XDG_CACHE_HOME/tp_jax/tokenizers/<key>` (default `~/.cache/...`; `TP_JAX_TOKENIZER_CACHE`
names another directory, or "0" turns it off), keyed by the file's absolute path, size and
modification time, and later runs load that copy in a fraction of a second. In a process,
tokenizers are also kept per (path, modification time).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
CACHE_ENV = "TP_JAX_TOKENIZER_CACHE"


def load_tokenizer(path: str):
    """The tokenizer for `path`, or None when a directory ships no tokenizer files (or a .gguf none)."""
    return _load(os.path.abspath(path), os.path.getmtime(path))


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime: float):
    from tp_jax.loaders.sources import is_gguf
    if is_gguf(path):
        return _gguf_tokenizer(path)
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def cache_dir() -> str | None:
    """Where converted GGUF tokenizers are kept, or None when that cache is off."""
    env = os.environ.get(CACHE_ENV, "").strip()
    if env.lower() in ("0", "off", "false", "no"):
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return env or os.path.join(base, "tp_jax", "tokenizers")


def _gguf_tokenizer(path: str):
    from tp_jax.loaders.gguf import load_gguf_tokenizer
    root = cache_dir()
    if root is None:
        return load_gguf_tokenizer(path)
    st = os.stat(path)
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:32]
    saved = os.path.join(root, key)
    if os.path.isfile(os.path.join(saved, "tokenizer_config.json")):
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(saved)
    tok = load_gguf_tokenizer(path)
    if tok is None:
        return None
    try:                                               # write beside, then rename: never a half-written copy
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=root, prefix=".tmp-")
        tok.save_pretrained(tmp)
        os.replace(tmp, saved)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True) if "tmp" in locals() else None
    return tok
