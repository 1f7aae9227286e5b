"""Phi3ForCausalLM (Phi-3, Phi-3.5, Phi-4, Phi-4-mini): Llama's layer with fused checkpoint tensors and LongRoPE.

    qkv_proj.weight      [(H + 2 KV) * hd, D]   q | k | v rows: three entries of our QKV layer at row offsets
    gate_up_proj.weight  [2 F, D]               gate | up rows: two entries of our merged gate_up layer
    rotary: `longrope` (short / long factors, attention factor; tp_jax/models/rope.py), over the first
            partial_rotary_factor * hd dims of each head (Phi-4-mini: 0.75)
    sliding_window: every layer slides when set (Phi-3-mini-4k: 2047), as transformers' Phi3Model does

The loader reads each device's rows of the fused tensors (the offsets are in the name table), so no layer
is subclassed and nothing is split after loading.
"""

from __future__ import annotations

import dataclasses

from tp_jax.models.causal_lm import CausalLM
from tp_jax.models.config import REQUIRED, UnsupportedConfigError, eos_ids, head_dim_of, only_silu, read_fields
from tp_jax.models.decoder import DecoderConfig
from tp_jax.models.llama import llama_weights
from tp_jax.models.registry import first_architecture, register
from tp_jax.models.rope import ROPE_FIELDS, rope_from_hf
from tp_jax.parallel.layers import Entry, WeightTable


class Phi3ForCausalLM(CausalLM):
    """The shared causal-LM shell; everything Phi-3-specific is in `phi3_config` and `phi3_weights`."""


# HF config field -> default when the config lacks it (REQUIRED: config.json must state it).
PHI3_FIELDS = {
    "vocab_size": REQUIRED, "hidden_size": REQUIRED, "intermediate_size": REQUIRED,
    "num_hidden_layers": REQUIRED, "num_attention_heads": REQUIRED, "num_key_value_heads": None,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "max_position_embeddings": 4096,
    "original_max_position_embeddings": None, "partial_rotary_factor": None, "tie_word_embeddings": False,
    "sliding_window": None, "bos_token_id": None, "eos_token_id": None,
    **{f: None for f in ROPE_FIELDS},
}


def phi3_config(hf, raw=None) -> DecoderConfig:
    """DecoderConfig from an HF Phi-3 config."""
    arch = first_architecture(hf)
    f = read_fields(hf, PHI3_FIELDS, arch, raw)
    only_silu(f["hidden_act"], arch)
    heads, d, hd = f["num_attention_heads"], f["hidden_size"], head_dim_of(f, "hidden_size", "num_attention_heads")
    rope = rope_from_hf(hf, partial=True)
    if int(hd * rope.partial_rotary_factor) % 2:
        raise UnsupportedConfigError(f"config field partial_rotary_factor={rope.partial_rotary_factor} leaves an odd "
                                     f"number of rotary dims per head ({hd} * factor)")
    window = f["sliding_window"]
    return DecoderConfig(
        architecture=arch, vocab_size=f["vocab_size"], hidden_size=d, intermediate_size=f["intermediate_size"],
        num_layers=f["num_hidden_layers"], num_heads=heads, num_kv_heads=f["num_key_value_heads"] or heads,
        head_dim=hd, norm_eps=float(f["rms_norm_eps"]), rope=rope,
        max_position_embeddings=int(f["max_position_embeddings"]), tie_word_embeddings=bool(f["tie_word_embeddings"]),
        hidden_act="silu", sliding_window=None if window is None else int(window),
        bos_token_id=f["bos_token_id"], eos_token_ids=eos_ids(f["eos_token_id"]))


def phi3_weights(cfg: DecoderConfig) -> WeightTable:
    """Llama's table with q / k / v read from rows of `qkv_proj` and gate / up from rows of `gate_up_proj`."""
    base = llama_weights(cfg)
    hf, ours = "model.layers.{i}", "model.layers.layers"
    q, kv, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    fused = [Entry(f"{hf}.self_attn.qkv_proj.weight", f"{ours}.self_attn.qkv_proj.kernel", part, offset=offset)
             for part, offset in (("q", 0), ("k", q), ("v", q + kv))]
    fused += [Entry(f"{hf}.mlp.gate_up_proj.weight", f"{ours}.mlp.gate_up_proj.kernel", part, offset=offset)
              for part, offset in (("0", 0), ("1", f))]
    split = (f"{ours}.self_attn.qkv_proj.kernel", f"{ours}.mlp.gate_up_proj.kernel")
    entries = [e for e in base.entries if e.param not in split] + fused
    return dataclasses.replace(base, entries=tuple(entries))


register("Phi3ForCausalLM", Phi3ForCausalLM, config=phi3_config, weights=phi3_weights)
