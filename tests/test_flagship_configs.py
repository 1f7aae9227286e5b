"""The flagship MoE configs at their published sizes, built abstractly (no weights) at tp = 8 with expert
parallelism on 8 simulated devices: DeepSeek-V2-Lite-Chat and DeepSeek-V3 (latent attention), gpt-oss-20b and
gpt-oss-120b (tests/data/configs; INDEX.md names their sources).

Per model: transformers' stored-tensor count (meta device) equals ours; the bytes on each device equal the
count from transformers' shapes, each tensor split 8 ways except those every rank holds whole (`REPLICATED`);
each device holds its own 1/8 of the routed experts; the KV bytes a token takes on one device: MLA's latent
(layers x (kv_lora_rank + qk_rope_head_dim) x 2 B) against standard attention over the same heads
(layers x heads/8 x (qk_nope + qk_rope + v_head_dim) x 2 B), gpt-oss's layers x 2 x max(1, kv_heads/8) x
head_dim x 2 B. DeepSeek-V3's FP8 release: the quantized abstract build planned from its tensors' headers
alone. Each test prints one JSON line.
"""

import dataclasses
import json
import math
import os
import re
from fractions import Fraction

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from tests.test_real_configs import CONFIG_DIR
from tp_jax.loaders.model import abstract_model, param_bytes_per_device
from tp_jax.models.cache import KVLayout
from tp_jax.models.config import load_config
from tp_jax.parallel.mesh import make_mesh

FLAGSHIPS = ["DeepSeek-V2-Lite-Chat", "DeepSeek-V3", "gpt-oss-20b", "gpt-oss-120b"]
TP = 8
# transformers' tensors every tp rank holds whole: the norms, MLA's a-projections (the latent is computed and
# cached on every rank), the routers with V3's correction bias, and a row-parallel o_proj's bias (added once,
# after the all-reduce). Everything else splits 8 ways: heads, vocab rows, MLP columns, whole experts (EP).
REPLICATED = re.compile(r"(norm\.weight|\.q_a_proj\.weight|\.kv_a_proj_with_mqa\.weight|\.mlp\.gate\.weight|"
                        r"\.e_score_correction_bias|\.mlp\.router\.(weight|bias)|\.o_proj\.bias)$")
FLOAT32 = re.compile(r"\.e_score_correction_bias$")           # float32 in a bfloat16 model, as transformers keeps it
BF16 = 2


def model_dir(tmp_path, name: str) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(open(os.path.join(CONFIG_DIR, name + ".json")).read())
    return str(path)


def hf_tensors(path: str) -> dict[str, tuple[int, ...]]:
    """transformers' stored tensors for the config at `path` (params and persistent buffers: DeepSeek-V3's
    e_score_correction_bias is a buffer there), name -> shape, built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    stored = model.state_dict()
    return {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()] if n in stored}


def expected_bytes(tensors: dict[str, tuple[int, ...]], itemsize) -> int:
    """Bytes on each device: `itemsize(name)` bytes an element, a tensor whole (`REPLICATED`) or 1/TP of it."""
    total = Fraction(0)
    for name, shape in tensors.items():
        total += math.prod(shape) * Fraction(itemsize(name)) / (1 if REPLICATED.search(name) else TP)
    assert total.denominator == 1, total
    return int(total)


def bf16_itemsize(name: str) -> int:
    return 4 if FLOAT32.search(name) else BF16


def param_count(model) -> int:
    return sum(v.get_value().size for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))


def expert_ranges(model, mesh) -> dict[str, list[tuple[int, int]]]:
    """Each routed-expert param [L, E, ...] -> the experts [start, stop) of each device, sorted; checks that a
    device holds its experts whole (every other axis unsplit)."""
    state = nnx.state(model, nnx.Param)
    specs = dict(nnx.to_flat_state(nnx.get_partition_spec(state)))
    out = {}
    for key, var in nnx.to_flat_state(state):
        if "experts" not in key:
            continue
        shape = var.get_value().shape
        blocks = NamedSharding(mesh, specs[key].get_value()).devices_indices_map(shape).values()
        for index in blocks:
            assert all(index[a].indices(shape[a])[:2] == (0, shape[a]) for a in range(len(shape)) if a != 1), key
        out[".".join(map(str, key))] = sorted(index[1].indices(shape[1])[:2] for index in blocks)
    return out


def build(tmp_path, name: str):
    path = model_dir(tmp_path, name)
    cfg = dataclasses.replace(load_config(path), enable_expert_parallel=True)
    mesh = make_mesh(tp=TP, devices=jax.devices()[:TP])
    return path, cfg, mesh, abstract_model(cfg, mesh, dtype=jnp.bfloat16)


def check_experts(model, mesh, num_experts: int) -> None:
    ranges = expert_ranges(model, mesh)
    share = num_experts // TP
    assert ranges and num_experts % TP == 0
    for key, got in ranges.items():
        assert got == [(d * share, (d + 1) * share) for d in range(TP)], (key, got)


@pytest.mark.parametrize("name", FLAGSHIPS)
def test_flagship_at_tp8_with_ep(name, tmp_path):
    path, cfg, mesh, model = build(tmp_path, name)
    tensors = hf_tensors(path)
    total = sum(math.prod(s) for s in tensors.values())
    assert param_count(model) == total
    per_device = param_bytes_per_device(model, mesh)
    assert per_device == expected_bytes(tensors, bf16_itemsize), (per_device, total)
    check_experts(model, mesh, cfg.num_experts)
    layout = model.kv_layout()
    kv = layout.bytes_per_token(1, TP)
    line = {"model": name, "params": total, "bytes_per_device": per_device, "kv_bytes_per_token_per_device": kv}
    if getattr(cfg, "mla", None) is not None:                  # DeepseekConfig's latent attention
        m = cfg.mla
        assert (layout.kv_heads, layout.head_dim, layout.value_dim) == (TP, m.kv_lora_rank + m.qk_rope_head_dim, 0)
        assert kv == cfg.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * BF16
        standard = KVLayout(cfg.num_layers, cfg.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, jnp.bfloat16,
                            v_head_dim=m.v_head_dim).bytes_per_token(1, TP)
        assert standard == cfg.num_layers * (cfg.num_heads // TP) * (m.qk_nope_head_dim + m.qk_rope_head_dim
                                                                      + m.v_head_dim) * BF16
        line["kv_bytes_per_token_per_device_standard_attention"] = standard
    else:
        assert kv == cfg.num_layers * 2 * max(1, cfg.num_kv_heads // TP) * cfg.head_dim * BF16
    print(json.dumps(line))


# --- DeepSeek-V3's FP8 release: the quantized abstract build from its headers ----------------------------

FP8_LINEAR = re.compile(r"\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj|gate_proj|up_proj|down_proj)\.weight$|"
                        r"\.experts\.(gate_up_proj|down_proj)$")       # kv_b_proj: stored FP8, held float


class Headers:
    """A safetensors checkpoint's headers only: name -> SafetensorsTensor (shape and dtype, no file, no data)."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def raw(self, name: str):
        return self.tensors[name]

    get = raw


def deepseek_v3_headers(c: dict) -> Headers:
    """deepseek-ai/DeepSeek-V3's tensors as its safetensors headers declare them (config `c`): every linear of
    the decoder layers float8_e4m3fn with a float32 weight_scale_inv per 128 x 128 block; the router, norms,
    embedding and head bfloat16; e_score_correction_bias float32 (its multi-token-prediction layer left out)."""
    from tp_jax.loaders.safetensors import SafetensorsTensor
    d, h, r, rope = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    nope, v, ql = c["qk_nope_head_dim"], c["v_head_dim"], c["q_lora_rank"]
    bo, bi = c["quantization_config"]["weight_block_size"]
    out = {}

    def add(name, shape, dtype="BF16"):
        out[name] = SafetensorsTensor("", name, tuple(shape), dtype)

    def fp8(module, rows, cols):
        add(module + ".weight", (rows, cols), "F8_E4M3")
        add(module + ".weight_scale_inv", (-(-rows // bo), -(-cols // bi)), "F32")

    def mlp(module, width):
        for proj, shape in (("gate_proj", (width, d)), ("up_proj", (width, d)), ("down_proj", (d, width))):
            fp8(f"{module}.{proj}", *shape)

    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        add(name, (c["vocab_size"], d))
    add("model.norm.weight", (d,))
    for i in range(c["num_hidden_layers"]):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        for norm, width in (("input_layernorm", d), ("post_attention_layernorm", d),
                            ("self_attn.q_a_layernorm", ql), ("self_attn.kv_a_layernorm", r)):
            add(f"{p}.{norm}.weight", (width,))
        for proj, shape in (("q_a_proj", (ql, d)), ("q_b_proj", (h * (nope + rope), ql)),
                            ("kv_a_proj_with_mqa", (r + rope, d)), ("kv_b_proj", (h * (nope + v), r)),
                            ("o_proj", (d, h * v))):
            fp8(f"{a}.{proj}", *shape)
        if i < c["first_k_dense_replace"]:
            mlp(p + ".mlp", c["intermediate_size"])
            continue
        add(p + ".mlp.gate.weight", (c["n_routed_experts"], d))
        add(p + ".mlp.gate.e_score_correction_bias", (c["n_routed_experts"],), "F32")
        for e in range(c["n_routed_experts"]):
            mlp(f"{p}.mlp.experts.{e}", c["moe_intermediate_size"])
        mlp(p + ".mlp.shared_experts", c["n_shared_experts"] * c["moe_intermediate_size"])
    return Headers(out)


def test_deepseek_v3_fp8_checkpoint_plans_from_headers(tmp_path):
    """plan_methods with the checkpoint's own method ("fp8") over its headers (PackedSource, as open_checkpoint
    wraps it): every FP8 linear and the routed experts stay FP8 (1 B + a float32 scale per 128 inputs of a row),
    kv_b_proj float (MLA's absorbed form reads it as W_UK / W_UV), the router, norms and vocab tables bf16."""
    from tp_jax.loaders.packed import PackedSource
    from tp_jax.loaders.quantize import plan_methods
    from tp_jax.models.quant_config import checkpoint_quant
    from tp_jax.models.registry import architecture
    name = "DeepSeek-V3"
    path, cfg, mesh, model = build(tmp_path, name)
    with open(os.path.join(path, "config.json")) as f:
        published = json.load(f)
    source = PackedSource(deepseek_v3_headers(published), checkpoint_quant(published["quantization_config"]))
    table = architecture(cfg.architecture).weights(cfg).for_names(source.keys())
    methods = plan_methods(model, table, source, cfg.num_layers, "fp8")
    fp8 = abstract_model(cfg, mesh, dtype=jnp.bfloat16, methods=methods)
    experts = fp8.model.ff_stacks.moe.layers.experts
    assert experts.gate_up.get_value().dtype == jnp.uint8 and experts.gate_up_scale.get_value().dtype == jnp.float32
    assert fp8.model.layers.layers.self_attn.kv_b_proj.kernel.get_value().dtype == jnp.bfloat16
    check_experts(fp8, mesh, cfg.num_experts)
    group = published["quantization_config"]["weight_block_size"][1]

    def itemsize(n):
        return Fraction(1) + Fraction(4, group) if FP8_LINEAR.search(n) else bf16_itemsize(n)

    per_device = param_bytes_per_device(fp8, mesh)
    bf16 = param_bytes_per_device(model, mesh)
    assert per_device == expected_bytes(hf_tensors(path), itemsize), per_device
    kv = fp8.kv_layout().bytes_per_token(1, TP)
    print(json.dumps({"model": name + " (FP8 checkpoint, quantization='fp8')", "bytes_per_device": per_device,
                      "bytes_per_device_bf16": bf16, "kv_bytes_per_token_per_device": kv}))


# --- gpt-oss's MXFP4 releases: the experts kept packed, from the headers ---------------------------------

MXFP4_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def gpt_oss_headers(c: dict) -> Headers:
    """openai/gpt-oss-20b / -120b's tensors as their safetensors headers declare them (config `c`): the experts'
    `gate_up_proj` / `down_proj` as uint8 `_blocks` [E, out, in/32, 16] and `_scales` [E, out, in/32], everything
    else (attention, sinks, router, expert biases, norms, embedding, head) bfloat16."""
    from tp_jax.loaders.safetensors import SafetensorsTensor
    d, f, e = c["hidden_size"], c["intermediate_size"], c["num_local_experts"]
    h, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    out = {}

    def add(name, shape, dtype="BF16"):
        out[name] = SafetensorsTensor("", name, tuple(shape), dtype)

    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        add(name, (c["vocab_size"], d))
    add("model.norm.weight", (d,))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            add(f"{p}.{norm}.weight", (d,))
        for proj, rows, cols in (("q_proj", h * hd, d), ("k_proj", kv * hd, d), ("v_proj", kv * hd, d),
                                 ("o_proj", d, h * hd)):
            add(f"{p}.self_attn.{proj}.weight", (rows, cols))
            add(f"{p}.self_attn.{proj}.bias", (rows,))
        add(f"{p}.self_attn.sinks", (h,))
        add(f"{p}.mlp.router.weight", (e, d))
        add(f"{p}.mlp.router.bias", (e,))
        for proj, rows, cols in (("gate_up_proj", 2 * f, d), ("down_proj", d, f)):
            add(f"{p}.mlp.experts.{proj}_blocks", (e, rows, cols // 32, 16), "U8")
            add(f"{p}.mlp.experts.{proj}_scales", (e, rows, cols // 32), "U8")
            add(f"{p}.mlp.experts.{proj}_bias", (e, rows))
    return Headers(out)


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b"])
def test_gpt_oss_mxfp4_checkpoint_plans_from_headers(name, tmp_path):
    """plan_methods with the checkpoint's own method ("mxfp4") over its headers (PackedSource, as open_checkpoint
    wraps it): the routed experts kept as stored (uint8 FP4 codes, two a byte, and a uint8 E8M0 exponent per 32
    inputs of a row: 17/32 B a weight), each device its 1/8 of them (EP); everything else bf16 as stored. Bytes
    per device equal that count; before (the experts dequantized to bf16) it was 2 B a weight."""
    from tp_jax.loaders.packed import PackedSource
    from tp_jax.loaders.quantize import plan_methods
    from tp_jax.models.quant_config import checkpoint_quant
    from tp_jax.models.registry import architecture
    path, cfg, mesh, model = build(tmp_path, name)
    with open(os.path.join(path, "config.json")) as f:
        published = json.load(f)
    source = PackedSource(gpt_oss_headers(published), checkpoint_quant(published["quantization_config"]))
    table = architecture(cfg.architecture).weights(cfg).for_names(source.keys())
    methods = plan_methods(model, table, source, cfg.num_layers, "mxfp4")
    packed = abstract_model(cfg, mesh, dtype=jnp.bfloat16, methods=methods)
    experts = packed.model.layers.layers.mlp.experts
    assert experts.gate_up.get_value().dtype == jnp.uint8 and experts.gate_up_scale.get_value().dtype == jnp.uint8
    check_experts(packed, mesh, cfg.num_experts)

    def itemsize(n):
        return Fraction(17, 32) if MXFP4_EXPERTS.search(n) else bf16_itemsize(n)

    per_device = param_bytes_per_device(packed, mesh)
    bf16 = param_bytes_per_device(model, mesh)
    assert per_device == expected_bytes(hf_tensors(path), itemsize), per_device
    stored = sum(math.prod(t.shape) * (1 if t.file_dtype == "U8" else BF16) for t in source.source.tensors.values())
    print(json.dumps({"model": name + " (MXFP4 checkpoint, quantization='mxfp4')", "bytes_per_device": per_device,
                      "bytes_per_device_before_bf16": bf16, "checkpoint_bytes": stored}))
