"""Gemma2ForCausalLM: the config map (HF fields -> `DecoderConfig`) and the registration; Gemma 3 reuses the map.

The shared graph with Gemma's parts, all chosen by the config:

    h = embed_tokens(ids) * sqrt(D)                  embed_scale (sqrt(D) rounded to the model's dtype)
    per layer (sandwich norms, every norm y = norm(x) * (1 + w) in float32: norm="gemma_rms"):
      h += post_attention_layernorm(attn(input_layernorm(h)))
      h += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
    attn: scores * query_pre_attn_scalar**-0.5, soft-capped cap * tanh(s / cap) (attn_logit_softcapping),
          a window on the layers `layer_types` marks "sliding_attention" (even layers by default)
    mlp: gelu_tanh(gate) * up (hidden_activation)
    logits = soft_cap(norm(h) embed_tokens^T, final_logit_softcapping)          tied head

The name table is Llama's (four norms per layer). The layers differ only in their window, a per-layer
table row (tp_jax/models/decoder.py), so the stack stays one scan.
"""

from __future__ import annotations

from tp_jax.models.causal_lm import CausalLM
from tp_jax.models.config import REQUIRED, UnsupportedConfigError, eos_ids, read_fields
from tp_jax.models.decoder import ACTIVATIONS, DecoderConfig
from tp_jax.models.llama import llama_weights
from tp_jax.models.registry import first_architecture, register
from tp_jax.models.rope import rope_from_hf


class Gemma2ForCausalLM(CausalLM):
    """The shared causal-LM shell; everything Gemma-specific is in `gemma_config`."""


# HF config field -> default when the config lacks it (REQUIRED: config.json must state it).
GEMMA_FIELDS = {
    "vocab_size": REQUIRED, "hidden_size": REQUIRED, "intermediate_size": REQUIRED,
    "num_hidden_layers": REQUIRED, "num_attention_heads": REQUIRED, "num_key_value_heads": REQUIRED,
    "head_dim": REQUIRED, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "attention_bias": False,
    "query_pre_attn_scalar": REQUIRED, "sliding_window": None, "layer_types": None,
    "attn_logit_softcapping": None, "final_logit_softcapping": None, "use_bidirectional_attention": None,
    "rope_parameters": None, "bos_token_id": None, "eos_token_id": None,
}


def gemma_config(hf, raw=None, *, qk_norm: bool = False, local_rope: bool = False) -> DecoderConfig:
    """DecoderConfig from an HF Gemma 2 config (Gemma 3 text: `qk_norm`, and `local_rope`: `rope_parameters`
    holds one rotary per layer type, the sliding layers' with the local base)."""
    arch = first_architecture(hf)
    f = read_fields(hf, GEMMA_FIELDS, arch, raw)
    if f["hidden_activation"] not in ACTIVATIONS:
        raise UnsupportedConfigError(f"config field hidden_activation={f['hidden_activation']!r} is not supported "
                                     f"for {arch}; supported: {sorted(ACTIVATIONS)}")
    if f["use_bidirectional_attention"]:
        raise UnsupportedConfigError(f"config field use_bidirectional_attention=true makes {arch} an encoder "
                                     f"(every token sees every other); tp_jax runs causal decoders only")
    types = tuple(f["layer_types"] or ())
    if len(types) != f["num_hidden_layers"]:
        raise UnsupportedConfigError(f"config field layer_types has {len(types)} entries for {arch}'s "
                                     f"{f['num_hidden_layers']} layers (num_hidden_layers)")
    if "sliding_attention" in types and not f["sliding_window"]:
        raise UnsupportedConfigError(f"config field layer_types marks sliding layers of {arch} but "
                                     f"sliding_window={f['sliding_window']!r}; state the window")
    params = f["rope_parameters"] or {}
    if local_rope:
        rope, local = (rope_from_hf(hf, params.get(t)) for t in ("full_attention", "sliding_attention"))
    else:
        rope, local = rope_from_hf(hf), None
    bias, caps = bool(f["attention_bias"]), (f["attn_logit_softcapping"], f["final_logit_softcapping"])
    return DecoderConfig(
        architecture=arch, vocab_size=f["vocab_size"], hidden_size=f["hidden_size"],
        intermediate_size=f["intermediate_size"], num_layers=f["num_hidden_layers"],
        num_heads=f["num_attention_heads"], num_kv_heads=f["num_key_value_heads"], head_dim=f["head_dim"],
        norm="gemma_rms", norm_eps=float(f["rms_norm_eps"]), norm_placement="sandwich", embed_scale=True,
        rope=rope, local_rope=local, max_position_embeddings=int(f["max_position_embeddings"]),
        tie_word_embeddings=bool(f["tie_word_embeddings"]), qkv_bias=bias, o_bias=bias, qk_norm=qk_norm,
        hidden_act=f["hidden_activation"], gated_mlp=True, attention_scale=float(f["query_pre_attn_scalar"]) ** -0.5,
        attn_softcap=None if caps[0] is None else float(caps[0]),
        final_softcap=None if caps[1] is None else float(caps[1]),
        sliding_window=int(f["sliding_window"]) if "sliding_attention" in types else None,
        layer_types=types if len(set(types)) > 1 else None,             # None: every layer alike
        bos_token_id=f["bos_token_id"], eos_token_ids=eos_ids(f["eos_token_id"]))


register("Gemma2ForCausalLM", Gemma2ForCausalLM, config=gemma_config, weights=llama_weights)
