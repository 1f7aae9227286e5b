"""The numeric contract on the model families whose layers go beyond Llama's (docs/design.md): a request's tokens
and logprobs are the same alone and inside a mix of 24 requests (tests/test_batch_invariance.py's workload and check),
under each model's default configuration, at tp 1 and at dp 2 x tp 2 with expert parallelism:

* Qwen3-MoE with a dense layer (`mlp_only_layers`): routed experts beside a dense MLP in one stack;
* DeepSeek-V3 (tests/flagship_models.py's `ds3`): latent attention, sigmoid grouped routing, a shared expert;
* gpt-oss (`gpt_oss`): sinks, a sliding layer, expert biases and the clamped SwiGLU;
* Gemma 2: soft-capping, sandwich norms, a sliding layer.

Each failed before this file existed, by 1e-7 to 2e-6 in a logprob: the MoE block's "auto" chooses gather or dense by
the step's tokens, and dense added a token's experts in another order (now both combine alike: the same bits,
tests/test_moe_dispatch.py); latent attention's per-head dots ran on the step's rows untiled; and a key's rotary
(MLA's one rope head, or one 8-dim KV head per rank at tp 2) fused into the pool's write got other bits beside
other tokens (now q and k are rotated as one array: `rotate_together`, tp_jax/models/rope.py).
"""

import os

import pytest

from tests.test_batch_invariance import SERVING, differences, user_flags
from tp_jax import LLM

QWEN3_MOE = ("Qwen3MoeConfig", dict(vocab_size=300, hidden_size=48, intermediate_size=64, moe_intermediate_size=32,
                                    num_hidden_layers=3, rms_norm_eps=1e-5, max_position_embeddings=128,
                                    num_attention_heads=4, head_dim=8, num_key_value_heads=2, initializer_range=0.3,
                                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                                    architectures=["Qwen3MoeForCausalLM"]))
GEMMA2 = ("Gemma2Config", dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                               rms_norm_eps=1e-6, max_position_embeddings=128, head_dim=16, num_attention_heads=4,
                               num_key_value_heads=2, sliding_window=16, query_pre_attn_scalar=24,
                               attn_logit_softcapping=10.0, final_logit_softcapping=20.0, initializer_range=0.3,
                               bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                               architectures=["Gemma2ForCausalLM"]))
MODELS = ["qwen3_moe_dense", "ds3", "gpt_oss", "gemma2"]
MESHES = {"tp1": {}, "dp2tp2_ep": dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: a tiny random checkpoint written by transformers} (float32, as random models are saved)."""
    import torch
    import transformers
    from tests.flagship_models import _randomize_extras, hf_config
    from tests.tiny_models import randomize
    root = str(tmp_path_factory.mktemp("invariance_models"))
    out = {}
    for name in MODELS:
        torch.manual_seed(sum(map(ord, name)))
        if name in ("ds3", "gpt_oss"):
            cfg = hf_config(name)
        else:
            cls, kw = {"qwen3_moe_dense": QWEN3_MOE, "gemma2": GEMMA2}[name]
            cfg = getattr(transformers, cls)(**kw)
        model = _randomize_extras(randomize(transformers.AutoModelForCausalLM.from_config(cfg).eval()))
        out[name] = os.path.join(root, name)
        model.save_pretrained(out[name], safe_serialization=True)
    return out


@user_flags
@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("name", MODELS)
def test_default_is_batch_invariant(checkpoints, name, mesh):
    mesh_args = dict(MESHES[mesh])
    if name == "gemma2":
        mesh_args.pop("enable_expert_parallel", None)
    llm = LLM(checkpoints[name], max_model_len=128, num_gpu_blocks=24, **mesh_args, **SERVING)
    assert llm.setup.batch_invariant, llm.setup.summary()
    assert differences(llm, 110) == [], llm.setup.summary()
