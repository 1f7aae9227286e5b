"""The one causal-LM shell every model shares, vLLM's composition (vllm/model_executor/models/llama.py).

    h = embed_tokens(ids)                                   vocab-parallel, one all-reduce (`DecoderModel.embed`)
    per layer (params stacked on a leading layer axis, run with lax.scan; `DecoderParts.layer`):
      h += o_proj(attn(qkv_proj(norm(h))))                  QKV column -> local heads -> row (all-reduce)
      h += mlp(norm(h))                                     the config's feed-forward part (all-reduce)
    logits = lm_head(norm(h))                               vocab-parallel, all-gathered (tied: embed_tokens)

Everything below runs inside `shard_map` on local shapes. With a paged KV cache
(tp_jax/models/cache.py) attention writes this step's keys and values into the pool and reads each
row's blocks (tp_jax/models/attention.py); without one it is a full causal forward. A model's class is
`CausalLM` under its HF name; a family that diverges sets `parts` (its modules, tp_jax/models/decoder.py) and
`body` (a `DecoderModel` with other embeddings: Gemma's scale, GPT-2's positions) and overrides `logits`
(Gemma's soft-cap) or `kv_layout` (DeepSeek's latent pool) in its model file.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tp_jax.models.attention import FULL_WINDOW
from tp_jax.models.cache import KVCache, KVLayout, run_layers
from tp_jax.models.decoder import DecoderConfig, DecoderParts
from tp_jax.parallel.heads import plan_heads
from tp_jax.parallel.layers import ParallelLMHead, VocabParallelEmbedding
from tp_jax.parallel.layers.stack import Stack
from tp_jax.parallel.pipeline import stage_layer_map


@dataclasses.dataclass(frozen=True)
class FeedForwardPlan:
    """Where each layer's feed-forward lives when a model has several kinds (`DecoderConfig.ff_kinds`).

    kinds: the kinds in stack order; stack_maps: kind -> its stack's slot -> HF layer (-1: padding), stage-major,
    every stage holding as many slots of the kind as the stage with the most; branch[slot] / local[slot]: for each
    slot of the model's layer stack, 1 + the index of its kind (0: an identity slot, no feed-forward) and its
    slot among the stage's slots of that kind's stack.
    """
    kinds: tuple[str, ...]
    maps: tuple[tuple[int, ...], ...]            # the kinds' stack maps, in `kinds` order (hashable: static)
    branch: tuple[int, ...]
    local: tuple[int, ...]

    @property
    def stack_maps(self) -> dict[str, tuple[int, ...]]:
        return dict(zip(self.kinds, self.maps))

    def caller(self, views: dict):
        """`mlp(slot, x)`: the feed-forward of the layer at global slot `slot` (traced), through a `lax.switch` over
        the kinds; `views`: kind -> its stack's `slot_view()`."""
        branch, local = jnp.asarray(self.branch, jnp.int32), jnp.asarray(self.local, jnp.int32)

        def run(kind, index, x):
            with views[kind](index) as ff:
                return ff(x)

        branches = [lambda index, x: jnp.zeros_like(x)] + [functools.partial(run, k) for k in self.kinds]
        return lambda slot, x: jax.lax.switch(branch[slot], branches, local[slot], x)


def feed_forward_plan(ff_kinds: tuple[str, ...], layer_map: tuple[int, ...], pp: int) -> FeedForwardPlan:
    kinds = tuple(sorted(set(ff_kinds)))
    per_stage = len(layer_map) // pp
    stages = [layer_map[s * per_stage:(s + 1) * per_stage] for s in range(pp)]
    maps, branch, local = {}, [0] * len(layer_map), [0] * len(layer_map)
    for b, kind in enumerate(kinds, start=1):
        of_stage = [[i for i in stage if i >= 0 and ff_kinds[i] == kind] for stage in stages]
        width = max(len(layers) for layers in of_stage)
        maps[kind] = tuple(i for layers in of_stage for i in layers + [-1] * (width - len(layers)))
        for s, stage in enumerate(stages):
            for j, i in enumerate(stage):
                if i >= 0 and ff_kinds[i] == kind:
                    branch[s * per_stage + j], local[s * per_stage + j] = b, of_stage[s].index(i)
    return FeedForwardPlan(kinds, tuple(maps[k] for k in kinds), tuple(branch), tuple(local))


class DecoderModel(nnx.Module):
    """ids[B, T], positions[B, T] -> (norm(h)[B, T, D], cache): embeddings, the stacked layers, the final norm.

    Args: `cfg` (DecoderConfig), `tp`, `dtype`, `rngs`, `pp` (pipeline stages: the stack is padded
    to a multiple of pp with identity slots, `layer_map`), `parts` (the classes the layers are built from).
    A family with other embeddings subclasses it and overrides `embed` (`CausalLM.body`).
    """

    def __init__(self, cfg: DecoderConfig, tp: int, dtype, rngs: nnx.Rngs, pp: int = 1,
                 parts: DecoderParts = DecoderParts()):
        d = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, d, tp_size=tp, dtype=dtype, rngs=rngs)
        self.layer_map = stage_layer_map(cfg.num_layers, pp)        # stacked slot -> HF layer (-1: identity)
        self.layers = Stack(lambda r: parts.layer(cfg, tp, dtype, r, parts), len(self.layer_map), rngs)
        self.norm = parts.make_norm(cfg, d, tp, dtype, rngs)
        self.varies = cfg.layer_types is not None       # layers differ: each is told its index (DecoderLayer)
        # feed-forwards of several kinds: one stack per kind, each stage's slots of it padded to the busiest stage
        self.ff_plan = None if cfg.ff_kinds is None else feed_forward_plan(cfg.ff_kinds, self.layer_map, pp)
        self.ff_stacks = None if self.ff_plan is None else nnx.Dict({
            kind: Stack(lambda r, kind=kind: parts.feed_forward(kind)(cfg, tp, dtype, r), len(m), rngs, layer_map=m)
            for kind, m in self.ff_plan.stack_maps.items()})

    def embed(self, ids, positions) -> jax.Array:
        """h[B, T, D] entering the first layer: the token embedding (one all-reduce over tp)."""
        return self.embed_tokens(ids)

    def __call__(self, ids, positions, cache: KVCache | None = None, microbatches: int = 1, lora=None):
        h = self.embed(ids, positions)
        h, cache = run_layers(self.layers, h, positions, cache, microbatches, self._slot_args(), lora)
        return self.norm(h), cache

    def _slot_args(self):
        """`slot -> (layer index, its feed-forward)` for layers that differ (None: they are alike)."""
        if not self.varies and self.ff_plan is None:
            return None
        hf = jnp.asarray(np.maximum(np.asarray(self.layer_map, np.int32), 0))
        mlp = None if self.ff_plan is None else self.ff_plan.caller(
            {kind: stack.slot_view() for kind, stack in self.ff_stacks.items()})
        return lambda slot: (hf[slot], None if mlp is None else functools.partial(mlp, slot))


class CausalLM(nnx.Module):
    """ids[B, T], positions[B, T] (+ a paged KV cache) -> logits[B, T, V] (local shapes, under shard_map).

    Args: `cfg` (DecoderConfig), `tp_size`, `pp_size`, `dtype`, `rngs`. The LM head is tied to
    `embed_tokens` unless `cfg.tie_word_embeddings` is false.

    A family whose math diverges states its own modules as class attributes: `parts` (a `DecoderParts`: the
    norm, attention, layer and dense feed-forward classes) and `body` (a `DecoderModel` subclass: embeddings),
    and overrides `logits` or `kv_layout` where they differ.

    The contract the engine relies on (keyword-only past the inputs):
      hidden_states(ids, positions, cache=None, *, microbatches=1, lora=None) -> (h[B, T, D], cache)
                                                     (lora: a step's LoRA adapters, tp_jax/parallel/layers/lora.py)
      logits(h[..., D]) -> [..., V]                  (all-gathered over tp)
      kv_layout() -> KVLayout                        (the pool this model needs)
      config, dtype, layer_map
    """

    parts: DecoderParts = DecoderParts()
    body: type[DecoderModel] = DecoderModel

    def __init__(self, cfg: DecoderConfig, *, tp_size: int = 1, pp_size: int = 1, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.config = cfg
        self.tp_size, self.pp_size = tp_size, pp_size
        self.dtype = np.dtype(dtype)
        self.model = self.body(cfg, tp_size, dtype, rngs, pp_size, self.parts)
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
        return KVLayout(len(self.layer_map), plan.padded_kv_heads, self.config.head_dim, self.dtype,
                        window=self.config.kv_window(), layer_windows=self.layer_windows())

    def layer_windows(self) -> tuple[int | None, ...] | None:
        """Each stacked slot's window (None: full attention; a pp identity slot the narrowest, holding nothing
        read), or None when every layer is alike (`DecoderConfig.layer_windows`)."""
        windows = self.config.layer_windows() if isinstance(self.config, DecoderConfig) else None
        if windows is None:
            return None
        windows = tuple(None if w == FULL_WINDOW else w for w in windows)
        narrowest = min((w for w in windows if w is not None), default=None)
        return tuple(windows[i] if i >= 0 else narrowest for i in self.layer_map)

    def hidden_states(self, ids, positions, cache: KVCache | None = None, *, microbatches: int = 1, lora=None):
        return self.model(ids, positions, cache, microbatches, lora)

    def logits(self, h: jax.Array) -> jax.Array:
        return self.model.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)

    def __call__(self, ids, positions, cache: KVCache | None = None, *, microbatches: int = 1):
        h, cache = self.hidden_states(ids, positions, cache, microbatches=microbatches)
        return self.logits(h), cache
