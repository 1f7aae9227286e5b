"""LlamaForCausalLM on tp_jax layers, vLLM's composition (vllm/model_executor/models/llama.py).

    h = embed(ids)                                     vocab-parallel, one all-reduce
    per layer (params stacked on a leading layer axis, run with lax.scan):
      h += o_proj(attn(rope(qkv_proj(norm(h)))))       QKV column -> local heads -> row (all-reduce)
      h += down_proj(silu(gate) * up)                  merged column -> row (all-reduce)
    logits = lm_head(norm(h))                          vocab-parallel, all-gathered

Everything below runs inside `shard_map` on local shapes. With a paged KV cache
(models/cache.py) attention writes this step's keys and values into the pool and reads each
row's blocks (models/attention.py); without one it is a full causal forward.
Qwen2, Qwen3 and Mistral subclass these pieces (models/qwen2.py, qwen3.py, mistral.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tp_jax.parallel.layers import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RowParallelLinear,
                           VocabParallelEmbedding)
from tp_jax.parallel.layers.loading import expand_heads
from tp_jax.parallel.layers.norm import RMSNorm
from tp_jax.models.attention import attend
from tp_jax.models.cache import KVCache, KVLayout, LayerCache, run_layers
from tp_jax.models.config import ModelConfig
from tp_jax.models.registry import register
from tp_jax.models.rope import apply_rope, inv_freq
from tp_jax.parallel.layers.stack import Stack
from tp_jax.parallel.heads import plan_heads
from tp_jax.parallel.pipeline import stage_layer_map


class LlamaAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, tp: int, dtype, rngs: nnx.Rngs):
        qkv_bias, o_bias = self.biases(cfg)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          tp_size=tp, bias=qkv_bias, dtype=dtype, rngs=rngs)
        plan = self.qkv_proj.plan
        self.o_proj = RowParallelLinear(plan.padded_q_heads * cfg.head_dim, cfg.hidden_size, tp_size=tp,
                                        bias=o_bias, in_rows=expand_heads(plan.q_heads, cfg.head_dim),
                                        hf_in_features=cfg.num_heads * cfg.head_dim, dtype=dtype, rngs=rngs)
        self.freq = tuple(inv_freq(cfg.rope, cfg.head_dim).tolist())     # static, not state
        self.scale = cfg.head_dim ** -0.5
        self.window = cfg.sliding_window

    def biases(self, cfg: ModelConfig) -> tuple[bool, bool]:
        """Hook: (q/k/v bias, o_proj bias). Llama ties both to `attention_bias`; Qwen2 overrides."""
        return cfg.attention_bias, cfg.attention_bias

    def normalize_qk(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Hook before RoPE: identity for Llama; Qwen3 applies per-head RMSNorm."""
        return q, k

    def qkv(self, x: jax.Array, positions: jax.Array):
        q, k, v = self.qkv_proj(x)                           # [B, T, q_local | kv_local, hd]
        q, k = self.normalize_qk(q, k)
        freq = np.asarray(self.freq, np.float32)
        return apply_rope(q, positions, freq), apply_rope(k, positions, freq), v

    def __call__(self, x, positions, cache: LayerCache | None):
        q, k, v = self.qkv(x, positions)
        out, cache = attend(q, k, v, positions, cache, scale=self.scale, window=self.window)
        return self.o_proj(out), cache


class LlamaMLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, tp: int, dtype, rngs: nnx.Rngs):
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, (size, size), tp_size=tp,
                                                       bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, tp_size=tp, bias=cfg.mlp_bias,
                                           dtype=dtype, rngs=rngs)

    def __call__(self, x):
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(jax.nn.silu(gate) * up)


class LlamaDecoderLayer(nnx.Module):
    attention_cls = LlamaAttention

    def __init__(self, cfg: ModelConfig, tp: int, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, tp_size=tp, dtype=dtype, rngs=rngs)
        self.self_attn = self.attention_cls(cfg, tp, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, tp_size=tp, dtype=dtype,
                                                rngs=rngs)
        self.mlp = LlamaMLP(cfg, tp, dtype, rngs)

    def __call__(self, h, positions, cache: LayerCache | None):
        a, cache = self.self_attn(self.input_layernorm(h), positions, cache)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h)), cache


class LlamaModel(nnx.Module):
    layer_cls = LlamaDecoderLayer

    def __init__(self, cfg: ModelConfig, tp: int, dtype, rngs: nnx.Rngs, pp: int = 1):
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_size=tp, dtype=dtype,
                                                   rngs=rngs)
        self.layer_map = stage_layer_map(cfg.num_layers, pp)        # stacked slot -> HF layer (-1: identity)
        self.layers = Stack(lambda r: self.layer_cls(cfg, tp, dtype, r), len(self.layer_map), rngs)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, tp_size=tp, dtype=dtype, rngs=rngs)

    def __call__(self, ids, positions, cache: KVCache | None = None, microbatches: int = 1):
        h, cache = run_layers(self.layers, self.embed_tokens(ids), positions, cache, microbatches)
        return self.norm(h), cache


@register("LlamaForCausalLM")
class LlamaForCausalLM(nnx.Module):
    """ids[B, T], positions[B, T] (+ a paged KV cache) -> logits[B, T, V] (local shapes, under shard_map).

    The contract the engine relies on (keyword-only past the inputs):
      hidden_states(ids, positions, cache=None, *, microbatches=1) -> (h[B, T, D], cache)
      logits(h[..., D]) -> [..., V]                  (all-gathered over tp)
      kv_layout() -> KVLayout                        (the pool this model needs)
      config, dtype, layer_map
    """
    model_cls = LlamaModel

    def __init__(self, cfg: ModelConfig, *, tp_size: int = 1, pp_size: int = 1, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.tp_size, self.pp_size = tp_size, pp_size
        self.dtype = np.dtype(dtype)
        self.model = self.model_cls(cfg, tp_size, dtype, rngs, pp_size)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp_size=tp_size, dtype=dtype, rngs=rngs)

    @property
    def layer_map(self) -> tuple[int, ...]:
        """Stacked layer slot -> HF layer index (-1: identity padding for pp), for the loader."""
        return self.model.layer_map

    def kv_layout(self) -> KVLayout:
        plan = plan_heads(self.config.num_heads, self.config.num_kv_heads, self.tp_size)
        return KVLayout(len(self.layer_map), plan.padded_kv_heads, self.config.head_dim, self.dtype)

    def hidden_states(self, ids, positions, cache: KVCache | None = None, *, microbatches: int = 1):
        return self.model(ids, positions, cache, microbatches)

    def logits(self, h: jax.Array) -> jax.Array:
        if self.lm_head is None:
            return self.model.embed_tokens.attend(h)
        return self.lm_head(h)

    def __call__(self, ids, positions, cache: KVCache | None = None, *, microbatches: int = 1):
        h, cache = self.hidden_states(ids, positions, cache, microbatches=microbatches)
        return self.logits(h), cache


def llama_model_with(attention: type[LlamaAttention]) -> type[LlamaModel]:
    """LlamaModel whose decoder layers use `attention` (a LlamaAttention subclass): the hook for
    models that differ from Llama only inside attention (Qwen2, Qwen3)."""
    class DecoderLayer(LlamaDecoderLayer):
        attention_cls = attention

    class Model(LlamaModel):
        layer_cls = DecoderLayer

    return Model
