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

The end of the file holds what the loader needs besides the modules: `LlamaConfig` and
the HF config fields it reads (`LLAMA_FIELDS`, `llama_config`), the HF weight-name table
(`llama_weights`) and the registration.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tp_jax.parallel.layers import (Entry, MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                    RowParallelLinear, VocabParallelEmbedding, WeightTable)
from tp_jax.parallel.layers.loading import expand_heads
from tp_jax.parallel.layers.norm import RMSNorm
from tp_jax.models.attention import attend
from tp_jax.models.cache import KVCache, KVLayout, LayerCache, run_layers
from tp_jax.models.config import REQUIRED, ModelConfig, UnsupportedConfigError, eos_ids, read_fields
from tp_jax.models.registry import first_architecture, register
from tp_jax.models.rope import ROPE_FIELDS, RopeConfig, apply_rope, inv_freq, rope_from_hf
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


# --- config: the HF fields the Llama family reads ----------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(ModelConfig):
    """ModelConfig plus the Llama family's own fields.

    Args (besides ModelConfig's): intermediate_size (MLP width), rms_norm_eps, rope
    (`RopeConfig`), attention_bias, mlp_bias, qk_norm (Qwen3's per-head q/k RMSNorm),
    sliding_window (keys a query sees, itself included; None: full attention).
    """
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig()
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.intermediate_size, int) or self.intermediate_size < 1:
            raise ValueError(f"LlamaConfig: intermediate_size={self.intermediate_size!r} must be a positive integer.")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"LlamaConfig: sliding_window={self.sliding_window!r} must be a positive integer "
                             f"(the number of most recent keys a query sees, itself included) or None.")


# HF config field -> default when the config lacks it (REQUIRED: config.json must state it).
LLAMA_FIELDS = {
    "vocab_size": REQUIRED, "hidden_size": REQUIRED, "intermediate_size": REQUIRED,
    "num_hidden_layers": REQUIRED, "num_attention_heads": REQUIRED, "rms_norm_eps": REQUIRED,
    "num_key_value_heads": None,          # None: num_attention_heads (multi-head attention)
    "head_dim": None,                     # None: hidden_size // num_attention_heads
    "hidden_act": "silu", "max_position_embeddings": 2048, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "sliding_window": None,
    "bos_token_id": None, "eos_token_id": None,
    **{f: None for f in ROPE_FIELDS},     # None: default rope, theta 10000 (models/rope.py)
}
# Qwen2/3: a window only on the layers HF marks "sliding_attention".
PER_LAYER_WINDOW_FIELDS = {"use_sliding_window": False, "max_window_layers": 0, "layer_types": None}
WINDOW_MODES = ("none", "all", "per_layer")


def llama_config(hf, raw=None, *, window: str = "none", qk_norm: bool = False) -> LlamaConfig:
    """LlamaConfig from an HF config. `window`: how the architecture reads `sliding_window`
    ("none": must be unset; "all": every layer slides, Mistral; "per_layer": Qwen2/3, refused
    unless no layer slides). `qk_norm`: the architecture has q/k norms (Qwen3)."""
    if window not in WINDOW_MODES:
        raise ValueError(f"llama_config: window={window!r}; choose one of {WINDOW_MODES}")
    arch = first_architecture(hf)
    fields = {**LLAMA_FIELDS, **(PER_LAYER_WINDOW_FIELDS if window == "per_layer" else {})}
    f = read_fields(hf, fields, arch, raw)
    if f["hidden_act"] not in ("silu", "swish"):
        raise UnsupportedConfigError(f"config field hidden_act={f['hidden_act']!r} is not supported for {arch}; "
                                     f"only 'silu'")
    heads = f["num_attention_heads"]
    return LlamaConfig(
        architecture=arch, vocab_size=f["vocab_size"], hidden_size=f["hidden_size"],
        intermediate_size=f["intermediate_size"], num_layers=f["num_hidden_layers"], num_heads=heads,
        num_kv_heads=f["num_key_value_heads"] or heads, head_dim=f["head_dim"] or f["hidden_size"] // heads,
        rms_norm_eps=float(f["rms_norm_eps"]), rope=rope_from_hf(hf),
        max_position_embeddings=int(f["max_position_embeddings"]),
        tie_word_embeddings=bool(f["tie_word_embeddings"]), attention_bias=bool(f["attention_bias"]),
        mlp_bias=bool(f["mlp_bias"]), qk_norm=qk_norm, sliding_window=_sliding_window(f, arch, window),
        bos_token_id=f["bos_token_id"], eos_token_ids=eos_ids(f["eos_token_id"]))


def _sliding_window(f: dict, arch: str, mode: str) -> int | None:
    """The window every layer uses (None: full attention), or UnsupportedConfigError naming the field."""
    window = f["sliding_window"]
    if window is None or mode == "all":
        return None if window is None else int(window)
    if mode == "per_layer":
        if not f["use_sliding_window"]:
            return None
        first = int(f["max_window_layers"] or 0)
        types = list(f["layer_types"] or ["sliding_attention" if i >= first else "full_attention"
                                          for i in range(f["num_hidden_layers"])])
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
        if not sliding:
            return None
        raise UnsupportedConfigError(
            f"config field use_sliding_window=true (sliding_window={window}, max_window_layers={first}) gives "
            f"{arch} layers {sliding[0]}..{sliding[-1]} a sliding window and the others full attention; tp_jax "
            f"does not support per-layer windows. Set use_sliding_window to false for full attention")
    raise UnsupportedConfigError(f"config field sliding_window={window} (an active sliding window) is not "
                                 f"supported for {arch}; set it to null for full attention")


# --- weights: HF tensor names -> params ---------------------------------------------------------

def llama_weights(cfg: LlamaConfig, *, qkv_bias: bool | None = None, o_bias: bool | None = None) -> WeightTable:
    """HF Llama names -> param parts; biases default to `attention_bias` (Qwen2 passes its own)."""
    qkv_bias = cfg.attention_bias if qkv_bias is None else qkv_bias
    o_bias = cfg.attention_bias if o_bias is None else o_bias
    hf, ours = "model.layers.{i}", "model.layers.layers"
    entries = [Entry("model.embed_tokens.weight", "model.embed_tokens.embedding", "weight"),
               Entry("model.norm.weight", "model.norm.weight", "weight"),
               Entry(f"{hf}.input_layernorm.weight", f"{ours}.input_layernorm.weight", "weight"),
               Entry(f"{hf}.post_attention_layernorm.weight", f"{ours}.post_attention_layernorm.weight", "weight")]
    if not cfg.tie_word_embeddings:
        entries.append(Entry("lm_head.weight", "lm_head.embedding", "weight"))
    linears = [(f"{hf}.self_attn.{p}_proj", f"{ours}.self_attn.qkv_proj", p, qkv_bias) for p in "qkv"]
    linears += [(f"{hf}.self_attn.o_proj", f"{ours}.self_attn.o_proj", None, o_bias),
                (f"{hf}.mlp.gate_proj", f"{ours}.mlp.gate_up_proj", "0", cfg.mlp_bias),
                (f"{hf}.mlp.up_proj", f"{ours}.mlp.gate_up_proj", "1", cfg.mlp_bias),
                (f"{hf}.mlp.down_proj", f"{ours}.mlp.down_proj", None, cfg.mlp_bias)]
    for name, module, part, bias in linears:
        entries.append(Entry(f"{name}.weight", f"{module}.kernel", part or "weight"))
        if bias:
            entries.append(Entry(f"{name}.bias", f"{module}.bias", part or "bias"))
    if cfg.qk_norm:
        entries += [Entry(f"{hf}.self_attn.{n}.weight", f"{ours}.self_attn.{n}.weight", "weight")
                    for n in ("q_norm", "k_norm")]
    ignored = [f"{hf}.self_attn.rotary_emb.inv_freq"] + (["lm_head.weight"] if cfg.tie_word_embeddings else [])
    return WeightTable(entries, ignored)


register("LlamaForCausalLM", LlamaForCausalLM, config=llama_config, weights=llama_weights)
