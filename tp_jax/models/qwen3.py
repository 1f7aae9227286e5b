"""Qwen3ForCausalLM: Llama's config map and name table with a per-head RMSNorm on q and k before RoPE.

    q, k, v = qkv_proj(x)                      [B, T, q_local | kv_local, hd]
    q, k = q_norm(q), k_norm(k)                RMSNorm over hd, weight [hd] replicated on every rank
    q, k = rope(q), rope(k)

`qk_norm=True` in the config builds the norms (tp_jax/models/decoder.py) and adds their entries to
the name table. q/k/v/o biases follow `attention_bias` (off in released checkpoints); head_dim
is explicit.
"""

from __future__ import annotations

import functools

from tp_jax.models.causal_lm import CausalLM
from tp_jax.models.llama import llama_config, llama_weights
from tp_jax.models.registry import register


class Qwen3ForCausalLM(CausalLM):
    """The shared causal-LM shell; Llama's params plus self_attn.q_norm / k_norm [head_dim] per layer."""


register("Qwen3ForCausalLM", Qwen3ForCausalLM,
         config=functools.partial(llama_config, window="per_layer", qk_norm=True), weights=llama_weights)
