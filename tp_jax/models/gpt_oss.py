"""GptOssForCausalLM (gpt-oss-20b / 120b): its attention, the config map (HF fields -> `MoEConfig`), the name table,
the registration.

The shared graph with gpt-oss's parts: its attention (`SinkAttention`) defined here, the rest chosen by the config:

    per layer (pre-norm RMSNorm):
      h += o_proj(attn(qkv_proj(norm(h))))     q/k/v and o biases; YaRN rotary; sliding (window 128) and full
                                               layers alternate (`layer_types`); a learned sink logit per head
                                               joins each softmax's denominator (`SinkAttention`)
      h += moe(norm(h))                        router with bias: top-k of the logits, softmax over the k;
                                               experts with biases, gate | up interleaved in one fused tensor,
                                               act = (clamp(up, -l, l) + 1) * g * sigmoid(alpha * g),
                                               g = clamp(gate, max=l)
    logits = lm_head(norm(h))

The experts' checkpoint tensors are fused over experts, stored [in, out] (`gate_up_proj [E, D, 2F]`,
`down_proj [E, F, D]`); the published MXFP4 checkpoints store them as `*_blocks` / `*_scales`, which the
loader presents under these float names (tp_jax/loaders/packed.py), so one table reads both; the "mxfp4" method
keeps them as stored (tp_jax/loaders/mxfp4.py, layers/packed.py).
"""

from __future__ import annotations

from tp_jax.models.causal_lm import CausalLM
from tp_jax.models.config import REQUIRED, UnsupportedConfigError, eos_ids, read_fields
from tp_jax.models.decoder import LAYER_TYPES, Attention, DecoderParts
from tp_jax.models.llama import llama_weights
from tp_jax.models.moe import TRAINING_ONLY_MOE, MoEConfig
from tp_jax.models.registry import first_architecture, register
from tp_jax.models.rope import ROPE_FIELDS, rope_from_hf
from tp_jax.parallel.layers import Entry, WeightTable
from tp_jax.parallel.layers.qkv import AttentionSinks


class SinkAttention(Attention):
    """Llama's attention with a learned logit per query head in each softmax's denominator (`AttentionSinks`, laid
    out by the head plan like the q rows; every attention backend takes `sinks`)."""

    def __init__(self, cfg, tp: int, dtype, rngs, parts: DecoderParts):
        super().__init__(cfg, tp, dtype, rngs, parts)
        self.sinks = AttentionSinks(self.qkv_proj.plan, dtype=dtype, rngs=rngs)

    def attend_args(self) -> dict:
        return {"sinks": self.sinks()}


class GptOssForCausalLM(CausalLM):
    """The shared causal-LM shell with `SinkAttention`; the rest of gpt-oss is in `gpt_oss_config` and
    `gpt_oss_weights`."""
    parts = DecoderParts(attention=SinkAttention)


# HF config field -> default when the config lacks it (REQUIRED: config.json must state it).
GPT_OSS_FIELDS = {
    "vocab_size": REQUIRED, "hidden_size": REQUIRED, "intermediate_size": REQUIRED,
    "num_hidden_layers": REQUIRED, "num_attention_heads": REQUIRED, "num_key_value_heads": REQUIRED,
    "head_dim": None, "num_local_experts": REQUIRED, "num_experts_per_tok": REQUIRED,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "attention_bias": True, "sliding_window": None, "layer_types": None,
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "bos_token_id": None, "eos_token_id": None,
    "hidden_act": None,             # the reference never applies it: the experts' activation is fixed
    **TRAINING_ONLY_MOE, **{f: None for f in ROPE_FIELDS},
}


def gpt_oss_config(hf, raw=None) -> MoEConfig:
    """MoEConfig from an HF gpt-oss config."""
    arch = first_architecture(hf)
    f = read_fields(hf, GPT_OSS_FIELDS, arch, raw)
    n, heads = f["num_hidden_layers"], f["num_attention_heads"]
    types = tuple(f["layer_types"] or ("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)))
    if len(types) != n or not set(types) <= set(LAYER_TYPES):
        raise UnsupportedConfigError(f"config field layer_types={list(types)} must name one of {LAYER_TYPES} for each "
                                     f"of {arch}'s {n} layers (num_hidden_layers)")
    sliding = "sliding_attention" in types
    if sliding and not f["sliding_window"]:
        raise UnsupportedConfigError(f"config field layer_types marks sliding layers of {arch} but "
                                     f"sliding_window={f['sliding_window']!r}; state the window")
    bias = bool(f["attention_bias"])
    return MoEConfig(
        architecture=arch, vocab_size=f["vocab_size"], hidden_size=f["hidden_size"],
        intermediate_size=f["intermediate_size"], num_layers=n, num_heads=heads,
        num_kv_heads=f["num_key_value_heads"], head_dim=f["head_dim"] or f["hidden_size"] // heads,
        norm_eps=float(f["rms_norm_eps"]), rope=rope_from_hf(hf),
        max_position_embeddings=int(f["max_position_embeddings"]), tie_word_embeddings=bool(f["tie_word_embeddings"]),
        qkv_bias=bias, o_bias=bias,
        sliding_window=int(f["sliding_window"]) if sliding else None,
        layer_types=types if len(set(types)) > 1 else None,
        num_experts=int(f["num_local_experts"]), num_experts_per_tok=int(f["num_experts_per_tok"]),
        moe_intermediate_size=int(f["intermediate_size"]), norm_topk_prob=True, router_bias=True,
        expert_bias=True, expert_act="swigluoai", swiglu_alpha=float(f["swiglu_alpha"]),
        swiglu_limit=float(f["swiglu_limit"]), interleaved_gate_up=True,
        bos_token_id=f["bos_token_id"], eos_token_ids=eos_ids(f["eos_token_id"]))


def gpt_oss_weights(cfg: MoEConfig) -> WeightTable:
    """Llama's attention, norm and embedding names (with biases) plus sinks, the biased router and fused experts."""
    base = llama_weights(cfg)
    hf, ours = "model.layers.{i}", "model.layers.layers"
    entries = [e for e in base.entries if not e.param.startswith(f"{ours}.mlp.")]
    entries += [Entry(f"{hf}.self_attn.sinks", f"{ours}.self_attn.sinks.weight", "weight"),
                Entry(f"{hf}.mlp.router.weight", f"{ours}.mlp.gate.kernel", "weight"),
                Entry(f"{hf}.mlp.router.bias", f"{ours}.mlp.gate.bias", "bias")]
    experts = f"{hf}.mlp.experts"
    for e in range(cfg.num_experts):
        entries += [Entry(f"{experts}.gate_up_proj", f"{ours}.mlp.experts.gate_up", f"gate_up.{e}", "in_out",
                          index=e),
                    Entry(f"{experts}.gate_up_proj_bias", f"{ours}.mlp.experts.gate_up_bias", f"gate_up.{e}", index=e),
                    Entry(f"{experts}.down_proj", f"{ours}.mlp.experts.down", f"down.{e}", "in_out", index=e),
                    Entry(f"{experts}.down_proj_bias", f"{ours}.mlp.experts.down_bias", f"down.{e}", index=e)]
    return WeightTable(entries, base.ignored)


register("GptOssForCausalLM", GptOssForCausalLM, config=gpt_oss_config, weights=gpt_oss_weights)
