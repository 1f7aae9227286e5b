"""Tokenizers as real repositories ship them: `tokenizer.model` only (sentencepiece), `tokenizer.json`
only, and a generation_config.json whose eos list differs from config.json's. References: the
sentencepiece and tokenizers libraries themselves, on tiny models trained here offline."""

import io
import json
import os
import sys

import pytest

from tp_jax.serving.llm import generation_config_eos
from tp_jax.serving.tokenizer import load_tokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, this is a tiny tokenizer",
          "once upon a time there was a little girl named Emma", "tensor parallel inference in jax"] * 40
TEXTS = ["hello world", "the lazy fox was a little girl", "Once  upon\na time, jax!"]


def write_config(path, **fields):
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", **fields}, f)


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory):
    """A directory with config.json and only tokenizer.model (unk 0, bos 1, eos 2: Llama 2's layout)."""
    import sentencepiece as spm
    path = str(tmp_path_factory.mktemp("sp"))
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_writer=buf, vocab_size=120,
                                   model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    with open(os.path.join(path, "tokenizer.model"), "wb") as f:
        f.write(buf.getvalue())
    write_config(path, bos_token_id=1, eos_token_id=2)
    return path


def test_sentencepiece_only_directory(sentencepiece_dir):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=os.path.join(sentencepiece_dir, "tokenizer.model"))
    tok = load_tokenizer(sentencepiece_dir)
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == ("<s>", 1, "</s>", 2)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == [sp.bos_id()] + sp.encode(text)               # BOS first, as Llama 2's tokenizer does
        if sp.unk_id() not in ids:                                   # (sentencepiece decodes unk as " ⁇ ")
            assert tok.decode(ids, skip_special_tokens=True) == sp.decode(sp.encode(text))
    assert sp.unk_id() in tok.encode(TEXTS[2])                        # "O", "!" are unknown: unk, as sentencepiece


def test_sentencepiece_missing_names_the_file_and_the_fix(sentencepiece_dir, monkeypatch, tmp_path):
    import shutil
    path = str(tmp_path / "m")
    shutil.copytree(sentencepiece_dir, path)                   # another path: not served from the lru cache
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    with pytest.raises(ValueError, match=r"m/tokenizer.model is a sentencepiece model, and reading it needs the "
                                         r"`sentencepiece` package: pip install sentencepiece"):
        load_tokenizer(path)


@pytest.fixture(scope="module")
def tokenizer_json_dir(tmp_path_factory):
    """config.json and only tokenizer.json (a byte-level BPE with chat special tokens), no tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    path = str(tmp_path_factory.mktemp("tj"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(os.path.join(path, "tokenizer.json"))
    write_config(path, bos_token_id=1, eos_token_id=[2, 0])
    return path


def test_tokenizer_json_only_directory(tokenizer_json_dir):
    from tokenizers import Tokenizer
    ref = Tokenizer.from_file(os.path.join(tokenizer_json_dir, "tokenizer.json"))
    tok = load_tokenizer(tokenizer_json_dir)
    # special tokens the files do not name come from config.json's ids (the first of a list)
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", 1, "<|im_end|>", 2)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text).ids
        assert tok.decode(tok.encode(text)) == text


def test_generation_config_eos_list_differs_from_config(tmp_path):
    write_config(str(tmp_path), eos_token_id=128009)
    with open(tmp_path / "generation_config.json", "w") as f:
        json.dump({"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}, f)
    assert generation_config_eos(str(tmp_path)) == {128001, 128008, 128009}


def test_unreadable_generation_config_names_the_file(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read .*generation_config.json"):
        generation_config_eos(str(tmp_path))
