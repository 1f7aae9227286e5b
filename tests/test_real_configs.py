"""Real configs: the published config.json files in tests/data/configs (INDEX.md names their sources)
load and build at tp = 8, as published and as re-saved by transformers; the fields that change
the math are refused by name, the ones that cannot are accepted; `jax.eval_shape` over
real-size Llama configs gives the sharding plan without allocating a byte."""

import copy
import glob
import json
import math
import os
import re

import jax
import numpy as np
import pytest
from flax import nnx

from tp_jax.loaders.model import abstract_model
from tp_jax.parallel.mesh import make_mesh
from tp_jax.models.config import UnsupportedConfigError, config_from_hf, load_config

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "data", "configs")
PUBLISHED = sorted(os.path.basename(f)[:-5] for f in glob.glob(os.path.join(CONFIG_DIR, "*.json")))

LLAMA3 = dict(vocab_size=128256, rms_norm_eps=1e-5, max_position_embeddings=8192, architectures=["LlamaForCausalLM"],
              rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
CONFIGS = {
    "Llama-3-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8),
    "Llama-3-70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8),
    "Llama-3.2-1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=131072,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192}),
}


def hf_param_count(hf) -> int:
    """transformers' own parameter count, built on the meta device (no memory)."""
    import torch
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(hf)
    return sum(p.numel() for p in model.parameters())


def per_device_bytes(model, mesh) -> tuple[int, int]:
    """(total elements over the global arrays, bytes on the busiest device)."""
    state = nnx.state(model, nnx.Param)
    specs = nnx.get_partition_spec(state)
    total, per_dev = 0, 0
    for (_, var), (_, spec) in zip(nnx.to_flat_state(state), nnx.to_flat_state(specs)):
        x, spec = var.get_value(), spec.get_value()
        total += math.prod(x.shape)
        shards = math.prod(mesh.shape[a] for a in spec if a is not None)
        per_dev += math.prod(x.shape) // shards * x.dtype.itemsize
    return total, per_dev


@pytest.mark.parametrize("name,tp", [("Llama-3-8B", 8), ("Llama-3-70B", 8), ("Llama-3.2-1B", 8), ("Llama-3.2-1B", 1)])
def test_real_size_plan(name, tp):
    from transformers import LlamaConfig
    hf = LlamaConfig(**{**LLAMA3, **CONFIGS[name]})
    cfg = config_from_hf(hf)
    mesh = make_mesh(tp=tp, devices=jax.devices()[:tp])
    model = abstract_model(cfg, mesh, dtype=jax.numpy.bfloat16)
    total, per_dev = per_device_bytes(model, mesh)
    expected = hf_param_count(hf)
    assert total == expected            # these head counts and vocab divide: no padding at all
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size * 2            # replicated, bf16
    assert per_dev == pytest.approx((expected * 2 - norms) / tp + norms, rel=1e-6)
    print(f"{name} tp={tp}: {expected / 1e9:.2f}B params, {per_dev / 2**30:.2f} GiB per device (bf16)")


# --- every published config of tests/data/configs ------------------------------------------------

def published(name: str) -> dict:
    with open(os.path.join(CONFIG_DIR, name + ".json")) as f:
        return json.load(f)


def model_dir(tmp_path, cfg: dict, resave: bool = False, sub: str = "m") -> str:
    """A directory holding `cfg` as config.json; `resave`: rewritten by transformers' own save_pretrained."""
    path = tmp_path / (sub + ("_resaved" if resave else ""))
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    if resave:
        from transformers import AutoConfig
        AutoConfig.from_pretrained(str(path)).save_pretrained(str(path))
    return str(path)


def param_count(model) -> int:
    return sum(math.prod(v.get_value().shape) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))


def test_the_collection_covers_the_issue():
    assert len(PUBLISHED) >= 45
    families = ("Llama-2-", "Llama-3-", "Llama-3.1-", "Llama-3.2-", "70B", "TinyLlama", "SmolLM2", "Mistral-7B-v0.1",
                "Mistral-7B-Instruct-v0.2", "Mistral-7B-Instruct-v0.3", "Nemo", "Qwen2-", "Qwen2.5-", "Qwen3-0.6B",
                "Qwen3-32B", "gpt2", "gpt2-xl", "distilgpt2", "DeepSeek-R1-Distill-Qwen", "DeepSeek-R1-Distill-Llama")
    assert all(any(f in n for n in PUBLISHED) for f in families)


@pytest.mark.slow            # ~2 s a config (two abstract builds and transformers' meta model), 47 configs
@pytest.mark.parametrize("name", PUBLISHED)
def test_published_config_loads_and_builds_at_tp8(name, tmp_path):
    """load_config accepts it; at tp = 1 the model has transformers' exact parameter count (sizes, heads,
    tying read right); rope and window follow transformers' reading; at tp = 8 it builds, split 8 ways."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    path = model_dir(tmp_path, published(name))
    cfg = load_config(path)
    hf = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf)
    # the checkpoint's tensors: params and persistent buffers (DeepSeek-V3's e_score_correction_bias is a buffer
    # there, a param here); a vision-language checkpoint: its text model's
    stored = set(hf_model.state_dict())
    expected = sum(p.numel() for n, p in [*hf_model.named_parameters(), *hf_model.named_buffers()]
                   if n in stored and ("language_model" in n or not hasattr(hf, "text_config")))
    hf = getattr(hf, "text_config", hf)
    one = make_mesh(tp=1, devices=jax.devices()[:1])
    single = abstract_model(cfg, one, dtype=jax.numpy.bfloat16)
    rows = single.model.embed_tokens.embedding.get_value().shape[0]       # vocab padded to a multiple of 64
    padding = (rows - cfg.vocab_size) * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    assert param_count(single) == expected + padding
    if cfg.rope is None:                                                  # learned positions, no rotary
        assert hf.model_type == "gpt2" and cfg.architecture == "GPT2LMHeadModel"
    elif "full_attention" in hf.rope_parameters:                          # one rotary per layer type (Gemma 3)
        for rope, kind in ((cfg.rope, "full_attention"), (cfg.local_rope, "sliding_attention")):
            params = hf.rope_parameters[kind]
            assert (rope.theta, rope.type, rope.factor) == (params["rope_theta"], params["rope_type"],
                                                            params.get("factor", 1.0))
    else:
        assert (cfg.rope.theta, cfg.rope.type) == (hf.rope_parameters["rope_theta"], hf.rope_parameters["rope_type"])
    types = list(getattr(hf, "layer_types", None) or [])
    sliding = [t == "sliding_attention" for t in types]
    window = hf.sliding_window if (hf.model_type in ("mistral", "phi3") or any(sliding)) else None
    assert cfg.sliding_window == window
    assert cfg.layer_types == (tuple(types) if any(sliding) and not all(sliding) else None) or \
        (cfg.layer_types is None and hf.model_type in ("mistral", "phi3"))
    caps = (getattr(cfg, "attn_softcap", None), getattr(cfg, "final_softcap", None))     # GemmaConfig's fields
    assert caps == (getattr(hf, "attn_logit_softcapping", None), getattr(hf, "final_logit_softcapping", None))
    eight = make_mesh(tp=8, devices=jax.devices()[:8])
    model = abstract_model(cfg, eight, dtype=jax.numpy.bfloat16)
    total, per_dev = per_device_bytes(model, eight)
    assert total >= expected and per_dev < total * 2 / 4          # bf16: sharded, far below the whole


@pytest.mark.parametrize("name", PUBLISHED)
def test_resaved_config_reads_the_same(name, tmp_path):
    """The same file after a round trip through the installed transformers' save_pretrained."""
    cfg = published(name)
    assert load_config(model_dir(tmp_path, cfg, resave=True)) == load_config(model_dir(tmp_path, cfg))


# --- fields that cannot change the math are accepted, and have no effect ------------------------

NO_EFFECT = {   # (published config, field, value): seen refused in real files before the policy followed semantics
    "n_ctx": ("gpt2", "n_ctx", 2048),
    "use_mrope off": ("Qwen2.5-7B", "use_mrope", False),
    "is_llama_config": ("SmolLM2-135M", "is_llama_config", True),
    "max_sequence_length": ("Llama-2-7b-hf", "max_sequence_length", 2048),
    "torchscript": ("Mistral-7B-Instruct-v0.3", "torchscript", False),
    "auto_map": ("DeepSeek-R1-Distill-Qwen-1.5B", "auto_map", {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}),
    "unk_token_id": ("SmolLM2-135M", "unk_token_id", 0),
    "generation defaults": ("Qwen3-8B", "temperature", 0.6),
    "pruned_heads empty": ("gpt2-medium", "pruned_heads", {}),
    "dropout": ("Qwen3-0.6B", "attention_dropout", 0.1),
    "pretraining_tp": ("Llama-2-70b-hf", "pretraining_tp", 2),
}


@pytest.mark.parametrize("case", list(NO_EFFECT))
def test_field_without_effect_is_accepted(case, tmp_path):
    name, field, value = NO_EFFECT[case]
    base = {k: v for k, v in published(name).items() if k != field}
    changed = load_config(model_dir(tmp_path, {**base, field: value}, sub="with"))
    assert changed == load_config(model_dir(tmp_path, base, sub="without"))


# --- fields that change the math and are not implemented: refused, naming the field ------------

def edited(name: str, **change) -> dict:
    cfg = copy.deepcopy(published(name))
    cfg.update(change)
    return cfg


REFUSED = {   # case: (config dict, regex the error must match)
    "mrope": (edited("Qwen2.5-7B", use_mrope=True), r"use_mrope=True asks for multimodal rotary positions"),
    "multimodal rope sections": (edited("Qwen2.5-7B", rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
                                 r"rope_type 'mrope' is not supported"),
    "partial rotary": (edited("Llama-3.2-1B-Instruct", partial_rotary_factor=0.5), r"partial_rotary_factor"),
    "attention soft-capping": (edited("Llama-3.1-8B", attn_logit_softcapping=50.0),
                               r"attn_logit_softcapping=50.0 asks for tanh soft-capping of attention scores"),
    "logit soft-capping": (edited("Qwen3-8B", final_logit_softcapping=30.0), r"final_logit_softcapping=30.0"),
    "interleaved rope": (edited("SmolLM2-135M", rope_interleaved=True), r"rope_interleaved=True asks for rotary"),
    "chunked attention": (edited("Llama-3.1-8B", attention_chunk_size=8192),
                          r"attention_chunk_size=8192 is not supported by tp_jax's LlamaForCausalLM .*"
                          r"transformers' LlamaForCausalLM reads it \(modeling_llama.py and the rotary / mask code"),
    "gpt2 inverse layer scaling": (edited("gpt2", scale_attn_by_inverse_layer_idx=True),
                                   r"scale_attn_by_inverse_layer_idx=True .*transformers' GPT2LMHeadModel reads it"),
    "gpt2 cross attention": (edited("gpt2", add_cross_attention=True), r"add_cross_attention=True"),
    "mistral sliding window on llama": (edited("Llama-2-7b-hf", sliding_window=4096),
                                        r"sliding_window=4096 \(an active sliding window\) is not supported"),
    "activation": (edited("Qwen3-0.6B", hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
}


def test_longrope_is_read_with_its_factors(tmp_path):
    """LongRoPE (transformers' `longrope`, which Llama's rotary runs too): both factor sets and the attention
    factor sqrt(1 + ln(factor) / ln(original)); the short set until an engine's max_model_len passes the original."""
    from tp_jax.models.decoder import for_max_model_len
    cfg = load_config(model_dir(tmp_path, edited("Llama-3.1-8B", rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 64, "long_factor": [2.0] * 64, "factor": 4.0,
        "original_max_position_embeddings": 8192})))
    assert (cfg.rope.type, cfg.rope.short_factor[0], cfg.rope.long_factor[0], cfg.rope.use_long) == ("longrope", 1.0,
                                                                                                     2.0, False)
    assert cfg.rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(4.0) / math.log(8192)))
    assert for_max_model_len(cfg, 8192).rope.use_long is False and for_max_model_len(cfg, 8193).rope.use_long


def test_qwen_yarn_is_read_as_transformers_reads_it(tmp_path):
    """Qwen2.5's published long-context recipe (rope_scaling yarn, factor 4 over 32768 positions): the inverse
    frequencies and the attention factor of transformers' own yarn on the same config."""
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from tp_jax.models.rope import inv_freq
    path = model_dir(tmp_path, edited("Qwen2.5-7B", rope_scaling={"type": "yarn", "factor": 4.0,
                                                                   "original_max_position_embeddings": 32768}))
    cfg = load_config(path)
    assert (cfg.rope.type, cfg.rope.factor, cfg.rope.original_max_position_embeddings) == ("yarn", 4.0, 32768)
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](AutoConfig.from_pretrained(path), torch.device("cpu"))
    assert cfg.rope.attention_factor == pytest.approx(factor)
    np.testing.assert_allclose(inv_freq(cfg.rope, cfg.head_dim), want.numpy(), rtol=1e-6)


@pytest.mark.parametrize("name,layers,first", [("Qwen2.5-7B", 28, 14), ("Qwen3-8B", 36, 8)])
def test_qwen_sliding_window_on_upper_layers_is_a_per_layer_window(name, layers, first, tmp_path):
    cfg = load_config(model_dir(tmp_path, edited(name, use_sliding_window=True, sliding_window=4096,
                                                 max_window_layers=first)))
    assert cfg.sliding_window == 4096
    assert cfg.layer_types == ("full_attention",) * first + ("sliding_attention",) * (layers - first)


@pytest.mark.parametrize("case", list(REFUSED))
def test_field_that_changes_the_math_is_refused_by_name(case, tmp_path):
    cfg, msg = REFUSED[case]
    with pytest.raises(UnsupportedConfigError, match=msg):
        load_config(model_dir(tmp_path, cfg))


QUANTIZED = {   # quantization_config as published checkpoints carry it (read: loaders/packed.py)
    "GPTQ": {"bits": 4, "group_size": 128, "damp_percent": 0.01, "desc_act": False, "sym": True,
             "true_sequential": True, "quant_method": "gptq"},
    "AWQ": {"bits": 4, "group_size": 128, "quant_method": "awq", "version": "gemm", "zero_point": True},
    "FP8": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "compressed-tensors": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                       "symmetric": True, "dynamic": False}}}},
}
NOT_READ = {   # ... and those tp_jax does not read -> the method the error names
    "bitsandbytes 4-bit": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bfloat16",
                           "quant_method": "bitsandbytes"},
    "bitsandbytes 8-bit": {"load_in_8bit": True, "quant_method": "bitsandbytes"},
    "AQLM": {"quant_method": "aqlm", "nbits_per_codebook": 16, "num_codebooks": 1},
}


@pytest.mark.parametrize("method", list(QUANTIZED))
def test_quantized_checkpoint_config_is_read(method, tmp_path):
    """The model config is the float one; the format is the loader's (tests/test_published_quant.py)."""
    cfg = edited("Qwen2.5-7B-Instruct", quantization_config=QUANTIZED[method])
    assert load_config(model_dir(tmp_path, cfg)) == load_config(model_dir(tmp_path, published("Qwen2.5-7B-Instruct"),
                                                                          sub="plain"))


@pytest.mark.parametrize("method", list(NOT_READ))
def test_quantized_checkpoint_config_names_its_method(method, tmp_path):
    cfg = edited("Qwen2.5-7B-Instruct", quantization_config=NOT_READ[method])
    with pytest.raises(UnsupportedConfigError, match=rf"^{re.escape(method)} checkpoints are not supported .*"
                                                     r"use the model's float or GGUF release, with `--quantization "
                                                     r"int8`"):
        load_config(model_dir(tmp_path, cfg))


def test_dequantized_gguf_copy_is_not_refused(tmp_path):
    """transformers writes {"quant_method": "gguf"} into the config of a GGUF it dequantized and saved as float."""
    cfg = published("SmolLM2-135M")
    assert load_config(model_dir(tmp_path, {**cfg, "quantization_config": {"quant_method": "gguf"}})) == \
        load_config(model_dir(tmp_path, cfg, sub="plain"))


# --- the reference's reads, from transformers' source -------------------------------------------

def test_reference_reads_come_from_the_modeling_source():
    import inspect
    from transformers import GPT2Config, LlamaConfig
    from transformers.models.gpt2 import modeling_gpt2
    from tp_jax.models.reference import reference_reads
    llama = reference_reads(LlamaConfig(), "LlamaForCausalLM")
    assert {"rms_norm_eps", "rope_parameters", "hidden_act", "mlp_bias", "attention_chunk_size"} <= llama
    assert not {"pretraining_tp", "is_llama_config", "torchscript", "temperature"} & llama
    gpt2 = reference_reads(GPT2Config(), "GPT2LMHeadModel")
    assert {"n_embd", "n_head", "n_positions", "scale_attn_by_inverse_layer_idx", "layer_norm_epsilon"} <= gpt2
    assert "hidden_size" not in gpt2                              # read as config.hidden_size, stored as n_embd
    # the double-heads model of the same file reads summary_use_proj; GPT2LMHeadModel never reaches it
    assert "config.summary_use_proj" in inspect.getsource(modeling_gpt2) and "summary_use_proj" not in gpt2
    assert reference_reads(LlamaConfig(), "NoSuchForCausalLM") is None
