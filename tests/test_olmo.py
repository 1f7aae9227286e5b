"""OLMo 2 and OLMoE vs transformers: tiny random checkpoints written by transformers, 6 query / 2 KV heads, at every
(dp, pp, tp) factorization of 8 devices 2 layers allow, OLMoE with expert parallelism on and off.

Their q and k norms span the whole projection (all heads), so under tp each rank's heads hold only part of the
statistic: `QKNorm` adds the ranks' sums in one all-reduce per layer, counted in the compiled HLO.
"""

import os

import numpy as np
import pytest

from tests.hlo import count, loop_bodies
from tests.tiny_models import check_family, check_int8_and_orbax, family_reference
from tp_jax.serving.llm import LLM

BASE = dict(vocab_size=1000, hidden_size=48, intermediate_size=96, num_hidden_layers=2, rms_norm_eps=1e-5,
            max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0, num_attention_heads=6,
            num_key_value_heads=2, initializer_range=0.1, tie_word_embeddings=False)
VARIANTS = {
    "olmo2": ("Olmo2Config", dict(architectures=["Olmo2ForCausalLM"])),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=32, num_experts=6, num_experts_per_tok=2,
                                  architectures=["OlmoeForCausalLM"])),
}
MESHES = [(1, 1, 1), (1, 1, 8), (1, 2, 4), (2, 1, 4), (2, 2, 2), (4, 1, 2), (4, 2, 1), (8, 1, 1)]
# OLMoE alternates expert parallelism over the meshes, and runs both layouts at tp 8 and at (2, 2, 2)
CASES = [("olmo2", m, False) for m in MESHES] + [("olmoe", m, ep) for i, m in enumerate(MESHES)
                                                  for ep in ((False, True) if m in ((1, 1, 8), (2, 2, 2))
                                                             else (bool(i % 2),))]


def hf_reference(name: str, root: str):
    import transformers
    cls, over = VARIANTS[name]
    return family_reference(getattr(transformers, cls)(**{**BASE, **over}), os.path.join(root, name))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("olmo"))
    return {name: hf_reference(name, root) for name in VARIANTS}


@pytest.mark.parametrize("name,mesh,ep", CASES, ids=[f"{n}-{m}-{'ep' if e else 'tp'}" for n, m, e in CASES])
def test_logits_and_greedy_match_transformers(references, name, mesh, ep):
    check_family(references[name], mesh, 5e-4 if name == "olmoe" else 2e-4, enable_expert_parallel=ep)


def test_whole_width_qk_norm_costs_one_all_reduce_per_layer(references):
    """Llama's layer: 2 all-reduces (o_proj, down_proj); OLMo 2's adds one, the q and k norms' statistics together."""
    import jax
    path, ids, _, _ = references["olmo2"]
    llm = LLM(path, tensor_parallel_size=2, progress=False)
    fn = llm._logits_fn()
    pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).astype(np.int32)
    hlo = jax.jit(lambda i, p: fn(i, p)).lower(ids.astype(np.int32), pos).compile().as_text()
    reduces = [count(body, "all-reduce") for body in loop_bodies(hlo)]
    assert 3 in reduces and set(reduces) <= {0, 3}


def test_int8_and_orbax(references, tmp_path):
    """OLMoE with quantization="int8" (transformers on the int8 round-tripped weights) and through Orbax."""
    path, ids, logits = references["olmoe"][:3]
    check_int8_and_orbax(path, ids, logits, str(tmp_path / "orbax"), tensor_parallel_size=2)
