"""Mixtral, Qwen2-MoE and Qwen3-MoE vs transformers: logits and greedy tokens, EP on and off, over (dp, pp, tp).

One tiny random checkpoint per model (2 layers, odd expert counts, top-2 / top-3, a shared
expert), written by transformers in its default per-expert layout; Qwen3-MoE also in the fused
layout (`save_original_format=False`). One mesh runs by default, every factorization of 8 devices
(Qwen2-MoE, one expert layout each; the others at two) is `slow`; an 8-layer Qwen2-MoE reaches pp = 4 (`slow`). Plus the config
refusals for layers HF makes dense.
"""

import os

import numpy as np
import pytest

from tests.tiny_models import dequantized_reference, logits_and_greedy, randomize
from tp_jax.models.config import UnsupportedConfigError, config_from_hf
from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams

BASE = dict(vocab_size=300, hidden_size=32, intermediate_size=16, num_hidden_layers=2, rms_norm_eps=1e-5,
            max_position_embeddings=128, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.3,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
VARIANTS = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=5, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=7, num_experts_per_tok=3, moe_intermediate_size=8,
                                         shared_expert_intermediate_size=24, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8,
                                         norm_topk_prob=True)),
}
PROMPTS = [[7, 8, 9, 10, 11, 12, 13], [5, 17, 200, 42, 9], [299, 3, 77, 150]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# every (dp, pp, tp) factorization of 8 devices a 2-layer model admits (pp <= layers: pipeline.py refuses more)
FACTORIZATIONS = [(dp, pp, 8 // (dp * pp)) for dp in (1, 2, 4, 8) for pp in (1, 2) if 8 % (dp * pp) == 0]
QUICK = {(2, 2, 2)}


def hf_config(name: str, **extra):
    import transformers
    cls, over = VARIANTS[name]
    arch = [cls.replace("Config", "ForCausalLM")]
    return getattr(transformers, cls)(**{**BASE, **over, **extra, "architectures": arch})


@pytest.fixture(scope="session")
def moe_references(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM
    root, out = str(tmp_path_factory.mktemp("moe")), {}
    ids = np.random.default_rng(0).integers(0, BASE["vocab_size"], size=(8, 9))
    for name in VARIANTS:
        torch.manual_seed(sum(map(ord, name)))
        model = randomize(AutoModelForCausalLM.from_config(hf_config(name)).eval())
        path = os.path.join(root, name)
        model.save_pretrained(path, safe_serialization=True)
        if name == "qwen3_moe":
            model.save_pretrained(path + "_fused", safe_serialization=True, save_original_format=False)
        out[name] = (path, ids, *logits_and_greedy(model, ids, PROMPTS, max_new_tokens=8))
    return out


@pytest.fixture(scope="session")
def moe8_reference(tmp_path_factory):
    """{"qwen2_moe8": ...}: the Qwen2-MoE variant (7 experts, a shared expert) with 8 layers, for pp = 4."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(8)
    model = randomize(AutoModelForCausalLM.from_config(hf_config("qwen2_moe", num_hidden_layers=8)).eval())
    path = str(tmp_path_factory.mktemp("moe8"))
    model.save_pretrained(path, safe_serialization=True)
    ids = np.random.default_rng(8).integers(0, BASE["vocab_size"], size=(4, 9))
    return {"qwen2_moe8": (path, ids, *logits_and_greedy(model, ids, PROMPTS, max_new_tokens=8))}


def check(refs, name, dp, pp, tp, ep, path=None):
    ckpt, ids, logits, greedy = refs[name]
    llm = LLM(path or ckpt, tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
              enable_expert_parallel=ep, progress=False, compile_cache=False)
    assert llm.config.enable_expert_parallel is ep
    diff = float(np.abs(llm.get_logits(ids) - logits).max())
    assert diff <= 1e-4, f"{name} dp={dp} pp={pp} tp={tp} ep={ep}: max abs logit diff {diff:.2e}"
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == greedy


# every factorization on the richest variant (Qwen2-MoE: 7 experts, top-3, a shared expert); the others, whose
# code paths differ only in the router and the expert layout, at QUICK and tp = 8 (each path once). Both expert
# layouts at those two meshes; at the other factorizations one layout each, alternating (each layout meets dp,
# pp and tp > 1 among them)
GRID_MODEL, OTHER_MESHES = "qwen2_moe", {(2, 2, 2), (1, 1, 8)}
CASES = [pytest.param(name, m, ep, marks=() if m in QUICK else pytest.mark.slow,
                      id="{}-dp{}pp{}tp{}-{}".format(name, *m, "ep" if ep else "tp_layout"))
         for name in VARIANTS for i, m in enumerate(FACTORIZATIONS) if name == GRID_MODEL or m in OTHER_MESHES
         for ep in ((False, True) if m in OTHER_MESHES else (bool(i % 2),))]


@pytest.mark.parametrize("name,mesh,ep", CASES)
def test_moe_models_match_transformers(moe_references, name, mesh, ep):
    if not ep and VARIANTS[name][1].get("moe_intermediate_size", BASE["intermediate_size"]) % mesh[2]:
        pytest.skip("the TP layout needs tp | moe_intermediate_size (refusal tested below)")
    check(moe_references, name, *mesh, ep)


@pytest.mark.parametrize("ep", [False, True], ids=["tp_layout", "ep"])
def test_switched_layer_loop(moe_references, ep):
    """LLM(layer_loop="switch") on an MoE stack at pp = tp = 2: the router and the experts (read
    outside the switched GEMMs) are indexed per layer, so the logits and greedy tokens stay transformers'."""
    ckpt, ids, logits, greedy = moe_references["qwen2_moe"]
    llm = LLM(ckpt, tensor_parallel_size=2, pipeline_parallel_size=2, enable_expert_parallel=ep,
              layer_loop="switch", progress=False, compile_cache=False)
    diff = float(np.abs(llm.get_logits(ids) - logits).max())
    assert diff <= 1e-4, f"switched MoE stack, ep={ep}: max abs logit diff {diff:.2e}"
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == greedy


@pytest.mark.slow
@pytest.mark.parametrize("mesh,ep", [((1, 4, 2), False), ((2, 4, 1), True)], ids=["dp1pp4tp2-tp_layout", "dp2pp4tp1-ep"])
def test_deep_pipeline_factorizations(moe8_reference, mesh, ep):
    """pp = 4, which the 2-layer models cannot reach (the pipeline refuses more stages than layers), with dp and
    with tp, the two expert layouts between them (pp = 8, the same stage code with one layer a stage, is run on
    the dense stack in test_pipeline.py)."""
    check(moe8_reference, "qwen2_moe8", *mesh, ep)


@pytest.mark.parametrize("ep", [False, True], ids=["tp_layout", "ep"])
def test_fused_expert_checkpoint(moe_references, ep):
    """transformers 5's fused `experts.gate_up_proj [E, 2F, D]` / `down_proj [E, D, F]` load the same."""
    check(moe_references, "qwen3_moe", 2, 1, 4, ep, path=moe_references["qwen3_moe"][0] + "_fused")


@pytest.mark.parametrize("field,value,kinds", [("mlp_only_layers", [1], ("moe", "dense")),
                                               ("decoder_sparse_step", 2, ("dense", "moe"))])
@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_dense_layers_are_a_feed_forward_kind_per_layer(name, field, value, kinds):
    """transformers' rule: layer i is MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    (the stacks with dense layers run in tests/test_mixed_layers.py)."""
    cfg = hf_config(name)
    setattr(cfg, field, value)
    assert config_from_hf(cfg).ff_kinds == kinds
    setattr(cfg, field, [7] if field == "mlp_only_layers" else 0)
    with pytest.raises(UnsupportedConfigError, match=rf"config field {field}="):
        config_from_hf(cfg)


def test_moe_config_fields():
    cfg = config_from_hf(hf_config("qwen2_moe"))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob,
            cfg.shared_expert_intermediate_size, cfg.qkv_bias, cfg.o_bias) == (7, 3, 8, False, 24, True, False)
    cfg = config_from_hf(hf_config("mixtral"))
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.feed_forward) == (5, 16, True, "moe")


# --- the published configs, real size, built abstractly at tp = 8 with expert parallelism --------

@pytest.mark.parametrize("name", ["Mixtral-8x7B-v0.1", "Qwen3-30B-A3B", "Qwen3-235B-A22B"])
def test_published_moe_config_at_tp8_with_ep(name, tmp_path):
    """Accepted; with EP each device holds 1/8 of the experts: params per device ~ total / 8 (bf16), half
    that under quantization="int8" (experts included; the router and norms stay float), and the KV pool at
    a 1 GiB budget has budget // (2 x layers x 16 tokens x kv heads per device x head_dim x 2 B) blocks."""
    import dataclasses
    import json
    import torch
    import jax
    from transformers import AutoConfig, AutoModelForCausalLM
    from tests.test_real_configs import CONFIG_DIR
    from tp_jax.loaders.model import abstract_model, param_bytes_per_device
    from tp_jax.models.config import load_config
    from tp_jax.parallel.mesh import make_mesh
    from tp_jax.serving.kv_pool import plan_pool
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(open(os.path.join(CONFIG_DIR, name + ".json")).read())
    cfg = dataclasses.replace(load_config(str(path)), enable_expert_parallel=True)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)))
        total = sum(p.numel() for p in hf_model.parameters())
    mesh = make_mesh(tp=8)
    model = abstract_model(cfg, mesh, dtype=jax.numpy.bfloat16)
    per_device = param_bytes_per_device(model, mesh)
    assert per_device == pytest.approx(total * 2 / 8, rel=0.02), (per_device, total)
    assert model.model.layers.layers.mlp.experts.gate_up.get_value().shape[1] == cfg.num_experts
    budget = 2**30
    from tp_jax.serving.engine_args import EngineArgs
    pool = plan_pool(model.kv_layout(), mesh, EngineArgs(block_size=16, max_model_len=4096, max_num_seqs=64,
                                                         kv_cache_memory_bytes=budget))
    kv_local = max(1, cfg.num_kv_heads // 8)              # KV heads replicated when tp exceeds them
    per_block = 2 * cfg.num_layers * 16 * kv_local * cfg.head_dim * 2
    assert pool.num_blocks == min(budget // per_block, 64 * 4096 // 16)
    from tp_jax.loaders.quantize import plan_methods
    from tp_jax.models.registry import architecture
    methods = plan_methods(model, architecture(cfg.architecture).weights(cfg), {}, cfg.num_layers, "int8")
    int8_model = abstract_model(cfg, mesh, dtype=jax.numpy.bfloat16, methods=methods)
    assert int8_model.model.layers.layers.mlp.experts.gate_up.get_value().dtype == jax.numpy.int8
    int8_bytes = param_bytes_per_device(int8_model, mesh)              # the experts int8 too: ~1 byte / param
    assert int8_bytes == pytest.approx(per_device / 2, rel=0.02), (int8_bytes, per_device)
    print(json.dumps({"model": name, "params": total, "bytes_per_device": per_device, "kv_blocks": pool.num_blocks,
                      "bytes_per_device_int8": int8_bytes}))


@pytest.mark.parametrize("ep", [False, True], ids=["tp_layout", "ep"])
def test_orbax_convert_and_restore(moe_references, tmp_path, ep):
    """An MoE checkpoint converted to Orbax restores with the same logits, in either layout."""
    from tp_jax.loaders.orbax import convert_to_orbax
    out = str(tmp_path / "orbax")
    convert_to_orbax(moe_references["qwen2_moe"][0], out)
    check(moe_references, "qwen2_moe", 2, 1, 4, ep, path=out)


@pytest.mark.parametrize("ep", [False, True], ids=["tp_layout", "ep"])
def test_int8_quantization(moe_references, ep):
    """quantization='int8': attention, the head and the stacked experts int8 per output channel (per expert,
    per output row), loaded per device; the router float (a quantized logit can change which experts run).
    Logits equal the int8-round-tripped transformers model's; the params take ~1/4 of the float bytes."""
    import json
    import jax
    from tp_jax.loaders.model import abstract_model, param_bytes_per_device
    from tp_jax.parallel.layers import Int8, Unquantized
    ckpt, ids, logits, _ = moe_references["mixtral"]
    llm = LLM(ckpt, tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=ep, quantization="int8",
              progress=False, compile_cache=False)
    layer = llm.model.model.layers.layers                              # several devices: "auto" is the scan
    experts = layer.mlp.experts
    assert isinstance(layer.self_attn.qkv_proj.method, Int8) and isinstance(layer.mlp.gate.method, Unquantized)
    assert isinstance(experts.method, Int8)
    for name, out in (("gate_up", 2 * 16), ("down", BASE["hidden_size"])):
        q, s = getattr(experts, name)[...], getattr(experts, name + "_scale")[...]
        assert q.dtype == jax.numpy.int8 and s.dtype == jax.numpy.float32 and s.shape[-1] == out
        assert int(np.abs(np.asarray(q)).max()) == 127                   # each row's max maps to 127
    got = llm.get_logits(ids)
    diff = float(np.abs(got - dequantized_reference(ckpt, ids)).max())
    assert diff <= 1e-4, f"max abs logit diff vs the int8 round trip {diff:.2e}"
    quant_error = float(np.abs(got - logits).max())
    assert quant_error > 10 * diff                                       # the quantization error is visible
    int8_bytes = param_bytes_per_device(llm.model, llm.mesh)
    float_bytes = param_bytes_per_device(abstract_model(llm.config, llm.mesh), llm.mesh)
    assert int8_bytes < 0.45 * float_bytes, (int8_bytes, float_bytes)
    print(json.dumps({"model": "tiny mixtral", "ep": ep, "bytes_per_device_float32": float_bytes,
                      "bytes_per_device_int8": int8_bytes, "logit_diff_vs_round_trip": diff,
                      "logit_diff_vs_float": quant_error}))
