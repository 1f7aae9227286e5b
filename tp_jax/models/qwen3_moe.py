"""Qwen3MoeForCausalLM: Qwen3's attention (per-head q/k RMSNorm, biases per `attention_bias`) and routed
experts, top-k weights renormalized with `norm_topk_prob`. Layers that HF makes dense
(`mlp_only_layers`, `decoder_sparse_step` > 1) run a dense MLP from a stack of their own (`ff_kinds`,
tp_jax/models/moe.py).
"""

from __future__ import annotations

import functools

from tp_jax.models.causal_lm import CausalLM
from tp_jax.models.llama import llama_config
from tp_jax.models.moe import moe_extend, moe_fields, moe_weights
from tp_jax.models.registry import register


class Qwen3MoeForCausalLM(CausalLM):
    """The shared causal-LM shell with `feed_forward="moe"` and q/k norms."""


qwen3_moe_config = functools.partial(llama_config, window="per_layer", qk_norm=True,
                                     extra_fields=moe_fields("num_local_experts", qwen=True, sparse_layers=True),
                                     extend=moe_extend("num_local_experts"))

register("Qwen3MoeForCausalLM", Qwen3MoeForCausalLM, config=qwen3_moe_config, weights=moe_weights)
