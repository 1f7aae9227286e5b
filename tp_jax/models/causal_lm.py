"""The one causal-LM shell every model shares, vLLM's composition (vllm/model_executor/models/llama.py).

    h = embed_tokens(ids) (* sqrt(D)) (+ embed_positions(positions))   vocab-parallel, one all-reduce
    per layer (params stacked on a leading layer axis, run with lax.scan; `DecoderLayer`):
      h += o_proj(attn(qkv_proj(norm(h))))                  QKV column -> local heads -> row (all-reduce)
      h += mlp(norm(h))                                     the config's feed-forward part (all-reduce)
    logits = lm_head(norm(h))                               vocab-parallel, all-gathered (tied: embed_tokens),
                                                            soft-capped if `final_softcap`

Everything below runs inside `shard_map` on local shapes. With a paged KV cache
(tp_jax/models/cache.py) attention writes this step's keys and values into the pool and reads each
row's blocks (tp_jax/models/attention.py); without one it is a full causal forward. What differs
between models is in the config (`DecoderConfig`, tp_jax/models/decoder.py); a model file holds its
config map, its HF name table and `register(...)`, and its class is `CausalLM` by another name.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tp_jax.models.attention import soft_cap
from tp_jax.models.cache import KVCache, KVLayout, run_layers
from tp_jax.models.decoder import DecoderConfig, DecoderLayer, make_norm
from tp_jax.parallel.heads import plan_heads
from tp_jax.parallel.layers import ParallelLMHead, ReplicatedEmbedding, VocabParallelEmbedding
from tp_jax.parallel.layers.stack import Stack
from tp_jax.parallel.pipeline import stage_layer_map


class DecoderModel(nnx.Module):
    """ids[B, T], positions[B, T] -> (norm(h)[B, T, D], cache): embeddings, the stacked layers, the final norm.

    Args: `cfg` (DecoderConfig), `tp`, `dtype`, `rngs`, `pp` (pipeline stages: the stack is padded
    to a multiple of pp with identity slots, `layer_map`).
    """

    def __init__(self, cfg: DecoderConfig, tp: int, dtype, rngs: nnx.Rngs, pp: int = 1):
        d = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, d, tp_size=tp, dtype=dtype, rngs=rngs)
        self.embed_positions = (ReplicatedEmbedding(cfg.max_position_embeddings, d, tp_size=tp, dtype=dtype,
                                                    rngs=rngs) if cfg.learned_positions else None)
        self.layer_map = stage_layer_map(cfg.num_layers, pp)        # stacked slot -> HF layer (-1: identity)
        self.layers = Stack(lambda r: DecoderLayer(cfg, tp, dtype, r), len(self.layer_map), rngs)
        self.norm = make_norm(cfg, d, tp, dtype, rngs)
        self.embed_scale = math.sqrt(d) if cfg.embed_scale else None
        self.varies = cfg.layer_types is not None       # layers differ: each is told its index (DecoderLayer)

    def __call__(self, ids, positions, cache: KVCache | None = None, microbatches: int = 1):
        h = self.embed_tokens(ids)
        if self.embed_scale is not None:                # rounded to the dtype first, as transformers does
            h = h * jnp.asarray(self.embed_scale, h.dtype)
        if self.embed_positions is not None:
            h = h + self.embed_positions(positions)
        h, cache = run_layers(self.layers, h, positions, cache, microbatches,
                              self.layer_map if self.varies else None)
        return self.norm(h), cache


class CausalLM(nnx.Module):
    """ids[B, T], positions[B, T] (+ a paged KV cache) -> logits[B, T, V] (local shapes, under shard_map).

    Args: `cfg` (DecoderConfig), `tp_size`, `pp_size`, `dtype`, `rngs`. The LM head is tied to
    `embed_tokens` unless `cfg.tie_word_embeddings` is false.

    The contract the engine relies on (keyword-only past the inputs):
      hidden_states(ids, positions, cache=None, *, microbatches=1) -> (h[B, T, D], cache)
      logits(h[..., D]) -> [..., V]                  (all-gathered over tp)
      kv_layout() -> KVLayout                        (the pool this model needs)
      config, dtype, layer_map
    """

    def __init__(self, cfg: DecoderConfig, *, tp_size: int = 1, pp_size: int = 1, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.config = cfg
        self.tp_size, self.pp_size = tp_size, pp_size
        self.dtype = np.dtype(dtype)
        self.model = DecoderModel(cfg, tp_size, dtype, rngs, pp_size)
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
        logits = self.model.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)
        return soft_cap(logits, self.config.final_softcap)

    def __call__(self, ids, positions, cache: KVCache | None = None, *, microbatches: int = 1):
        h, cache = self.hidden_states(ids, positions, cache, microbatches=microbatches)
        return self.logits(h), cache
