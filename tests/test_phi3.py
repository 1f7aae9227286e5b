"""Phi-3 / Phi-3.5 / Phi-4(-mini) vs transformers: tiny random checkpoints written by transformers (fused qkv_proj and
gate_up_proj tensors), 6 query / 2 KV heads, at every (dp, pp, tp) factorization of 8 devices 2 layers allow.

LongRoPE: an engine holds one factor set for its cache, chosen by max_model_len (tp_jax/models/rope.py): short
factors when max_model_len <= original_max_position_embeddings (transformers' choice for every sequence that fits),
long ones past it (transformers' choice for a sequence longer than the original context). Both are checked against
transformers on inputs where transformers makes that same choice.
"""

import os

import numpy as np
import pytest

from tests.tiny_models import check_family, check_int8_and_orbax, family_reference, hf_greedy
from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams

ORIGINAL = 32
BASE = dict(vocab_size=1000, hidden_size=48, intermediate_size=96, num_hidden_layers=2, rms_norm_eps=1e-5,
            max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0, num_attention_heads=6,
            num_key_value_heads=2, initializer_range=0.1, tie_word_embeddings=False, architectures=["Phi3ForCausalLM"])


def longrope(dims: int, partial: float = 1.0) -> dict:
    return {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
            "short_factor": [1.0 + 0.1 * i for i in range(dims)], "long_factor": [2.0 + 0.5 * i for i in range(dims)]}


VARIANTS = {
    "phi3_mini_4k": dict(sliding_window=8),                           # every layer slides (Phi-3-mini-4k: 2047)
    "phi3_5_longrope": dict(original_max_position_embeddings=ORIGINAL, rope_parameters=longrope(4)),
    # Phi-4-mini: 3/4 of each head rotated, tied embeddings, LongRoPE
    "phi4_mini": dict(original_max_position_embeddings=ORIGINAL, rope_parameters=longrope(3, 0.75),
                      tie_word_embeddings=True),
}
MESHES = [(1, 1, 1), (1, 1, 8), (1, 2, 4), (2, 1, 4), (2, 2, 2), (4, 1, 2), (4, 2, 1), (8, 1, 1)]
# Phi-3 without LongRoPE and Phi-4-mini (LongRoPE, partial rotary) at every factorization; Phi-3.5's LongRoPE alone
# at one device and at pp x tp
CASES = [(n, m) for n in ("phi3_mini_4k", "phi4_mini") for m in MESHES] + [("phi3_5_longrope", m)
                                                                           for m in ((1, 1, 1), (1, 2, 4))]


def hf_reference(name: str, root: str):
    import torch
    import transformers

    def window_matters(model, ids, logits):                  # Phi-3-mini-4k: full attention differs past it
        model.config.sliding_window = None
        with torch.no_grad():
            full = model(torch.tensor(ids)).logits.numpy()
        model.config.sliding_window = 8
        assert np.abs(full[:, :8] - logits[:, :8]).max() < 1e-5 < 1e-3 < np.abs(full[:, 8:] - logits[:, 8:]).max()

    cfg = transformers.Phi3Config(**{**BASE, **VARIANTS[name]})
    return family_reference(cfg, os.path.join(root, name), sum(map(ord, name)),
                            check=window_matters if name == "phi3_mini_4k" else None)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("phi3"))
    return {name: hf_reference(name, root) for name in VARIANTS}


@pytest.mark.parametrize("name,mesh", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_logits_and_greedy_match_transformers(references, name, mesh):
    check_family(references[name], mesh, max_model_len=ORIGINAL)


@pytest.mark.parametrize("name", ["phi3_5_longrope", "phi4_mini"])
def test_long_context_uses_the_long_factors(references, name):
    """max_model_len past the original context: the long factors, as transformers uses for a sequence past it
    (a 40-token forward; a 36-token prompt and 8 greedy tokens, all past the original 32)."""
    import torch
    from transformers import AutoModelForCausalLM
    path = references[name][0]
    ids = np.random.default_rng(4).integers(0, BASE["vocab_size"], size=(2, 40))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    llm = LLM(path, tensor_parallel_size=2, max_model_len=64, progress=False)
    assert llm.config.rope.use_long
    assert float(np.abs(llm.get_logits(ids) - ref).max()) <= 2e-4
    short = LLM(path, tensor_parallel_size=2, max_model_len=ORIGINAL, progress=False)
    assert float(np.abs(short.get_logits(ids[:, :ORIGINAL]) - ref[:, :ORIGINAL]).max()) > 1e-3   # factors matter
    prompt = ids[0, :36].tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(path, prompt, 8)


def test_int8_and_orbax(references, tmp_path):
    """Phi-4-mini with quantization="int8" (transformers on the int8 round-tripped weights) and through Orbax."""
    path, ids, logits = references["phi4_mini"][:3]
    check_int8_and_orbax(path, ids, logits, str(tmp_path / "orbax"), tensor_parallel_size=2, max_model_len=ORIGINAL)


def _config(rope=None, **over):
    import transformers
    cfg = transformers.Phi3Config(**{**BASE, **over})
    if rope is not None:
        cfg.rope_parameters = rope         # after construction: transformers' own validation would stop some
    return cfg


REFUSED = {   # case: (config, regex of the error)
    "activation": (_config(hidden_act="gelu"), r"hidden_act='gelu' is not supported for Phi3ForCausalLM; only 'silu'"),
    "heads do not divide": (_config(hidden_size=50), r"hidden_size=50 and num_attention_heads=6: hidden_size must be a "
                                                     r"multiple of num_attention_heads"),
    "odd rotary dims": (_config(rope={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.375}),
                        r"partial_rotary_factor=0.375 leaves an odd number of rotary dims per head \(8 \* factor\)"),
    "factor count": (_config(rope={**longrope(4), "short_factor": [1.0] * 3}),
                     r"short_factor has 3 entries; the rotary dims need 4"),
    "no long factors": (_config(rope={k: v for k, v in longrope(4).items() if k != "long_factor"}),
                        r"'longrope' need short_factor and long_factor"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_phi3_configs_are_refused_by_name(case):
    from tp_jax.loaders.model import abstract_model
    from tp_jax.models.config import UnsupportedConfigError, config_from_hf
    from tp_jax.parallel.mesh import make_mesh
    import jax
    cfg, msg = REFUSED[case]
    with pytest.raises(UnsupportedConfigError, match=msg):                  # the factor count: when the model is built
        abstract_model(config_from_hf(cfg), make_mesh(devices=jax.devices()[:1]))
