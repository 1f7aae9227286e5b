"""The tiny DeepSeek-V2 / V3 and gpt-oss checkpoints the flagship-model tests share (tests/test_deepseek_v2.py,
test_deepseek_v3.py, test_gpt_oss.py), written by transformers, and the check against them: logits within 5e-4
and greedy tokens equal over (dp, pp, tp), EP on and off.

One tiny random checkpoint per variant, written by transformers:
* ds2: DeepSeek-V2 without q_lora_rank (a full q_proj), group_limited_greedy routing, two shared experts,
  a first dense layer, routed_scaling_factor;
* ds2_qlora: DeepSeek-V2 with q_lora_rank, greedy routing;
* ds3: DeepSeek-V3: sigmoid scores with a nonzero e_score_correction_bias, 4 groups keeping 2, norm_topk_prob,
  scaling 2.5, YaRN with mscale / mscale_all_dim, interleaved rotary pairs;
* gpt_oss: nonzero sinks, sliding (window 4) and full layers alternating, attention / router / expert biases,
  the clamped SwiGLU (inputs scaled so the clamp acts), YaRN.
The get_logits path attends expanded (transformers' form), the engine's paged steps absorbed (MLA); both are
checked against transformers, and against each other on one sequence.
"""

import os

import numpy as np

from tests.tiny_models import logits_and_greedy, randomize
from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams

COMMON = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, rms_norm_eps=1e-5, max_position_embeddings=128,
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, num_attention_heads=4,
              initializer_range=0.3)
DEEPSEEK = dict(intermediate_size=48, moe_intermediate_size=8, num_key_value_heads=4, kv_lora_rank=12,
                qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, n_routed_experts=8, num_experts_per_tok=2,
                first_k_dense_replace=1)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0}
VARIANTS = {
    "ds2": ("DeepseekV2Config", dict(**DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy", n_group=4,
                                     topk_group=2, n_shared_experts=2, routed_scaling_factor=2.0,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "ds2_qlora": ("DeepseekV2Config", dict(**DEEPSEEK, q_lora_rank=16, topk_method="greedy", n_shared_experts=1,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "ds3": ("DeepseekV3Config", dict(**DEEPSEEK, q_lora_rank=16, n_group=4, topk_group=2, n_shared_experts=1,
                                     norm_topk_prob=True, routed_scaling_factor=2.5, head_dim=4,
                                     rope_parameters={**YARN, "mscale": 0.9, "mscale_all_dim": 0.7})),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=8, num_key_value_heads=2, head_dim=8, num_local_experts=6,
                                     num_experts_per_tok=2, sliding_window=4,
                                     layer_types=["sliding_attention", "full_attention"],
                                     rope_parameters={**YARN, "rope_theta": 150000.0, "truncate": False})),
}
PROMPTS = [[7, 8, 9, 10, 11, 12, 13, 14, 15], [5, 17, 200, 42, 9], [299, 3, 77, 150]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
TOL = 5e-4
# (dp, pp, tp, ep): the meshes the issue names; QUICK runs by default, the rest are `slow`
MESHES = [(1, 1, 1, False), (1, 1, 2, False), (1, 1, 4, True), (2, 1, 2, False), (2, 1, 2, True), (1, 2, 2, False)]
QUICK = {"ds2": (2, 1, 2, True), "ds2_qlora": (1, 1, 4, True), "ds3": (1, 2, 2, False), "gpt_oss": (2, 1, 2, False)}


def hf_config(name: str, **extra):
    import transformers
    cls, over = VARIANTS[name]
    return getattr(transformers, cls)(**{**COMMON, **over, **extra, "architectures": [cls.replace("Config",
                                                                                                   "ForCausalLM")]})


def _randomize_extras(model):
    """What `randomize` leaves at transformers' init: gpt-oss's sinks and `*_bias` expert tensors, V3's correction
    bias (a buffer, zero at init), and gpt-oss's expert weights scaled so the SwiGLU clamp (limit 7) acts."""
    import torch
    with torch.no_grad():
        for n, p in list(model.named_parameters()) + list(model.named_buffers()):
            if n.endswith(("sinks", "_proj_bias")):
                p.copy_(torch.randn_like(p))
            elif n.endswith("e_score_correction_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif n.endswith("experts.gate_up_proj") and "gpt_oss" in type(model).__module__:
                p.mul_(8.0)
    return model


def write_references(root: str, names) -> dict:
    """{name: (checkpoint dir, ids, logits, greedy)} for each variant of `names`, written under `root`."""
    import torch
    from transformers import AutoModelForCausalLM
    out = {}
    ids = np.random.default_rng(0).integers(0, COMMON["vocab_size"], size=(4, 11))
    for name in names:
        torch.manual_seed(sum(map(ord, name)))
        model = _randomize_extras(randomize(AutoModelForCausalLM.from_config(hf_config(name)).eval()))
        path = os.path.join(root, name)
        model.save_pretrained(path, safe_serialization=True)
        out[name] = (path, ids, *logits_and_greedy(model, ids, PROMPTS, max_new_tokens=GREEDY.max_tokens))
    return out


def mesh_cases(names):
    """pytest params (name, dp, pp, tp, ep) for every mesh of MESHES; QUICK[name] runs by default, the rest `slow`."""
    import pytest
    return [pytest.param(name, *mesh, marks=() if mesh == QUICK[name] else pytest.mark.slow,
                         id="{}-dp{}pp{}tp{}-{}".format(name, *mesh[:3], "ep" if mesh[3] else "tp_layout"))
            for name in names for mesh in MESHES]


def check(refs, name, dp, pp, tp, ep, path=None):
    """LLM on `name`'s checkpoint (or `path`, a conversion of it) at the mesh: transformers' logits and tokens."""
    ckpt, ids, logits, greedy = refs[name]
    llm = LLM(path or ckpt, tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
              enable_expert_parallel=ep, progress=False, compile_cache=False)
    diff = float(np.abs(llm.get_logits(ids) - logits).max())
    assert diff <= TOL, f"{name} dp={dp} pp={pp} tp={tp} ep={ep}: max abs logit diff {diff:.2e}"
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == greedy
    return llm
