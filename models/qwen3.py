"""Qwen3ForCausalLM: Llama's graph with a per-head RMSNorm on q and k before RoPE.

    q, k, v = qkv_proj(x)                      [B, T, q_local | kv_local, hd]
    q, k = q_norm(q), k_norm(k)                RMSNorm over hd, weight [hd] replicated on every rank
    q, k = rope(q), rope(k)

Padded query slots of the head plan stay zero through the norm (0 * rsqrt(eps) = 0).
q/k/v/o biases follow `attention_bias` (off in released checkpoints); head_dim is explicit.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx

from tp_jax.parallel.layers.norm import RMSNorm
from tp_jax.models.config import ModelConfig
from tp_jax.models.llama import LlamaAttention, LlamaForCausalLM, llama_config, llama_model_with, llama_weights
from tp_jax.models.registry import register


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, tp: int, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, tp, dtype, rngs)
        norm = dict(eps=cfg.rms_norm_eps, tp_size=tp, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(cfg.head_dim, **norm) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, **norm) if cfg.qk_norm else None

    def normalize_qk(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        if self.q_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama's params plus self_attn.q_norm / k_norm [head_dim] per layer."""
    model_cls = llama_model_with(Qwen3Attention)


register("Qwen3ForCausalLM", Qwen3ForCausalLM,
         config=functools.partial(llama_config, window="per_layer", qk_norm=True), weights=llama_weights)
