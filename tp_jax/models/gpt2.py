"""GPT2LMHeadModel: its modules, the config map (HF fields -> `DecoderConfig`), the HF name table, the registration.

GPT-2 is the shared graph (tp_jax/models/causal_lm.py, tp_jax/models/decoder.py) with its own modules, defined
here, and Llama's attention chosen by the config:

    h = wte(ids) + wpe(positions)                  `GPT2Model`: a replicated position table
    per block (every norm a LayerNorm with bias):
      h += c_proj(attn(c_attn(ln_1(h))))           rope=None, q/k/v and o biases, scale 1 / sqrt(hd) or 1
      h += c_proj(gelu(c_fc(ln_2(h))))             `GPT2MLP`: ungated, hidden_act="gelu_new", biases
    logits = ln_f(h) wte^T                         tied head

The checkpoint's storage is stated in the name table, not in the layers: GPT-2's Conv1D
weights are `[in, out]` (`layout="in_out"` on every kernel entry, so the square
`attn.c_proj` cannot be read the wrong way round), and `c_attn` holds q | k | v in one
tensor (three entries of `qkv_proj` with row offsets 0, D, 2D).
"""

from __future__ import annotations

import jax
from flax import nnx

from tp_jax.models.causal_lm import CausalLM, DecoderModel
from tp_jax.models.config import REQUIRED, UnsupportedConfigError, eos_ids, head_dim_of, read_fields
from tp_jax.models.decoder import ACTIVATIONS, DecoderConfig, DecoderParts
from tp_jax.models.registry import first_architecture, register
from tp_jax.parallel.layers import (ColumnParallelLinear, Entry, LayerNorm, ReplicatedEmbedding, RowParallelLinear,
                                    WeightTable)

# HF `activation_function` values GPT-2 runs (names of tp_jax/models/decoder.py's ACTIVATIONS).
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu")


class GPT2MLP(nnx.Module):
    """x[B, T, D] -> down_proj(act(up_proj(x))): c_fc column W[D, F_tp] -> act -> c_proj row W[F_tp, D], biases."""

    def __init__(self, cfg: DecoderConfig, tp: int, dtype, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.up_proj = ColumnParallelLinear(d, f, tp_size=tp, bias=True, dtype=dtype, rngs=rngs)
        self.down_proj = RowParallelLinear(f, d, tp_size=tp, bias=True, dtype=dtype, rngs=rngs)
        self.act = cfg.hidden_act

    def __call__(self, x):
        return self.down_proj(ACTIVATIONS[self.act](self.up_proj(x)))


class GPT2Model(DecoderModel):
    """The decoder with learned positions: a replicated table wpe[max_position_embeddings, D] added to the
    token embedding."""

    def __init__(self, cfg: DecoderConfig, tp: int, dtype, rngs: nnx.Rngs, pp: int, parts: DecoderParts):
        super().__init__(cfg, tp, dtype, rngs, pp, parts)
        self.embed_positions = ReplicatedEmbedding(cfg.max_position_embeddings, cfg.hidden_size, tp_size=tp,
                                                   dtype=dtype, rngs=rngs)

    def embed(self, ids, positions) -> jax.Array:
        return super().embed(ids, positions) + self.embed_positions(positions)


class GPT2LMHeadModel(CausalLM):
    """The shared causal-LM shell with GPT-2's LayerNorms, MLP and position table."""
    parts = DecoderParts(norm=LayerNorm, dense=GPT2MLP)
    body = GPT2Model


# --- config: the HF fields GPT-2 reads -----------------------------------------------------------

# HF config field -> default when the config lacks it (REQUIRED: config.json must state it).
GPT2_FIELDS = {
    "vocab_size": REQUIRED, "n_embd": REQUIRED, "n_layer": REQUIRED, "n_head": REQUIRED,
    "n_positions": 1024, "n_inner": None,             # None: 4 * n_embd
    "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
    "scale_attn_weights": True, "bos_token_id": None, "eos_token_id": None,
}


def gpt2_config(hf, raw=None) -> DecoderConfig:
    """DecoderConfig from an HF GPT-2 config; other fields (scale_attn_by_inverse_layer_idx,
    reorder_and_upcast_attn, add_cross_attention) are refused unless they have their defaults."""
    arch = first_architecture(hf)
    f = read_fields(hf, GPT2_FIELDS, arch, raw)
    if f["activation_function"] not in GPT2_ACTIVATIONS:
        raise UnsupportedConfigError(f"config field activation_function={f['activation_function']!r} is not "
                                     f"supported for {arch}; supported: {sorted(GPT2_ACTIVATIONS)}")
    d, heads, hd = f["n_embd"], f["n_head"], head_dim_of(f, "n_embd", "n_head")
    return DecoderConfig(
        architecture=arch, vocab_size=f["vocab_size"], hidden_size=d, num_layers=f["n_layer"], num_heads=heads,
        num_kv_heads=heads, head_dim=hd, max_position_embeddings=int(f["n_positions"]),
        tie_word_embeddings=bool(f["tie_word_embeddings"]), bos_token_id=f["bos_token_id"],
        eos_token_ids=eos_ids(f["eos_token_id"]), intermediate_size=f["n_inner"] or 4 * d,
        norm_eps=float(f["layer_norm_epsilon"]), rope=None, qkv_bias=True, o_bias=True,
        attention_scale=None if f["scale_attn_weights"] else 1.0, hidden_act=f["activation_function"],
        mlp_bias=True)


# --- weights: HF tensor names -> params ---------------------------------------------------------

def gpt2_weights(cfg: DecoderConfig) -> WeightTable:
    """HF GPT-2 names (as transformers saves GPT2LMHeadModel) -> param parts of the shared layers."""
    hf, ours, d = "transformer.h.{i}", "model.layers.layers", cfg.hidden_size
    entries = [Entry("transformer.wte.weight", "model.embed_tokens.embedding", "weight"),
               Entry("transformer.wpe.weight", "model.embed_positions.embedding", "weight")]
    for norm_hf, norm in (("transformer.ln_f", "model.norm"), (f"{hf}.ln_1", f"{ours}.input_layernorm"),
                          (f"{hf}.ln_2", f"{ours}.post_attention_layernorm")):
        entries += [Entry(f"{norm_hf}.{p}", f"{norm}.{p}", p) for p in ("weight", "bias")]
    for part, offset in (("q", 0), ("k", d), ("v", 2 * d)):          # c_attn = q | k | v, Conv1D [in, out]
        entries += [Entry(f"{hf}.attn.c_attn.weight", f"{ours}.self_attn.qkv_proj.kernel", part, "in_out", offset),
                    Entry(f"{hf}.attn.c_attn.bias", f"{ours}.self_attn.qkv_proj.bias", part, offset=offset)]
    for conv, module in (("attn.c_proj", "self_attn.o_proj"), ("mlp.c_fc", "mlp.up_proj"),
                         ("mlp.c_proj", "mlp.down_proj")):
        entries += [Entry(f"{hf}.{conv}.weight", f"{ours}.{module}.kernel", "weight", "in_out"),
                    Entry(f"{hf}.{conv}.bias", f"{ours}.{module}.bias", "bias")]
    if not cfg.tie_word_embeddings:
        entries.append(Entry("lm_head.weight", "lm_head.embedding", "weight"))
    ignored = [f"{hf}.attn.bias", f"{hf}.attn.masked_bias"]       # causal-mask buffers of old checkpoints
    return WeightTable(entries, ignored + (["lm_head.weight"] if cfg.tie_word_embeddings else []))


register("GPT2LMHeadModel", GPT2LMHeadModel, config=gpt2_config, weights=gpt2_weights)
