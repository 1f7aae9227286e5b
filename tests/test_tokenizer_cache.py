"""A GGUF file's tokenizer is built once and saved; later loads read the saved copy, identical in use."""

import os

import pytest

from tp_jax.serving import tokenizer as tk

MESSAGES = [{"role": "user", "content": "What is the capital of France? ünïcödé 🚀"}]


def use(tok) -> tuple:
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    return (text, ids, tok.decode(ids, skip_special_tokens=True), tok.eos_token, tok.eos_token_id, tok.bos_token,
            tok.pad_token, len(tok))


@pytest.mark.slow
def test_the_saved_tokenizer_is_read_back_and_behaves_the_same(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv(tk.CACHE_ENV, str(tmp_path / "toks"))
    tk._load.cache_clear()
    first = tk.load_tokenizer(smollm2_path)
    saved = os.listdir(tmp_path / "toks")
    assert len(saved) == 1 and not saved[0].startswith(".tmp")
    import tp_jax.loaders.gguf as gguf
    monkeypatch.setattr(gguf, "load_gguf_tokenizer", lambda p: pytest.fail("the GGUF was parsed again"))
    tk._load.cache_clear()
    second = tk.load_tokenizer(smollm2_path)
    assert use(second) == use(first)
    assert use(first)[3:5] == ("<|im_end|>", 2)
    tk._load.cache_clear()


def test_the_cache_can_be_turned_off(monkeypatch, tmp_path):
    monkeypatch.setenv(tk.CACHE_ENV, "0")
    assert tk.cache_dir() is None
    monkeypatch.setenv(tk.CACHE_ENV, "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tk.cache_dir() == str(tmp_path / "tp_jax" / "tokenizers")
