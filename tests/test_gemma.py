"""Gemma 2 and Gemma 3 (text) vs transformers: tiny random checkpoints written by transformers, at every (dp, pp, tp)
factorization of 8 devices their 4 layers allow, with 6 query / 2 KV heads (tp 4 and 8 pad and replicate heads).

Each checkpoint makes every Gemma part matter, and the reference proves it: the soft-caps change transformers'
own logits, the sliding window changes them past the window, Gemma 3's two rotary bases change them.
"""

import os

import numpy as np
import pytest

from tests.tiny_models import FAMILY_PROMPTS as PROMPTS, check_family, check_int8_and_orbax, family_reference, randomize
from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams

WINDOW = 6
BASE = dict(vocab_size=1000, hidden_size=48, intermediate_size=96, num_hidden_layers=4, rms_norm_eps=1e-6,
            max_position_embeddings=128, bos_token_id=1, eos_token_id=2, head_dim=16, num_attention_heads=6,
            num_key_value_heads=2, sliding_window=WINDOW, query_pre_attn_scalar=24, initializer_range=0.1,
            tie_word_embeddings=False)
VARIANTS = {   # name: (transformers config class, overrides)
    # default layer_types: sliding, full, sliding, full; caps small enough to bend the scores and logits
    "gemma2": ("Gemma2Config", dict(attn_logit_softcapping=10.0, final_logit_softcapping=20.0,
                                    architectures=["Gemma2ForCausalLM"])),
    # global layer 1 rotates with theta 1e6 and linear scaling 8, the sliding ones with the local base 1e4
    "gemma3": ("Gemma3TextConfig", dict(
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}},
        tie_word_embeddings=True, architectures=["Gemma3ForCausalLM"])),
}
# every (dp, pp, tp) with dp * pp * tp = 8 and pp <= 4 layers, and one device
MESHES = [(1, 1, 1), (1, 1, 8), (1, 2, 4), (1, 4, 2), (2, 1, 4), (2, 2, 2), (2, 4, 1), (4, 1, 2), (4, 2, 1), (8, 1, 1)]


def hf_config(name: str):
    import transformers
    cls, over = VARIANTS[name]
    return getattr(transformers, cls)(**{**BASE, **over})


def variant_logits(model, ids, **change) -> np.ndarray:
    """transformers' logits for `ids` from the same weights under the config with fields `change`d."""
    import torch
    from transformers import AutoModelForCausalLM
    cfg = model.config.to_dict()
    cfg.update(change)
    other = AutoModelForCausalLM.from_config(type(model.config).from_dict(cfg), attn_implementation="eager").eval()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        return other(torch.tensor(ids)).logits.numpy()


def hf_reference(name: str, root: str):
    """(checkpoint dir, logits [3, 13, V], greedy tokens per prompt) from transformers, after checking that the
    window, the soft-caps (Gemma 2) and the local rotary base (Gemma 3) each change transformers' logits."""

    def parts_matter(model, ids, logits):
        gap = lambda **change: float(np.abs(variant_logits(model, ids, **change) - logits).max())
        full = variant_logits(model, ids, sliding_window=1000)                   # a window wider than the input
        assert np.abs(full[:, :WINDOW] - logits[:, :WINDOW]).max() < 1e-5      # the window matters past it only
        assert np.abs(full[:, WINDOW:] - logits[:, WINDOW:]).max() > 1e-3
        if name == "gemma2":
            assert gap(attn_logit_softcapping=None) > 1e-3 and gap(final_logit_softcapping=None) > 1e-3
        else:
            same = {t: {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}
                    for t in ("sliding_attention", "full_attention")}
            assert gap(rope_parameters=same) > 1e-3

    return family_reference(hf_config(name), os.path.join(root, name), sum(map(ord, name)), "eager", parts_matter)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("gemma"))
    return {name: hf_reference(name, root) for name in VARIANTS}


CASES = [(name, m) for name in VARIANTS for m in MESHES]


@pytest.mark.parametrize("name,mesh", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_logits_and_greedy_match_transformers(references, name, mesh):
    check_family(references[name], mesh)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_long_prompts_cross_the_window_in_chunks_and_from_the_prefix_cache(references, name):
    """Prompts of 45 and 40 tokens (7 windows) prefilled in chunks of 16, the second reusing the first's two
    cached blocks, then 8 cached decode steps: transformers' greedy tokens."""
    from tests.tiny_models import hf_greedy
    path = references[name][0]
    rng = np.random.default_rng(3)
    shared = rng.integers(0, BASE["vocab_size"], 32).tolist()
    prompts = [shared + rng.integers(0, BASE["vocab_size"], n).tolist() for n in (13, 8)]
    llm = LLM(path, tensor_parallel_size=2, max_num_batched_tokens=16, enable_prefix_caching=True, progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate([prompts[0]], params)[0]
    second = llm.generate([prompts[1]], params)[0]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == [hf_greedy(path, p, 8) for p in prompts]


def test_int8_and_orbax(references, tmp_path):
    """Gemma 3 with quantization="int8" (transformers on the int8 round-tripped weights) and through Orbax."""
    path, ids, logits = references["gemma3"][:3]
    check_int8_and_orbax(path, ids, logits, str(tmp_path / "orbax"), tensor_parallel_size=2)


def test_gemma3_vision_language_checkpoint_runs_its_text_model(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (a tiny SigLIP tower beside the text model): its text model
    loads from the language model's tensors, the vision tensors unread, and matches transformers on text."""
    import torch
    import transformers
    text = {k: v for k, v in {**BASE, **VARIANTS["gemma3"][1]}.items() if k != "architectures"}
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=999, boi_token_index=997, eoi_token_index=998,
                                    eos_token_id=[1, 106], architectures=["Gemma3ForConditionalGeneration"])
    torch.manual_seed(5)
    path = str(tmp_path / "gemma3_vlm")
    randomize(transformers.Gemma3ForConditionalGeneration(cfg).eval()).save_pretrained(path)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(0, 990, size=(3, 13))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids)).logits.numpy()
        greedy = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(PROMPTS[0]):].tolist()
    llm = LLM(path, tensor_parallel_size=2, pipeline_parallel_size=2, progress=False)
    assert (llm.config.architecture, llm.config.eos_token_ids) == ("Gemma3ForConditionalGeneration", (1, 106))
    assert float(np.abs(llm.get_logits(ids) - ref).max()) <= 2e-4
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == greedy


def test_served_and_generated_text_is_transformers_greedy_text(tmp_path, smollm2_path):
    """A tiny Gemma 3 with SmolLM2's tokenizer through the OpenAI server (in process) and scripts/generate.py
    (--json): both give the text of transformers' greedy tokens."""
    import asyncio
    import json
    import subprocess
    import sys

    import httpx
    import torch
    import transformers
    from tests.tiny_models import hf_greedy
    from tp_jax.server.app import create_app
    from tp_jax.serving.async_engine import AsyncLLMEngine
    from tp_jax.serving.tokenizer import load_tokenizer
    cfg = hf_config("gemma3")
    cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id = 49152, None, 2
    torch.manual_seed(2)
    path = str(tmp_path / "gemma3_text")
    randomize(transformers.AutoModelForCausalLM.from_config(cfg).eval()).save_pretrained(path)
    tokenizer = load_tokenizer(smollm2_path)
    tokenizer.save_pretrained(path)
    prompt = "Once upon a time, in a land far away"
    expected = tokenizer.decode(hf_greedy(path, tokenizer.encode(prompt), 8))
    llm = LLM(path, tensor_parallel_size=2, max_model_len=128, progress=False)
    aengine = AsyncLLMEngine(llm.engine)
    app = create_app(aengine, llm.get_tokenizer(), model_names=["gemma3"], max_model_len=llm.max_model_len)

    async def complete():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            return await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                         "ignore_eos": True})
    try:
        served = asyncio.run(complete())
    finally:
        aengine.shutdown()
    assert served.status_code == 200 and served.json()["choices"][0]["text"] == expected
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "generate.py")
    run = subprocess.run([sys.executable, script, "--model", path, "--simulate-devices", "2", "--tp", "2",
                          "--prompt", prompt, "--max-tokens", "8", "--temperature", "0", "--ignore-eos", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[0])["text"] == expected


def _edited(name: str, **change):
    cfg = hf_config(name)
    for k, v in change.items():
        setattr(cfg, k, v)                 # after construction: transformers' own validation would stop some
    return cfg


REFUSED = {   # case: (config, regex of the error)
    "activation": (_edited("gemma2", hidden_activation="relu6"), r"hidden_activation='relu6' is not supported"),
    "bidirectional": (_edited("gemma3", use_bidirectional_attention=True),
                      r"use_bidirectional_attention=true makes Gemma3ForCausalLM an encoder"),
    "layer types count": (_edited("gemma2", layer_types=["full_attention"] * 3),
                          r"layer_types has 3 entries for Gemma2ForCausalLM's 4 layers"),
    "sliding without a window": (_edited("gemma2", sliding_window=None),
                                 r"layer_types marks sliding layers of Gemma2ForCausalLM but sliding_window=None"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_gemma_configs_are_refused_by_name(case):
    from tp_jax.models.config import UnsupportedConfigError, config_from_hf
    cfg, msg = REFUSED[case]
    with pytest.raises(UnsupportedConfigError, match=msg):
        config_from_hf(cfg)


def test_a_vision_checkpoint_without_text_config_is_refused():
    import types
    from tp_jax.models.config import UnsupportedConfigError
    from tp_jax.models.gemma3 import gemma3_text_config
    with pytest.raises(UnsupportedConfigError, match=r"Gemma3ForConditionalGeneration has no text_config"):
        gemma3_text_config(types.SimpleNamespace(quantization_config=None, text_config=None))


@pytest.mark.parametrize("field,value,msg", [
    ("layer_types", ("full_attention", "chunked"), r"layer_types=.* must name one of \('full_attention', "
                                                   r"'sliding_attention'\) for each of the 4 layers"),
    ("ff_kinds", ("dense",) * 3, r"ff_kinds=.* must name one of \['dense', 'moe'\] for each of the 4 layers"),
    ("attn_softcap", 0.0, r"GemmaConfig: attn_softcap=0.0 must be a positive number or None"),
    ("final_softcap", -1.0, r"GemmaConfig: final_softcap=-1.0 must be a positive number or None")])
def test_decoder_config_checks_the_per_layer_fields(field, value, msg):
    import dataclasses
    from tp_jax.models.config import config_from_hf
    with pytest.raises(ValueError, match=msg):
        dataclasses.replace(config_from_hf(hf_config("gemma2")), **{field: value})
