"""The decoder layer every model shares (Llama's), its parts, and what a family that diverges overrides.

    DecoderLayer:  h += self_attn(input_layernorm(h))            pre-norm residual, two all-reduces
                   h += mlp(post_attention_layernorm(h))
    Attention:     q, k, v = qkv_proj(x)                          QKV column -> local heads
                   q, k = q_norm(q), k_norm(k)                    if `qk_norm` (Qwen3, Gemma 3), per head
                   q, k = rope(q), rope(k)                        if `rope` is not None (not GPT-2)
                   o_proj(attend(q, k, v, window))                row (all-reduce)
    DenseMLP:      down_proj(act(gate) * up), gate | up = gate_up_proj(x)

`DecoderConfig` holds what these shared parts read: sizes, biases, the per-head q/k norm, the window, the
rotary embedding, the score scale, the activation (`ACTIVATIONS`) and the feed-forward kind (`FEED_FORWARDS`:
"dense", and "moe", which tp_jax/models/moe.py adds; each built as `make(cfg, tp, dtype, rngs)` and called as
`mlp(x)` on local shapes x[B, T, D] -> [B, T, D], its all-reduce inside).

A family whose math diverges owns its modules, in its model file (or one module named for the feature),
composed from the parallel layers and these classes, and names them in `DecoderParts` (the norm, attention,
layer and dense feed-forward classes): Gemma's sandwich norms, soft-caps and local rotary (gemma2.py),
OLMo 2's post-norms and whole-width q/k norms (olmo2.py), gpt-oss's sinks (gpt_oss.py), GPT-2's LayerNorm
and ungated MLP (gpt2.py), DeepSeek's latent attention (mla.py). The hooks they override: `Attention.norm_qk`,
`rope_freq`, `attend_args`; `DecoderLayer.norms` and `__call__`.

Layers of one stack may differ in value (`layer_types`): a layer's window (and Gemma 3's rotary frequencies)
are rows of static per-layer tables, indexed by the layer's index (a traced int the stack passes in), so the
stack stays one scan of one layer body. A uniform model (`layer_types` None) builds no table. Everything runs
inside `shard_map` on local shapes; tp_jax/models/causal_lm.py wraps the layers in the one causal-LM shell.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tp_jax.models.attention import FULL_WINDOW, attend
from tp_jax.models.cache import LayerCache
from tp_jax.models.config import ModelConfig
from tp_jax.models.rope import RopeConfig, for_context, inv_freq, rotate_together
from tp_jax.parallel.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tp_jax.parallel.layers.norm import RMSNorm

LAYER_TYPES = ("full_attention", "sliding_attention")

# config `hidden_act` (HF's names) -> the function; gelu_new / gelu_pytorch_tanh are the tanh approximation.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu, "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False), "relu": jax.nn.relu}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig(ModelConfig):
    """ModelConfig plus the fields the shared decoder parts read (a family's own fields are its subclass's).

    Args (besides ModelConfig's):
      intermediate_size: the feed-forward width F.
      norm_eps: the norms' epsilon.
      qkv_bias, o_bias: biases on q/k/v and on the output projection.
      qk_norm: a per-head norm on q and k before the rotary embedding (Qwen3, Gemma 3).
      sliding_window: keys a query sees, itself included (None: full attention).
      rope: the rotary embedding (`RopeConfig`); None: none (GPT-2's positions are learned: `GPT2Model`).
      attention_scale: the score scale (None: head_dim ** -0.5).
      hidden_act: an `ACTIVATIONS` name; mlp_bias: biases on the feed-forward projections.
      feed_forward: a `FEED_FORWARDS` name, the feed-forward part of every layer.
      layer_types: None (every layer alike: `sliding_window` applies to all), or one `LAYER_TYPES` entry per
        layer: "sliding_attention" layers see `sliding_window` keys (Gemma 3's rotate with its `local_rope`),
        "full_attention" layers see every key.
      ff_kinds: None (every layer's feed-forward is `feed_forward`), or a `FEED_FORWARDS` name per layer (a
        Qwen MoE stack with dense layers): each kind's layers are their own stack (tp_jax/models/causal_lm.py).
    """
    intermediate_size: int
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    rope: RopeConfig | None = RopeConfig()
    attention_scale: float | None = None
    hidden_act: str = "silu"
    mlp_bias: bool = False
    feed_forward: str = "dense"
    layer_types: tuple[str, ...] | None = None
    ff_kinds: tuple[str, ...] | None = None

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        if not isinstance(self.intermediate_size, int) or self.intermediate_size < 1:
            raise ValueError(f"{name}: intermediate_size={self.intermediate_size!r} must be a positive integer.")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"{name}: sliding_window={self.sliding_window!r} must be a positive integer "
                             f"(the number of most recent keys a query sees, itself included) or None.")
        for field, table in (("hidden_act", ACTIVATIONS), ("feed_forward", FEED_FORWARDS)):
            if getattr(self, field) not in table:
                raise ValueError(f"{name}: {field}={getattr(self, field)!r}; choose one of {sorted(table)}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise ValueError(f"{name}: layer_types={self.layer_types!r} must name one of {LAYER_TYPES} for "
                                 f"each of the {self.num_layers} layers")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError(f"{name}: layer_types has sliding layers but sliding_window is None")
        if self.ff_kinds is not None and (len(self.ff_kinds) != self.num_layers or
                                          not set(self.ff_kinds) <= set(FEED_FORWARDS)):
            raise ValueError(f"{name}: ff_kinds={self.ff_kinds!r} must name one of {sorted(FEED_FORWARDS)} for each "
                             f"of the {self.num_layers} layers")

    def layer_windows(self) -> tuple[int, ...] | None:
        """Each layer's window (`FULL_WINDOW` for a global layer), or None when every layer is alike."""
        if self.layer_types is None:
            return None
        return tuple(self.sliding_window if t == "sliding_attention" else FULL_WINDOW for t in self.layer_types)

    def kv_window(self) -> int | None:
        """The window every layer attends within (the KV cache may drop older keys), or None: some layer sees all."""
        return self.sliding_window if self.layer_types is None else None

    def for_context(self, max_model_len: int) -> DecoderConfig:
        """This config for sequences of up to `max_model_len` tokens: the rotary embedding that depends on the
        context (LongRoPE's factor set, tp_jax/models/rope.py `for_context`) chosen for it."""
        rope = for_context(self.rope, max_model_len)
        return self if rope == self.rope else dataclasses.replace(self, rope=rope)


def for_max_model_len(cfg: ModelConfig, max_model_len: int) -> ModelConfig:
    """`cfg` for an engine holding sequences of up to `max_model_len` tokens (`DecoderConfig.for_context`); other
    configs as they are."""
    return cfg.for_context(max_model_len) if isinstance(cfg, DecoderConfig) else cfg


class Attention(nnx.Module):
    """x[B, T, D] -> [B, T, D]: QKV column -> (q/k norm) -> (rope) -> `attend` -> o_proj row (all-reduce).

    Args: `cfg` (DecoderConfig: heads, biases, qk_norm, window, rope, scale), `tp`, `dtype`, `rngs`.
    Heads follow the head plan of `qkv_proj` (padded q slots stay zero through the q norm:
    0 * rsqrt(eps) = 0).
    """

    def __init__(self, cfg: DecoderConfig, tp: int, dtype, rngs: nnx.Rngs, parts: DecoderParts):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.qkv_proj = QKVParallelLinear(d, hd, cfg.num_heads, cfg.num_kv_heads, tp_size=tp, bias=cfg.qkv_bias,
                                          dtype=dtype, rngs=rngs)
        self.o_proj = RowParallelLinear.over_heads(self.qkv_proj.plan, hd, d, bias=cfg.o_bias, dtype=dtype,
                                                   rngs=rngs)
        self.q_norm = parts.make_norm(cfg, hd, tp, dtype, rngs) if cfg.qk_norm else None
        self.k_norm = parts.make_norm(cfg, hd, tp, dtype, rngs) if cfg.qk_norm else None
        self.freq = None if cfg.rope is None else tuple(inv_freq(cfg.rope, hd).tolist())   # static, not state
        self.rope_scale = 1.0 if cfg.rope is None else cfg.rope.attention_factor
        self.scale = hd ** -0.5 if cfg.attention_scale is None else cfg.attention_scale
        self.window, self.layer_windows = cfg.sliding_window, cfg.layer_windows()

    def __call__(self, x, positions, cache: LayerCache | None, layer: jax.Array | None = None):
        """`layer`: this layer's index in the model (a traced int32), read only when the layers differ."""
        q, k, v = self.qkv_proj(x)                           # [B, T, q_local | kv_local, hd]
        q, k = self.norm_qk(q, k)
        if self.freq is not None:
            q, k = rotate_together(q, k, positions, self.rope_freq(layer), self.rope_scale)
        window = self.window
        if self.layer_windows is not None:
            window = jnp.asarray(np.asarray(self.layer_windows, np.int32))[layer]
        out, cache = attend(q, k, v, positions, cache, scale=self.scale, window=window, **self.attend_args())
        return self.o_proj(out), cache

    def rope_freq(self, layer):
        """The inverse frequencies layer `layer` rotates with (every layer alike here; Gemma 3's differ)."""
        return np.asarray(self.freq, np.float32)

    def norm_qk(self, q, k):
        """q and k after their norms (per head when `qk_norm`); a family with other q/k norms overrides it."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k

    def attend_args(self) -> dict:
        """More keyword arguments of `attend` (a soft-cap, sinks): none here; a family's attention adds its own."""
        return {}


class DenseMLP(nnx.Module):
    """x[B, T, D] -> [B, T, D]: down_proj(act(gate) * up), gate | up = gate_up_proj(x): column W[D, 2 F_tp] merged,
    row W[F_tp, D].

    Args: `cfg` (DecoderConfig: intermediate_size, hidden_act, mlp_bias), `tp`, `dtype`, `rngs`.
    """

    def __init__(self, cfg: DecoderConfig, tp: int, dtype, rngs: nnx.Rngs):
        d, f, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_up_proj = MergedColumnParallelLinear(d, (f, f), tp_size=tp, bias=bias, dtype=dtype, rngs=rngs)
        self.down_proj = RowParallelLinear(f, d, tp_size=tp, bias=bias, dtype=dtype, rngs=rngs)
        self.act = cfg.hidden_act

    def __call__(self, x):
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))           # [B, T, F_tp] each
        return self.down_proj(ACTIVATIONS[self.act](gate) * up)


# config `feed_forward` -> make(cfg, tp, dtype, rngs), a module called as mlp(x[B, T, D]) -> [B, T, D]; listed here,
# each named where it lives ("module:function", imported when first built: moe.py imports this module)
FEED_FORWARDS: dict[str, str] = {"dense": "tp_jax.models.decoder:DenseMLP", "moe": "tp_jax.models.moe:make_moe"}


def feed_forward_maker(kind: str) -> Callable[[DecoderConfig, int, object, nnx.Rngs], nnx.Module]:
    """The make(cfg, tp, dtype, rngs) `FEED_FORWARDS` names for `kind`."""
    import importlib
    module, name = FEED_FORWARDS[kind].split(":")
    return getattr(importlib.import_module(module), name)


class DecoderLayer(nnx.Module):
    """h[B, T, D] -> h + attention(norm(h)), then + mlp(norm(h)): the pre-norm decoder layer (Llama's).

    Args: `cfg` (DecoderConfig: `feed_forward` the mlp), `tp`, `dtype`, `rngs`, `parts` (the norm, attention and
    feed-forward classes). A family whose norms sit elsewhere subclasses it: `norms` names the layer's norms (as
    HF names them; the name tables read it) and `__call__` places them. Zero weights (a pipeline identity slot)
    add exactly zero.
    """
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")

    def __init__(self, cfg: DecoderConfig, tp: int, dtype, rngs: nnx.Rngs, parts: DecoderParts):
        for name in self.norms:
            setattr(self, name, parts.make_norm(cfg, cfg.hidden_size, tp, dtype, rngs))
        self.self_attn = parts.attention(cfg, tp, dtype, rngs, parts)
        self.mlp = parts.feed_forward(cfg.feed_forward)(cfg, tp, dtype, rngs) if cfg.ff_kinds is None else None

    def __call__(self, h, positions, cache: LayerCache | None, layer: jax.Array | None = None, mlp=None):
        """`layer`: the layer's index (layers that differ); `mlp`: its feed-forward when the model holds the
        feed-forwards in stacks of their own (`ff_kinds`), else `self.mlp`."""
        mlp = self.mlp if mlp is None else mlp
        a, cache = self.self_attn(self.input_layernorm(h), positions, cache, layer)
        h = h + a
        return h + mlp(self.post_attention_layernorm(h)), cache


@dataclasses.dataclass(frozen=True)
class DecoderParts:
    """The module classes a decoder is built from, Llama's by default. A family whose math diverges names its
    own in its `CausalLM` subclass (`parts = DecoderParts(attention=...)`), defined in its model file or in one
    module named for the feature and composed from the parallel layers (docs/adding_a_model.md).

      norm:      every norm of the model (the layers', the final one, per-head q/k norms), built as
                 norm(dim, eps=, tp_size=, dtype=, rngs=)
      attention: attention(cfg, tp, dtype, rngs, parts), called as (x, positions, cache, layer) -> (y, cache)
      layer:     layer(cfg, tp, dtype, rngs, parts), called as (h, positions, cache, layer, mlp) -> (h, cache)
      dense:     the "dense" feed-forward, make(cfg, tp, dtype, rngs) (other kinds: `FEED_FORWARDS`)
    """
    norm: type[nnx.Module] = RMSNorm
    attention: type[nnx.Module] = Attention
    layer: type[nnx.Module] = DecoderLayer
    dense: Callable = DenseMLP

    def make_norm(self, cfg: DecoderConfig, dim: int, tp: int, dtype, rngs: nnx.Rngs) -> nnx.Module:
        """The model's norm over the last axis of size `dim`, replicated on every rank."""
        return self.norm(dim, eps=cfg.norm_eps, tp_size=tp, dtype=dtype, rngs=rngs)

    def feed_forward(self, kind: str) -> Callable:
        """make(cfg, tp, dtype, rngs) of the feed-forward kind `kind` (a `FEED_FORWARDS` name)."""
        return self.dense if kind == "dense" else feed_forward_maker(kind)
