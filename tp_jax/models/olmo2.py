"""Olmo2ForCausalLM: Llama's config map and name table with OLMo 2's own modules: post-norm layers and q/k norms over
the whole width.

    h += post_attention_layernorm(attn(h))            no norm before attention or the MLP (`Olmo2DecoderLayer`)
    h += post_feedforward_layernorm(mlp(h))
    q, k = q_norm(q_proj(x)), k_norm(k_proj(x))       RMSNorm over all num_heads * hd (num_kv_heads * hd) channels
                                                      (`Olmo2Attention`; OLMoE's too)

Under tp the heads of q and k are split, so their norms' statistics span every rank: `QKNorm`
(tp_jax/parallel/layers/norm.py) adds the ranks' sums of squares in one all-reduce per layer (q and k
together), the one collective OLMo 2 adds to Llama's two per layer.
"""

from __future__ import annotations

import dataclasses

from tp_jax.models.causal_lm import CausalLM
from tp_jax.models.decoder import Attention, DecoderLayer, DecoderParts
from tp_jax.models.llama import llama_config, llama_weights
from tp_jax.models.registry import register
from tp_jax.parallel.layers import Entry, WeightTable
from tp_jax.parallel.layers.norm import QKNorm


class Olmo2Attention(Attention):
    """Llama's attention with one RMSNorm over all of q's heads and one over all of k's (`QKNorm`)."""

    def __init__(self, cfg, tp: int, dtype, rngs, parts: DecoderParts):
        super().__init__(cfg, tp, dtype, rngs, parts)
        self.qk_norm = QKNorm(self.qkv_proj.plan, cfg.head_dim, eps=cfg.norm_eps, dtype=dtype, rngs=rngs)

    def norm_qk(self, q, k):
        return self.qk_norm(q, k)


class Olmo2DecoderLayer(DecoderLayer):
    """Post-norm: each sub-block's output normalized before it joins the residual."""
    norms = ("post_attention_layernorm", "post_feedforward_layernorm")

    def __call__(self, h, positions, cache, layer=None, mlp=None):
        mlp = self.mlp if mlp is None else mlp
        a, cache = self.self_attn(h, positions, cache, layer)
        h = h + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(mlp(h)), cache


class Olmo2ForCausalLM(CausalLM):
    """The shared causal-LM shell with OLMo 2's layer and attention."""
    parts = DecoderParts(attention=Olmo2Attention, layer=Olmo2DecoderLayer)


def with_qk_norm(table: WeightTable) -> WeightTable:
    """`table` (and its variants) plus the whole-width q_norm / k_norm of `Olmo2Attention`."""
    hf, ours = "model.layers.{i}.self_attn", "model.layers.layers.self_attn"
    entries = [Entry(f"{hf}.{n}_norm.weight", f"{ours}.qk_norm.{n}_weight", f"{n}_norm") for n in "qk"]
    return dataclasses.replace(table, entries=table.entries + tuple(entries),
                               variants=tuple(with_qk_norm(v) for v in table.variants))


def olmo2_weights(cfg) -> WeightTable:
    return with_qk_norm(llama_weights(cfg, norms=Olmo2DecoderLayer.norms))


register("Olmo2ForCausalLM", Olmo2ForCausalLM, config=llama_config, weights=olmo2_weights)
