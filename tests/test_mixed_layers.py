"""Stacks whose layers differ in their feed-forward: Qwen3-MoE with dense layers (`mlp_only_layers`, and
`decoder_sparse_step = 2`: every other layer MoE) vs transformers, 4 layers at every (dp, pp, tp) factorization
of 8 devices they allow, expert parallelism on and off; the per-kind stacks and their slot maps.

The model holds each feed-forward kind in a stack of its own (tp_jax/models/causal_lm.py, `FeedForwardPlan`);
a stage's slots of a kind are padded to the stage with the most, and a layer reaches its own through a switch.
"""

import os

import pytest

from tests.tiny_models import check_family, check_int8_and_orbax, family_reference
from tp_jax.serving.llm import LLM

BASE = dict(vocab_size=1000, hidden_size=48, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=4,
            rms_norm_eps=1e-5, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, num_attention_heads=6,
            head_dim=8, num_key_value_heads=2, initializer_range=0.1, tie_word_embeddings=False, num_experts=6,
            num_experts_per_tok=2, norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])
VARIANTS = {"mlp_only_layers": dict(mlp_only_layers=[1]),          # MoE, dense, MoE, MoE
            "sparse_step_2": dict(decoder_sparse_step=2)}          # dense, MoE, dense, MoE
MESHES = [(1, 1, 1), (1, 1, 8), (1, 2, 4), (1, 4, 2), (2, 1, 4), (2, 2, 2), (2, 4, 1), (4, 1, 2), (4, 2, 1), (8, 1, 1)]
# both variants at every mesh, expert parallelism on for one of them, alternating
CASES = [(name, m, bool((i + j) % 2)) for i, m in enumerate(MESHES) for j, name in enumerate(VARIANTS)]


def hf_reference(name: str, root: str):
    import transformers
    return family_reference(transformers.Qwen3MoeConfig(**BASE, **VARIANTS[name]), os.path.join(root, name))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mixed"))
    return {name: hf_reference(name, root) for name in VARIANTS}


@pytest.mark.parametrize("name,mesh,ep", CASES, ids=[f"{n}-{m}-{'ep' if e else 'tp'}" for n, m, e in CASES])
def test_logits_and_greedy_match_transformers(references, name, mesh, ep):
    check_family(references[name], mesh, 5e-4, enable_expert_parallel=ep)


def test_feed_forward_plan_pads_each_stage_to_the_busiest():
    from tp_jax.models.causal_lm import feed_forward_plan
    from tp_jax.parallel.pipeline import stage_layer_map
    kinds = ("dense",) * 3 + ("moe",) * 7                     # DeepSeek-like: dense layers first
    plan = feed_forward_plan(kinds, stage_layer_map(10, 4), 4)   # stages hold layers 0-2, 3-5, 6-7, 8-9
    assert plan.stack_maps == {"dense": (0, 1, 2, -1, -1, -1, -1, -1, -1, -1, -1, -1),
                               "moe": (-1, -1, -1, 3, 4, 5, 6, 7, -1, 8, 9, -1)}
    assert plan.branch == (1, 1, 1, 2, 2, 2, 2, 2, 0, 2, 2, 0)  # 0: the stages' identity slots
    assert plan.local == (0, 1, 2, 0, 1, 2, 0, 1, 0, 0, 1, 0)


def test_the_model_holds_each_kind_once(references):
    """The dense and MoE stacks hold exactly the checkpoint's layers of each kind (padding slots only for pp)."""
    import jax
    from flax import nnx
    llm = LLM(references["sparse_step_2"][0], progress=False, layer_loop="scan")
    stacks = llm.model.model.ff_stacks
    assert {k: s.layer_map for k, s in stacks.items()} == {"dense": (0, 2), "moe": (1, 3)}
    assert llm.model.model.layers.layers.mlp is None
    assert all(x.shape[0] == 2 for x in jax.tree.leaves(nnx.state(stacks["moe"], nnx.Param)))


def test_int8_and_orbax(references, tmp_path):
    """The stack with dense and MoE layers with quantization="int8" (transformers on the int8 round-tripped
    weights) and through Orbax."""
    path, ids, logits = references["sparse_step_2"][:3]
    check_int8_and_orbax(path, ids, logits, str(tmp_path / "orbax"), tensor_parallel_size=2)


def test_a_stack_map_must_cover_its_slots():
    from flax import nnx
    from tp_jax.parallel.layers import Stack, RMSNorm
    with pytest.raises(ValueError, match=r"Stack: layer_map has 1 slots for num_layers=2"):
        Stack(lambda r: RMSNorm(4, rngs=r), 2, nnx.Rngs(0), layer_map=(0,))
