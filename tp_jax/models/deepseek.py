"""DeepseekV2ForCausalLM and DeepseekV3ForCausalLM: the config (`DeepseekConfig`), its maps, the name table and the
registrations.

The shared graph with DeepSeek's latent attention (`MLAttention`, tp_jax/models/mla.py, and its KV layout) in
place of the QKV attention, the rest chosen by the config:

    per layer (pre-norm RMSNorm):
      h += mla(norm(h))                        multi-head latent attention (tp_jax/models/mla.py): low-rank q
                                               (q_lora_rank, or a full q_proj) and kv (kv_lora_rank), decoupled
                                               rotary part over interleaved pairs, YaRN with its mscale
      h += mlp(norm(h))                        the first `first_k_dense_replace` layers: a dense SwiGLU MLP;
                                               the others: routed experts + n_shared_experts shared experts
    routing  V2: softmax scores, top-k (topk_method "greedy") or within the topk_group best groups by their
                 best expert ("group_limited_greedy"), times routed_scaling_factor
             V3: sigmoid scores; e_score_correction_bias added for the choice only; groups scored by their
                 top-2 sum; top-k weights renormalized (norm_topk_prob) and times routed_scaling_factor

The dense and MoE feed-forwards live in a stack each (`ff_kinds`, tp_jax/models/causal_lm.py). DeepSeek-V3's
multi-token-prediction layers (`num_nextn_predict_layers`, stored as layers past num_hidden_layers) are not
run; their tensors are left unused.
"""

from __future__ import annotations

import dataclasses

from tp_jax.models.cache import KVLayout
from tp_jax.models.causal_lm import CausalLM
from tp_jax.models.config import REQUIRED, UnsupportedConfigError, eos_ids, only_silu, read_fields
from tp_jax.models.decoder import DecoderParts
from tp_jax.models.mla import MLAConfig, MLAttention
from tp_jax.models.moe import TRAINING_ONLY_MOE, MoEConfig, moe_weights
from tp_jax.models.registry import first_architecture, register
from tp_jax.models.rope import ROPE_FIELDS, rope_from_hf
from tp_jax.parallel.layers import Entry, WeightTable


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepseekConfig(MoEConfig):
    """MoEConfig plus the latent attention's sizes, `mla` (`MLAConfig`); `head_dim` is the q/k head width
    (nope + rope)."""
    mla: MLAConfig


class DeepseekV2ForCausalLM(CausalLM):
    """The shared causal-LM shell with latent attention and DeepSeek's experts (`deepseek_config`)."""
    parts = DecoderParts(attention=MLAttention)

    def kv_layout(self) -> KVLayout:
        """One latent per token, cached on every tp rank (one "head" per rank), no value pool."""
        return KVLayout(len(self.layer_map), self.tp_size, self.config.mla.latent_dim, self.dtype, v_head_dim=0)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """As DeepseekV2ForCausalLM, with V3's sigmoid, bias-corrected group routing."""


# HF config field -> default when the config lacks it (REQUIRED: config.json must state it).
DEEPSEEK_FIELDS = {
    "vocab_size": REQUIRED, "hidden_size": REQUIRED, "intermediate_size": REQUIRED,
    "moe_intermediate_size": REQUIRED, "num_hidden_layers": REQUIRED, "num_attention_heads": REQUIRED,
    "num_key_value_heads": None, "head_dim": None, "kv_lora_rank": REQUIRED, "q_lora_rank": None,
    "qk_nope_head_dim": REQUIRED, "qk_rope_head_dim": REQUIRED, "v_head_dim": REQUIRED,
    "n_routed_experts": REQUIRED, "n_shared_experts": None, "num_experts_per_tok": REQUIRED,
    "routed_scaling_factor": 1.0, "n_group": None, "topk_group": None, "norm_topk_prob": False,
    "first_k_dense_replace": 0, "moe_layer_freq": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "attention_bias": False,
    "bos_token_id": None, "eos_token_id": None, **TRAINING_ONLY_MOE, **{f: None for f in ROPE_FIELDS},
}
V2_FIELDS = {"topk_method": "greedy"}
V3_FIELDS = {"rope_interleave": True, "num_nextn_predict_layers": 0}
V2_TOPK_METHODS = {"greedy": None, "group_limited_greedy": "max"}       # topk_method -> the group score


def deepseek_config(hf, raw=None) -> DeepseekConfig:
    """DeepseekConfig from an HF DeepSeek-V2 or -V3 config."""
    arch = first_architecture(hf)
    v3 = arch == "DeepseekV3ForCausalLM"
    f = read_fields(hf, {**DEEPSEEK_FIELDS, **(V3_FIELDS if v3 else V2_FIELDS)}, arch, raw)
    only_silu(f["hidden_act"], arch)
    heads, n = f["num_attention_heads"], f["num_hidden_layers"]
    if f["num_key_value_heads"] not in (None, heads):
        raise UnsupportedConfigError(f"config field num_key_value_heads={f['num_key_value_heads']} differs from "
                                     f"num_attention_heads={heads}; {arch}'s latent attention expands keys for "
                                     f"every head, so the two must be equal")
    if f["head_dim"] not in (None, f["qk_rope_head_dim"]):
        raise UnsupportedConfigError(f"config field head_dim={f['head_dim']} must equal qk_rope_head_dim="
                                     f"{f['qk_rope_head_dim']} (the rotary width transformers reads from it)")
    mla = MLAConfig(kv_lora_rank=int(f["kv_lora_rank"]), qk_nope_head_dim=int(f["qk_nope_head_dim"]),
                    qk_rope_head_dim=int(f["qk_rope_head_dim"]), v_head_dim=int(f["v_head_dim"]),
                    q_lora_rank=None if f["q_lora_rank"] is None else int(f["q_lora_rank"]),
                    rope_interleave=bool(f["rope_interleave"]) if v3 else True)
    routing = _v3_routing(f) if v3 else _v2_routing(f, arch)
    shared = int(f["n_shared_experts"] or 0) * int(f["moe_intermediate_size"])
    bias = bool(f["attention_bias"])
    return DeepseekConfig(
        architecture=arch, vocab_size=f["vocab_size"], hidden_size=f["hidden_size"],
        intermediate_size=f["intermediate_size"], num_layers=n, num_heads=heads, num_kv_heads=heads,
        head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim, norm_eps=float(f["rms_norm_eps"]),
        rope=rope_from_hf(hf), max_position_embeddings=int(f["max_position_embeddings"]),
        tie_word_embeddings=bool(f["tie_word_embeddings"]), qkv_bias=bias, o_bias=bias, mla=mla,
        num_experts=int(f["n_routed_experts"]), num_experts_per_tok=int(f["num_experts_per_tok"]),
        moe_intermediate_size=int(f["moe_intermediate_size"]), shared_expert_intermediate_size=shared or None,
        shared_gate=False, routed_scaling_factor=float(f["routed_scaling_factor"]),
        ff_kinds=_feed_forward_kinds(f, arch), bos_token_id=f["bos_token_id"],
        eos_token_ids=eos_ids(f["eos_token_id"]), **routing)


def _v2_routing(f: dict, arch: str) -> dict:
    method = f["topk_method"]
    if method not in V2_TOPK_METHODS:
        raise UnsupportedConfigError(f"config field topk_method={method!r} is not supported for {arch}; "
                                     f"supported: {sorted(V2_TOPK_METHODS)}")
    if f["norm_topk_prob"]:
        raise UnsupportedConfigError(f"config field norm_topk_prob=true: transformers' {arch} never renormalizes "
                                     f"the top-k weights (vLLM does), so the result is ambiguous; set it to false")
    group = V2_TOPK_METHODS[method]
    return dict(scoring_func="softmax", norm_topk_prob=False, **_groups(f, group))


def _v3_routing(f: dict) -> dict:
    return dict(scoring_func="sigmoid", correction_bias=True, norm_topk_prob=bool(f["norm_topk_prob"]),
                **_groups(f, "top2_sum"))


def _groups(f: dict, score: str | None) -> dict:
    if score is None or not f["n_group"] or int(f["n_group"]) == 1:
        return {}
    return dict(n_group=int(f["n_group"]), topk_group=int(f["topk_group"] or f["n_group"]), group_score=score)


def _feed_forward_kinds(f: dict, arch: str) -> tuple[str, ...] | None:
    """vLLM's rule: layer i is MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0 (transformers reads
    only the first; every published config has moe_layer_freq 1, where the two agree)."""
    first, freq, n = f["first_k_dense_replace"] or 0, f["moe_layer_freq"] or 1, f["num_hidden_layers"]
    if not isinstance(freq, int) or freq < 1 or not isinstance(first, int) or first < 0:
        raise UnsupportedConfigError(f"config fields first_k_dense_replace={first!r} and moe_layer_freq={freq!r} "
                                     f"must be a non-negative and a positive integer ({arch})")
    kinds = tuple("moe" if i >= first and i % freq == 0 else "dense" for i in range(n))
    return None if set(kinds) == {"moe"} else kinds


def deepseek_weights(cfg: DeepseekConfig) -> WeightTable:
    """The MoE table (router and V3's correction bias, per-expert or fused experts, the plural `shared_experts`,
    the dense layers) with MLA's projections and norms in place of q/k/v."""
    base = moe_weights(cfg, shared="shared_experts")
    return dataclasses.replace(_with_mla(cfg, base), variants=tuple(_with_mla(cfg, v) for v in base.variants))


def _with_mla(cfg: DeepseekConfig, table: WeightTable) -> WeightTable:
    hf, ours, m = "model.layers.{i}.self_attn", "model.layers.layers.self_attn", cfg.mla
    entries = [e for e in table.entries if not e.param.startswith(ours + ".")]
    linears = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"] + (["q_proj"] if m.q_lora_rank is None
                                                               else ["q_a_proj", "q_b_proj"])
    entries += [Entry(f"{hf}.{p}.weight", f"{ours}.{p}.kernel", "weight") for p in linears]
    if cfg.qkv_bias:                                   # attention_bias: the a-projections and o_proj
        entries += [Entry(f"{hf}.{p}.bias", f"{ours}.{p}.bias", "bias")
                    for p in ("kv_a_proj_with_mqa", "q_a_proj", "o_proj") if p in linears]
    norms = ["kv_a_layernorm"] + ([] if m.q_lora_rank is None else ["q_a_layernorm"])
    entries += [Entry(f"{hf}.{p}.weight", f"{ours}.{p}.weight", "weight") for p in norms]
    mtp = [f"model.layers.{cfg.num_layers + k}.*" for k in range(4)]     # multi-token prediction layers: unused
    return WeightTable(entries, tuple(table.ignored) + tuple(mtp))


register("DeepseekV2ForCausalLM", DeepseekV2ForCausalLM, config=deepseek_config, weights=deepseek_weights)
register("DeepseekV3ForCausalLM", DeepseekV3ForCausalLM, config=deepseek_config, weights=deepseek_weights)
