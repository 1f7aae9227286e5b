"""Qwen2, Qwen3 and Mistral (sliding window) vs transformers at tp in {1, 2, 4, 8}; their config
fields; and the rule that model files import only from tp_jax (never loaders / engine / llm)."""

import ast
import dataclasses
import os
import sys

import numpy as np
import pytest

from tests.tiny_models import logits_and_greedy, randomize
from tp_jax.serving.llm import LLM
from tp_jax.models.config import UnsupportedConfigError, config_from_hf
from tp_jax.serving.sampling import SamplingParams

MODELS_DIR = os.path.join(os.path.dirname(__file__), "..", "tp_jax", "models")
BASE = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, rms_norm_eps=1e-5,
            max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# name: (transformers config class, overrides); every variant uses a head count tp 4 or 8 must pad/replicate
VARIANTS = {
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                  use_sliding_window=False, sliding_window=4, max_window_layers=1)),
    # tied with the default init (0.02), the residual stream is the token's own embedding: greedy would just
    # repeat the last prompt token; larger weights make generation depend on the layers
    "qwen3": ("Qwen3Config", dict(num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                  tie_word_embeddings=True, initializer_range=0.2)),
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                      sliding_window=8, tie_word_embeddings=False)),
    # layers differ: layer 0 sees every key, layer 1 (>= max_window_layers) only the last 8
    "qwen2_window": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                         use_sliding_window=True, sliding_window=8, max_window_layers=1)),
}
WINDOW = 8
# the 13-token prompt is longer than Mistral's window; 5 + 12 generated tokens cross it in cached decode
PROMPTS = [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 200, 300], [5, 17, 300, 42, 9], [999, 3]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Greedy generation (prefill + cached decode, Mistral's window included) is checked at every tp.
GENERATE_AT = {"qwen2": (1, 2, 4, 8), "qwen3": (1, 2, 4, 8), "mistral": (1, 2, 4, 8), "qwen2_window": (1, 2, 4, 8)}


def hf_config(name: str):
    import transformers
    cls, over = VARIANTS[name]
    arch = cls.replace("Config", "ForCausalLM")
    return getattr(transformers, cls)(**{**BASE, **over, "architectures": [arch]})


def hf_reference(name: str, root: str):
    """(checkpoint dir, logits [3, 13, V] of a random batch, greedy tokens per prompt) from transformers."""
    import torch
    from transformers import AutoModelForCausalLM
    path = os.path.join(root, name)
    torch.manual_seed(sum(map(ord, name)))
    randomize(AutoModelForCausalLM.from_config(hf_config(name)).eval()).save_pretrained(path, safe_serialization=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(0, BASE["vocab_size"], size=(3, 13))
    logits, greedy = logits_and_greedy(model, ids, PROMPTS)
    with torch.no_grad():
        if name in ("mistral", "qwen2_window"):  # the window must matter: full attention differs past it
            model.config.sliding_window = None if name == "mistral" else 1000      # wider than the input
            for layer in model.model.layers if name == "qwen2_window" else []:
                layer.self_attn.sliding_window = layer.self_attn.sliding_window and model.config.sliding_window
            full = model(torch.tensor(ids)).logits.numpy()
            assert np.abs(full[:, :WINDOW] - logits[:, :WINDOW]).max() < 1e-5
            assert np.abs(full[:, WINDOW:] - logits[:, WINDOW:]).max() > 1e-3
    return path, ids, logits, greedy


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("models"))
    return {name: hf_reference(name, root) for name in VARIANTS}


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_and_greedy_match_transformers(references, name, tp):
    path, ids, ref, greedy = references[name]
    llm = LLM(path, tensor_parallel_size=tp, progress=False)
    assert llm.config.architecture == hf_config(name).architectures[0]
    got = llm.get_logits(ids)
    diff = float(np.abs(got - ref).max())
    print(f"{name} tp={tp}: max abs logit diff {diff:.2e}")
    assert diff <= 1e-4, f"{name} tp={tp}: max abs logit diff {diff:.2e}"
    if tp in GENERATE_AT[name]:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == greedy


# --- config fields ---------------------------------------------------------------------------

def test_config_fields_per_architecture():
    mistral = config_from_hf(hf_config("mistral"))
    assert mistral.sliding_window == WINDOW and not mistral.qk_norm
    with pytest.raises(ValueError, match=r"sliding_window=0 must be a positive integer"):
        dataclasses.replace(mistral, sliding_window=0)
    q3 = config_from_hf(hf_config("qwen3"))
    assert q3.qk_norm and q3.head_dim == 16 and q3.sliding_window is None and q3.tie_word_embeddings
    q2 = config_from_hf(hf_config("qwen2"))
    assert not q2.qk_norm and q2.sliding_window is None and q2.head_dim == 16


def test_qwen2_sliding_window_off_or_on_no_layer_is_accepted():
    from transformers import Qwen2Config
    over = {**VARIANTS["qwen2"][1], "use_sliding_window": True, "max_window_layers": 2}   # layers >= 2: none
    cfg = Qwen2Config(**{**BASE, **over, "architectures": ["Qwen2ForCausalLM"]})
    assert config_from_hf(cfg).sliding_window is None


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_qwen_sliding_window_on_some_layers_is_a_per_layer_table(name):
    from tp_jax.models.attention import FULL_WINDOW
    cfg = hf_config(name)
    cfg.use_sliding_window, cfg.sliding_window, cfg.max_window_layers = True, 4, 1
    cfg.layer_types = ["full_attention", "sliding_attention"]
    ours = config_from_hf(cfg)
    assert (ours.sliding_window, ours.layer_types) == (4, ("full_attention", "sliding_attention"))
    assert ours.layer_windows() == (FULL_WINDOW, 4)
    cfg.layer_types = ["sliding_attention"] * 2                 # every layer slides: one window, no table
    assert (config_from_hf(cfg).sliding_window, config_from_hf(cfg).layer_types) == (4, None)


def test_registry_knows_the_new_architectures():
    from tp_jax.models.registry import model_class, supported
    assert {"Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"} <= set(supported())
    assert model_class("MistralForCausalLM").__module__ == "tp_jax.models.mistral"


def test_the_config_and_the_family_choose_the_parts():
    """One shell for every model: the config's fields size and switch the shared parts (biases, q/k norms, rope);
    a family that diverges (GPT-2) builds its own modules, named by its class's `parts` and `body`."""
    import jax
    from transformers import GPT2Config
    from tp_jax.loaders.model import abstract_model
    from tp_jax.models.causal_lm import CausalLM
    from tp_jax.models.decoder import DecoderConfig, DenseMLP
    from tp_jax.models.gpt2 import GPT2MLP, GPT2Model
    from tp_jax.parallel.layers import LayerNorm
    from tp_jax.parallel.mesh import make_mesh
    mesh = make_mesh(devices=jax.devices()[:1])
    gpt2 = GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=4, architectures=["GPT2LMHeadModel"])
    built = {name: abstract_model(config_from_hf(cfg), mesh)
             for name, cfg in [*((n, hf_config(n)) for n in VARIANTS), ("gpt2", gpt2)]}
    for name, model in built.items():
        attn, mlp = model.model.layers.layers.self_attn, model.model.layers.layers.mlp
        assert isinstance(model, CausalLM) and isinstance(mlp, GPT2MLP if name == "gpt2" else DenseMLP), name
        assert (attn.q_norm is not None) == (name == "qwen3"), name
        assert (attn.qkv_proj.bias is not None, attn.o_proj.bias is not None) == {
            "qwen2": (True, False), "qwen2_window": (True, False), "gpt2": (True, True)}.get(name, (False, False)), name
        assert isinstance(model.model, GPT2Model) == (name == "gpt2") == (attn.freq is None), name
        assert isinstance(model.model.norm, LayerNorm) == (name == "gpt2"), name
    assert built["mistral"].model.layers.layers.self_attn.window == WINDOW
    with pytest.raises(ValueError, match=r"feed_forward='mamba'; choose one of \['dense', 'moe'\]"):
        dataclasses.replace(config_from_hf(hf_config("qwen2")), feed_forward="mamba")
    assert isinstance(config_from_hf(gpt2), DecoderConfig)


# --- real sizes, abstractly (jax.eval_shape: no memory) ---------------------------------------

REAL = {   # name: (config class, fields); released configs, trimmed to what matters here
    "Qwen3-8B": ("Qwen3Config", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                     head_dim=128, use_sliding_window=False, max_window_layers=36)),
    "Mistral-7B-v0.1": ("MistralConfig", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                              sliding_window=4096)),
    "Qwen2-7B": ("Qwen2Config", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                     use_sliding_window=False, sliding_window=131072, max_window_layers=28)),
}


@pytest.mark.parametrize("name", list(REAL))
def test_real_size_param_count_at_tp8(name):
    """Our global params == transformers' count plus exactly the head plan's padded q slots and replicated
    KV heads (Qwen2-7B: 28 q / 4 KV heads at tp 8 -> 32 q slots, 8 KV slots)."""
    import jax
    import torch
    import transformers
    from tests.test_real_configs import per_device_bytes
    from tp_jax.parallel.heads import plan_heads
    from tp_jax.loaders.model import abstract_model
    from tp_jax.parallel.mesh import make_mesh
    cls, fields = REAL[name]
    hf = getattr(transformers, cls)(**fields, architectures=[cls.replace("Config", "ForCausalLM")])
    with torch.device("meta"):
        expected = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf).parameters())
    cfg = config_from_hf(hf)
    mesh = make_mesh(tp=8, devices=jax.devices()[:8])
    total, _ = per_device_bytes(abstract_model(cfg, mesh, dtype=jax.numpy.bfloat16), mesh)
    plan, d, hd = plan_heads(cfg.num_heads, cfg.num_kv_heads, 8), cfg.hidden_size, cfg.head_dim
    bias = name.startswith("Qwen2")
    extra_q, extra_kv = plan.padded_q_heads - cfg.num_heads, plan.padded_kv_heads - cfg.num_kv_heads
    extra = cfg.num_layers * hd * (extra_q * (2 * d + bias) + 2 * extra_kv * (d + bias))   # q+o, k+v
    assert total == expected + extra
    assert (extra_q, extra_kv) == ((4, 4) if bias else (0, 0))


# --- model files depend on tp_jax's layers only ----------------------------------------------

FORBIDDEN = ("tp_jax.loaders", "tp_jax.serving.engine", "tp_jax.serving.llm")


def _imports(path: str) -> list[str]:
    tree = ast.parse(open(path).read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append("." * node.level + (node.module or ""))
    return out


LIBRARIES = set(sys.stdlib_module_names) | {"jax", "flax", "numpy"}
EXTRA = {"config.py": {"transformers"}}      # load_config reads config.json with AutoConfig


@pytest.mark.parametrize("file", sorted(f for f in os.listdir(MODELS_DIR) if f.endswith(".py")))
def test_model_files_import_only_tp_jax(file):
    for mod in _imports(os.path.join(MODELS_DIR, file)):
        root = mod.split(".")[0]
        assert not mod.startswith("."), f"models/{file}: relative import {mod!r}; import from tp_jax.models"
        assert root == "tp_jax" or root in LIBRARIES | EXTRA.get(file, set()), f"models/{file} imports {mod!r}"
        assert not mod.startswith(FORBIDDEN), f"models/{file} imports {mod!r}; models may not depend on it"
