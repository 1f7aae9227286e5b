"""GPT2LMHeadModel on tp_jax layers, vLLM's composition (vllm/model_executor/models/gpt2.py).

    h = wte(ids) + wpe(positions)                  vocab-parallel (one all-reduce) + replicated positions
    per block (params stacked on a leading layer axis, run with lax.scan):
      h += c_proj(attn(c_attn(ln_1(h))))           fused QKV column -> local heads -> row (all-reduce)
      h += c_proj(gelu(c_fc(ln_2(h))))             column -> row (all-reduce)
    logits = ln_f(h) wte^T                         tied head, all-gathered

Everything runs inside `shard_map` on local shapes; attention goes through the one entry
point `attend` (dense, or over the paged KV cache), the stacked blocks through `run_layers`
(pipeline stages, micro-batches), and the LM head and engine contract come from the shared
causal-LM shell (`LlamaForCausalLM` with `model_cls = GPT2Model`), exactly as for Llama.

The checkpoint's storage is stated in the name table, not in the layers: GPT-2's Conv1D
weights are `[in, out]` (`layout="in_out"` on every kernel entry, so the square
`attn.c_proj` cannot be read the wrong way round), and `c_attn` holds q | k | v in one
tensor (three entries with row offsets 0, D, 2D). The end of the file holds the config
map, the name table and the registration.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from tp_jax.models.attention import attend
from tp_jax.models.cache import KVCache, LayerCache, run_layers
from tp_jax.models.config import REQUIRED, ModelConfig, UnsupportedConfigError, eos_ids, read_fields
from tp_jax.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from tp_jax.models.registry import first_architecture, register
from tp_jax.parallel.layers import (ColumnParallelLinear, Entry, LayerNorm, QKVParallelLinear, ReplicatedEmbedding,
                                    RowParallelLinear, Stack, VocabParallelEmbedding, WeightTable)
from tp_jax.parallel.pipeline import stage_layer_map

# HF `activation_function` -> the function (gelu_new is the tanh approximation).
ACTIVATIONS = {"gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
               "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
               "gelu": lambda x: jax.nn.gelu(x, approximate=False), "relu": jax.nn.relu}


class GPT2Attention(nnx.Module):
    def __init__(self, cfg: GPT2Config, tp: int, dtype, rngs: nnx.Rngs):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.c_attn = QKVParallelLinear(d, hd, cfg.num_heads, cfg.num_heads, tp_size=tp, bias=True, dtype=dtype,
                                        rngs=rngs)
        self.c_proj = RowParallelLinear.over_heads(self.c_attn.plan, hd, d, bias=True, dtype=dtype, rngs=rngs)
        self.scale = hd ** -0.5 if cfg.scale_attn_weights else 1.0

    def __call__(self, x, positions, cache: LayerCache | None):
        q, k, v = self.c_attn(x)                             # [B, T, heads_local, hd]; no rotary embedding
        out, cache = attend(q, k, v, positions, cache, scale=self.scale)
        return self.c_proj(out), cache


class GPT2MLP(nnx.Module):
    def __init__(self, cfg: GPT2Config, tp: int, dtype, rngs: nnx.Rngs):
        self.c_fc = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, tp_size=tp, dtype=dtype, rngs=rngs)
        self.c_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp_size=tp, dtype=dtype, rngs=rngs)
        self.activation = cfg.activation

    def __call__(self, x):
        return self.c_proj(ACTIVATIONS[self.activation](self.c_fc(x)))


class GPT2Block(LlamaDecoderLayer):
    """h += attn(ln_1(h)); h += mlp(ln_2(h)): Llama's pre-norm residual block (its `__call__`) built
    from LayerNorms with bias, GPT-2 attention and the GELU MLP. ln_1 / ln_2 are `input_layernorm`
    / `post_attention_layernorm` here (the name table maps them)."""

    def __init__(self, cfg: GPT2Config, tp: int, dtype, rngs: nnx.Rngs):
        norm = dict(eps=cfg.layer_norm_eps, tp_size=tp, dtype=dtype, rngs=rngs)
        self.input_layernorm = LayerNorm(cfg.hidden_size, **norm)
        self.self_attn = GPT2Attention(cfg, tp, dtype, rngs)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, **norm)
        self.mlp = GPT2MLP(cfg, tp, dtype, rngs)


class GPT2Model(nnx.Module):
    """The decoder: token + position embeddings, the stacked blocks, the final LayerNorm.

    `embed_tokens` (wte) and `layer_map` are what the causal-LM shell reads (tied head, loader).
    """

    def __init__(self, cfg: GPT2Config, tp: int, dtype, rngs: nnx.Rngs, pp: int = 1):
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_size=tp, dtype=dtype,
                                                   rngs=rngs)
        self.wpe = ReplicatedEmbedding(cfg.max_position_embeddings, cfg.hidden_size, tp_size=tp, dtype=dtype,
                                       rngs=rngs)
        self.layer_map = stage_layer_map(cfg.num_layers, pp)        # stacked slot -> HF layer (-1: identity)
        self.h = Stack(lambda r: GPT2Block(cfg, tp, dtype, r), len(self.layer_map), rngs)
        self.ln_f = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, tp_size=tp, dtype=dtype, rngs=rngs)

    def __call__(self, ids, positions, cache: KVCache | None = None, microbatches: int = 1):
        h = self.embed_tokens(ids) + self.wpe(positions)
        h, cache = run_layers(self.h, h, positions, cache, microbatches)
        return self.ln_f(h), cache


class GPT2LMHeadModel(LlamaForCausalLM):
    """ids[B, T], positions[B, T] (+ a paged KV cache) -> logits[B, T, V] (local shapes, under shard_map).

    Args: `cfg` (GPT2Config), `tp_size`, `pp_size`, `dtype`, `rngs`. `LlamaForCausalLM` is the
    causal-LM shell every model here shares: it builds `model_cls` (the decoder) and the LM head
    (tied to `embed_tokens` unless the config unties it) and implements the engine contract
    (`hidden_states`, `logits`, `kv_layout`, `config`, `dtype`, `layer_map`); GPT-2 only brings
    its decoder.
    """
    model_cls = GPT2Model


# --- config: the HF fields GPT-2 reads -----------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class GPT2Config(ModelConfig):
    """ModelConfig plus GPT-2's own fields: intermediate_size (MLP width), layer_norm_eps,
    activation (an `ACTIVATIONS` name), scale_attn_weights (divide scores by sqrt(head_dim))."""
    intermediate_size: int
    layer_norm_eps: float = 1e-5
    activation: str = "gelu_new"
    scale_attn_weights: bool = True


# HF config field -> default when the config lacks it (REQUIRED: config.json must state it).
GPT2_FIELDS = {
    "vocab_size": REQUIRED, "n_embd": REQUIRED, "n_layer": REQUIRED, "n_head": REQUIRED,
    "n_positions": 1024, "n_inner": None,             # None: 4 * n_embd
    "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
    "scale_attn_weights": True, "bos_token_id": None, "eos_token_id": None,
}


def gpt2_config(hf, raw=None) -> GPT2Config:
    """GPT2Config from an HF config; other fields (scale_attn_by_inverse_layer_idx,
    reorder_and_upcast_attn, add_cross_attention) are refused unless they have their defaults."""
    arch = first_architecture(hf)
    f = read_fields(hf, GPT2_FIELDS, arch, raw)
    if f["activation_function"] not in ACTIVATIONS:
        raise UnsupportedConfigError(f"config field activation_function={f['activation_function']!r} is not "
                                     f"supported for {arch}; supported: {sorted(ACTIVATIONS)}")
    d, heads = f["n_embd"], f["n_head"]
    if d % heads:
        raise UnsupportedConfigError(f"config fields n_embd={d} and n_head={heads}: n_embd must be a multiple "
                                     f"of n_head")
    return GPT2Config(
        architecture=arch, vocab_size=f["vocab_size"], hidden_size=d, num_layers=f["n_layer"], num_heads=heads,
        num_kv_heads=heads, head_dim=d // heads, max_position_embeddings=int(f["n_positions"]),
        tie_word_embeddings=bool(f["tie_word_embeddings"]), bos_token_id=f["bos_token_id"],
        eos_token_ids=eos_ids(f["eos_token_id"]), intermediate_size=f["n_inner"] or 4 * d,
        layer_norm_eps=float(f["layer_norm_epsilon"]), activation=f["activation_function"],
        scale_attn_weights=bool(f["scale_attn_weights"]))


# --- weights: HF tensor names -> params ---------------------------------------------------------

def gpt2_weights(cfg: GPT2Config) -> WeightTable:
    """HF GPT-2 names (as transformers saves GPT2LMHeadModel) -> param parts."""
    hf, ours, d = "transformer.h.{i}", "model.h.layers", cfg.hidden_size
    entries = [Entry("transformer.wte.weight", "model.embed_tokens.embedding", "weight"),
               Entry("transformer.wpe.weight", "model.wpe.embedding", "weight")]
    for norm_hf, norm in (("transformer.ln_f", "model.ln_f"), (f"{hf}.ln_1", f"{ours}.input_layernorm"),
                          (f"{hf}.ln_2", f"{ours}.post_attention_layernorm")):
        entries += [Entry(f"{norm_hf}.{p}", f"{norm}.{p}", p) for p in ("weight", "bias")]
    for part, offset in (("q", 0), ("k", d), ("v", 2 * d)):          # c_attn = q | k | v, Conv1D [in, out]
        entries += [Entry(f"{hf}.attn.c_attn.weight", f"{ours}.self_attn.c_attn.kernel", part, "in_out", offset),
                    Entry(f"{hf}.attn.c_attn.bias", f"{ours}.self_attn.c_attn.bias", part, offset=offset)]
    for conv, module in (("attn.c_proj", "self_attn.c_proj"), ("mlp.c_fc", "mlp.c_fc"), ("mlp.c_proj", "mlp.c_proj")):
        entries += [Entry(f"{hf}.{conv}.weight", f"{ours}.{module}.kernel", "weight", "in_out"),
                    Entry(f"{hf}.{conv}.bias", f"{ours}.{module}.bias", "bias")]
    if not cfg.tie_word_embeddings:
        entries.append(Entry("lm_head.weight", "lm_head.embedding", "weight"))
    ignored = [f"{hf}.attn.bias", f"{hf}.attn.masked_bias"]       # causal-mask buffers of old checkpoints
    return WeightTable(entries, ignored + (["lm_head.weight"] if cfg.tie_word_embeddings else []))


register("GPT2LMHeadModel", GPT2LMHeadModel, config=gpt2_config, weights=gpt2_weights)
