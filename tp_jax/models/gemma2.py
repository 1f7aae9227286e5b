"""Gemma2ForCausalLM: Gemma's modules, its config (HF fields -> `GemmaConfig`) and the registration; Gemma 3
reuses all of it (tp_jax/models/gemma3.py).

Llama's decoder (tp_jax/models/decoder.py) with Gemma's own modules, defined here:

    h = embed_tokens(ids) * sqrt(D)                  `GemmaModel` (sqrt(D) rounded to the model's dtype)
    per layer (`GemmaDecoderLayer`: sandwich norms, every norm y = norm(x) * (1 + w) in float32, `GemmaRMSNorm`):
      h += post_attention_layernorm(attn(input_layernorm(h)))
      h += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
    attn (`GemmaAttention`): scores * query_pre_attn_scalar**-0.5 (`attention_scale`), soft-capped
          cap * tanh(s / cap) (`attn_softcap`), a window on the layers `layer_types` marks "sliding_attention"
          (even layers by default), which rotate with `local_rope` when it is set (Gemma 3)
    mlp: gelu_tanh(gate) * up (hidden_activation)
    logits = soft_cap(norm(h) embed_tokens^T, final_softcap)          tied head

The name table is Llama's with the four norms of `GemmaDecoderLayer`. The layers differ only in their window
and rotary frequencies, rows of per-layer tables, so the stack stays one scan.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tp_jax.models.attention import soft_cap
from tp_jax.models.causal_lm import CausalLM, DecoderModel
from tp_jax.models.config import REQUIRED, UnsupportedConfigError, eos_ids, read_fields
from tp_jax.models.decoder import ACTIVATIONS, Attention, DecoderConfig, DecoderLayer, DecoderParts
from tp_jax.models.llama import llama_weights
from tp_jax.models.registry import first_architecture, register
from tp_jax.models.rope import RopeConfig, for_context, inv_freq, rope_from_hf
from tp_jax.parallel.layers.norm import GemmaRMSNorm


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmaConfig(DecoderConfig):
    """DecoderConfig plus Gemma's fields.

    Args (besides DecoderConfig's): attn_softcap, final_softcap: tanh soft-capping of the attention scores and of
    the logits (None: none); local_rope: the sliding layers' rotary embedding (None: `rope`; Gemma 3's local base).
    """
    attn_softcap: float | None = None
    final_softcap: float | None = None
    local_rope: RopeConfig | None = None

    def __post_init__(self):
        super().__post_init__()
        for field in ("attn_softcap", "final_softcap"):
            cap = getattr(self, field)
            if cap is not None and not cap > 0:
                raise ValueError(f"{type(self).__name__}: {field}={cap!r} must be a positive number or None")

    def layer_ropes(self) -> tuple[RopeConfig, ...] | None:
        """Each layer's rotary embedding, or None when every layer rotates alike."""
        if self.layer_types is None or self.rope is None or self.local_rope in (None, self.rope):
            return None
        return tuple(self.local_rope if t == "sliding_attention" else self.rope for t in self.layer_types)

    def for_context(self, max_model_len: int) -> GemmaConfig:
        cfg, local = super().for_context(max_model_len), for_context(self.local_rope, max_model_len)
        return cfg if local == cfg.local_rope else dataclasses.replace(cfg, local_rope=local)


class GemmaAttention(Attention):
    """Llama's attention with soft-capped scores and, when the layers rotate differently (`local_rope`), each
    layer's inverse frequencies a row of a static per-layer table indexed by the layer."""

    def __init__(self, cfg: GemmaConfig, tp: int, dtype, rngs, parts: DecoderParts):
        super().__init__(cfg, tp, dtype, rngs, parts)
        ropes = cfg.layer_ropes()
        self.layer_freqs = None if ropes is None else tuple(tuple(inv_freq(r, cfg.head_dim).tolist()) for r in ropes)
        self.softcap = cfg.attn_softcap

    def rope_freq(self, layer):
        if self.layer_freqs is None:
            return super().rope_freq(layer)
        return jnp.asarray(np.asarray(self.layer_freqs, np.float32))[layer]

    def attend_args(self) -> dict:
        return {} if self.softcap is None else {"softcap": self.softcap}


class GemmaDecoderLayer(DecoderLayer):
    """Sandwich norms: each sub-block's input and output normalized (four norms per layer)."""
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")

    def __call__(self, h, positions, cache, layer=None, mlp=None):
        mlp = self.mlp if mlp is None else mlp
        a, cache = self.self_attn(self.input_layernorm(h), positions, cache, layer)
        h = h + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(mlp(self.pre_feedforward_layernorm(h))), cache


class GemmaModel(DecoderModel):
    """The token embeddings times sqrt(D), rounded to the model's dtype first, as transformers does."""

    def embed(self, ids, positions) -> jax.Array:
        h = super().embed(ids, positions)
        return h * jnp.asarray(math.sqrt(h.shape[-1]), h.dtype)


class Gemma2ForCausalLM(CausalLM):
    """The shared causal-LM shell with Gemma's modules and soft-capped logits."""
    parts = DecoderParts(norm=GemmaRMSNorm, attention=GemmaAttention, layer=GemmaDecoderLayer)
    body = GemmaModel

    def logits(self, h: jax.Array) -> jax.Array:
        return soft_cap(super().logits(h), self.config.final_softcap)


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


def gemma_config(hf, raw=None, *, qk_norm: bool = False, local_rope: bool = False) -> GemmaConfig:
    """GemmaConfig from an HF Gemma 2 config (Gemma 3 text: `qk_norm`, and `local_rope`: `rope_parameters`
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
    return GemmaConfig(
        architecture=arch, vocab_size=f["vocab_size"], hidden_size=f["hidden_size"],
        intermediate_size=f["intermediate_size"], num_layers=f["num_hidden_layers"],
        num_heads=f["num_attention_heads"], num_kv_heads=f["num_key_value_heads"], head_dim=f["head_dim"],
        norm_eps=float(f["rms_norm_eps"]), rope=rope, local_rope=local, max_position_embeddings=int(f["max_position_embeddings"]),
        tie_word_embeddings=bool(f["tie_word_embeddings"]), qkv_bias=bias, o_bias=bias, qk_norm=qk_norm,
        hidden_act=f["hidden_activation"], attention_scale=float(f["query_pre_attn_scalar"]) ** -0.5,
        attn_softcap=None if caps[0] is None else float(caps[0]),
        final_softcap=None if caps[1] is None else float(caps[1]),
        sliding_window=int(f["sliding_window"]) if "sliding_attention" in types else None,
        layer_types=types if len(set(types)) > 1 else None,             # None: every layer alike
        bos_token_id=f["bos_token_id"], eos_token_ids=eos_ids(f["eos_token_id"]))


gemma_weights = functools.partial(llama_weights, norms=GemmaDecoderLayer.norms)

register("Gemma2ForCausalLM", Gemma2ForCausalLM, config=gemma_config, weights=gemma_weights)
