"""Qwen2MoeForCausalLM: Qwen2's attention (q/k/v bias per `qkv_bias`, none on o_proj) and routed experts
plus a shared expert gated by sigmoid(shared_expert_gate(x)); top-k weights renormalized only with
`norm_topk_prob`. Layers that HF makes dense (`mlp_only_layers`, `decoder_sparse_step` > 1) run a dense
MLP of `intermediate_size` from a stack of their own (`ff_kinds`, tp_jax/models/moe.py).
"""

from __future__ import annotations

from tp_jax.models.causal_lm import CausalLM
from tp_jax.models.llama import llama_config
from tp_jax.models.moe import moe_extend, moe_fields, moe_weights
from tp_jax.models.registry import register


class Qwen2MoeForCausalLM(CausalLM):
    """The shared causal-LM shell with `feed_forward="moe"` and a shared expert."""


def qwen2_moe_config(hf, raw=None):
    """Qwen2's attention fields, the MoE fields with a shared expert, `qkv_bias` (default True)."""
    qkv_bias = bool(getattr(hf, "qkv_bias", True))
    return llama_config(hf, raw, window="per_layer", qkv_bias=qkv_bias, o_bias=False,
                        extra_fields={**moe_fields("num_experts", qwen=True, shared=True, sparse_layers=True),
                                      "qkv_bias": True},
                        extend=moe_extend("num_experts", shared=True))


register("Qwen2MoeForCausalLM", Qwen2MoeForCausalLM, config=qwen2_moe_config, weights=moe_weights)
