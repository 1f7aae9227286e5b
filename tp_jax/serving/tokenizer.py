"""Tokenizers for a model path: transformers' AutoTokenizer for a directory, the GGUF's own for a .gguf.

Building a GGUF file's tokenizer means parsing its metadata (tens of thousands of token
strings) twice, seconds for SmolLM2 (docs/performance.md). The result is saved once under
`$XDG_CACHE_HOME/tp_jax/tokenizers/<key>` (default `~/.cache/...`; `TP_JAX_TOKENIZER_CACHE`
names another directory, or "0" turns it off), keyed by the file's absolute path, size and
modification time, and later runs load that copy in a fraction of a second. In a process,
tokenizers are also kept per (path, modification time).

A directory loads as real repositories ship it:
* `tokenizer.model` only (sentencepiece; Llama 2 / Mistral v0.1 era): converted by transformers
  (needs the `sentencepiece` package, a dependency of tp_jax; without it the error names the
  file and the fix), prepending BOS as those models' own tokenizer configs do when config.json's
  `bos_token_id` is the sentencepiece model's BOS;
* no `tokenizer_config.json` (e.g. `tokenizer.json` only): the special tokens the files do not
  name are taken from config.json's `bos_token_id` / `eos_token_id` (the first, for a list).
End-of-sequence ids for generation are the union of config.json's, the tokenizer's and
generation_config.json's (`LLM.eos_token_ids`).
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
    files = sorted(f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(path, f)))
    if not files:
        return None
    return _directory_tokenizer(path, files)


def _directory_tokenizer(path: str, files: list[str]):
    from transformers import AutoTokenizer
    config = _model_config(path)
    kwargs = {}
    if files == ["tokenizer.model"]:
        _require_sentencepiece(path)
        kwargs["add_bos_token"] = _sentencepiece_bos(path) == config.get("bos_token_id") is not None
    try:
        tok = AutoTokenizer.from_pretrained(path, **kwargs)
    except (ValueError, OSError, ImportError, KeyError, TypeError) as e:
        raise ValueError(f"cannot load the tokenizer of {path} from {', '.join(files)}: {e}") from e
    if "tokenizer_config.json" not in files:
        _fill_special_tokens(tok, config)
    return tok


def _model_config(path: str) -> dict:
    import json
    try:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        return cfg if isinstance(cfg, dict) else {}
    except (OSError, ValueError):
        return {}


def _require_sentencepiece(path: str) -> None:
    import importlib.util
    if importlib.util.find_spec("sentencepiece") is None:
        raise ValueError(f"{os.path.join(path, 'tokenizer.model')} is a sentencepiece model, and reading it needs the "
                         f"`sentencepiece` package: pip install sentencepiece (or ship tokenizer.json next to it)")


def _sentencepiece_bos(path: str) -> int | None:
    import sentencepiece
    sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(path, "tokenizer.model"))
    return sp.bos_id() if sp.bos_id() >= 0 else None


def _fill_special_tokens(tok, config: dict) -> None:
    """bos / eos tokens the tokenizer files leave unset, from config.json's ids."""
    for name in ("bos", "eos"):
        ids = config.get(f"{name}_token_id")
        ids = ids if isinstance(ids, list) else [ids]
        if getattr(tok, f"{name}_token", None) is None and isinstance(ids[0], int) and 0 <= ids[0] < len(tok):
            setattr(tok, f"{name}_token", tok.convert_ids_to_tokens(ids[0]))


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
