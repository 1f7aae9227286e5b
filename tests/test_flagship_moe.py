"""DeepSeek-V2 / V3 (latent attention, grouped routing) and gpt-oss (sinks, alternating windows, biased clamped
experts) vs transformers: logits within 5e-4 and greedy tokens equal over (dp, pp, tp), EP on and off.

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
import pytest

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


@pytest.fixture(scope="session")
def flagship_references(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM
    root, out = str(tmp_path_factory.mktemp("flagship")), {}
    ids = np.random.default_rng(0).integers(0, COMMON["vocab_size"], size=(4, 11))
    for name in VARIANTS:
        torch.manual_seed(sum(map(ord, name)))
        model = _randomize_extras(randomize(AutoModelForCausalLM.from_config(hf_config(name)).eval()))
        path = os.path.join(root, name)
        model.save_pretrained(path, safe_serialization=True)
        out[name] = (path, ids, *logits_and_greedy(model, ids, PROMPTS, max_new_tokens=GREEDY.max_tokens))
    return out


CASES = [pytest.param(name, *mesh, marks=() if mesh == QUICK[name] else pytest.mark.slow,
                      id="{}-dp{}pp{}tp{}-{}".format(name, *mesh[:3], "ep" if mesh[3] else "tp_layout"))
         for name in VARIANTS for mesh in MESHES]


@pytest.mark.parametrize("name,dp,pp,tp,ep", CASES)
def test_flagship_models_match_transformers(flagship_references, name, dp, pp, tp, ep):
    ckpt, ids, logits, greedy = flagship_references[name]
    llm = LLM(ckpt, tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
              enable_expert_parallel=ep, progress=False, compile_cache=False)
    diff = float(np.abs(llm.get_logits(ids) - logits).max())
    assert diff <= TOL, f"{name} dp={dp} pp={pp} tp={tp} ep={ep}: max abs logit diff {diff:.2e}"
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == greedy


@pytest.mark.parametrize("tp", [1, 2])
def test_absorbed_decode_equals_expanded_prefill(flagship_references, tp):
    """MLA on one sequence: the engine's paged steps attend absorbed (prompt tokens through prefill, then one token a
    step through decode), `get_logits` expanded; the log-probabilities of the same tokens agree within 5e-4."""
    import jax
    ckpt = flagship_references["ds3"][0]
    llm = LLM(ckpt, tensor_parallel_size=tp, progress=False, compile_cache=False)
    prompt = PROMPTS[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0,
                                                prompt_logprobs=0))[0]
    seq = prompt + list(out.outputs[0].token_ids)
    expanded = np.asarray(jax.nn.log_softmax(llm.get_logits(np.asarray([seq]))[0].astype(np.float32), axis=-1))
    prefill = [lp[tok] for lp, tok in zip(out.prompt_logprobs[1:], prompt[1:])]
    assert np.abs(np.asarray(prefill) - expanded[np.arange(len(prompt) - 1), prompt[1:]]).max() <= TOL
    decode = [lp[tok] for lp, tok in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
    at = np.arange(len(prompt) - 1, len(seq) - 1)
    assert np.abs(np.asarray(decode) - expanded[at, seq[len(prompt):]]).max() <= TOL


def test_latent_cache_bytes_per_token():
    """The latent pool caches r + rope values per token and layer on each tp rank (replicated over tp); the same
    model with standard attention would cache its tp share of the heads' keys (nope + rope) and values (v): at
    these tiny sizes that is 4x the latent at tp = 1 and less than it at tp = 4 (replication's cost)."""
    import jax
    import jax.numpy as jnp
    from tp_jax.loaders.model import abstract_model
    from tp_jax.models.config import config_from_hf
    from tp_jax.parallel.mesh import make_mesh
    cfg = config_from_hf(hf_config("ds3"))
    for tp in (1, 2, 4):
        mesh = make_mesh(tp=tp, devices=jax.devices()[:tp])
        layout = abstract_model(cfg, mesh, dtype=jnp.float32).kv_layout()
        assert (layout.kv_heads, layout.head_dim, layout.value_dim) == (tp, 12 + 4, 0)
        assert layout.bytes_per_token(1, tp) == 2 * (12 + 4) * 4
        standard = (cfg.num_heads // tp) * (6 + 4 + 5) * 4                    # k (nope + rope) and v per head
        assert standard == {1: 240, 2: 120, 4: 60}[tp]


def test_prompt_longer_than_the_window_with_chunked_prefill_and_prefix_cache(flagship_references):
    """gpt-oss (window 4 on its sliding layer): prompts of 40+ tokens prefilled 8 tokens a step, the second
    sharing the first's prefix from the cache, give transformers' greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM
    ckpt = flagship_references["gpt_oss"][0]
    rng = np.random.default_rng(3)
    first = rng.integers(3, COMMON["vocab_size"], size=41).tolist()
    second = first[:32] + rng.integers(3, COMMON["vocab_size"], size=9).tolist()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in (first, second)]
    llm = LLM(ckpt, tensor_parallel_size=2, max_num_batched_tokens=8, block_size=4, enable_prefix_caching=True,
              progress=False, compile_cache=False)
    outs = [llm.generate([p], GREEDY)[0] for p in (first, second)]
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert outs[1].num_cached_tokens >= 28                   # the shared 32 tokens' whole blocks came from the cache


@pytest.mark.parametrize("name,ep", [("ds3", True), ("gpt_oss", False)])
def test_orbax_convert_and_restore(flagship_references, tmp_path, name, ep):
    """Converted to Orbax (tp_jax/loaders/orbax.py), the checkpoint restores with transformers' logits and tokens:
    MLA's projections and norms, the correction bias, sinks and the biased experts all round-trip."""
    from tp_jax.loaders.orbax import convert_to_orbax
    ckpt, ids, logits, greedy = flagship_references[name]
    out = str(tmp_path / "orbax")
    convert_to_orbax(ckpt, out)
    llm = LLM(out, tensor_parallel_size=2, enable_expert_parallel=ep, progress=False, compile_cache=False)
    assert float(np.abs(llm.get_logits(ids) - logits).max()) <= TOL
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == greedy
