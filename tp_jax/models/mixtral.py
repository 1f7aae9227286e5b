"""MixtralForCausalLM: Mistral's attention and a routed-experts feed-forward (softmax, top-k renormalized).

Config map: Llama's fields (every layer slides when `sliding_window` is set, as Mistral) plus
`num_local_experts`, `num_experts_per_tok`; each expert is `intermediate_size` wide. Checkpoint
names: `block_sparse_moe.gate` (router) and `block_sparse_moe.experts.{e}.w1 / w3 / w2`
(gate / up / down), or transformers 5's fused `mlp.experts.gate_up_proj` / `down_proj`.
"""

from __future__ import annotations

import functools

from tp_jax.models.causal_lm import CausalLM
from tp_jax.models.llama import llama_config
from tp_jax.models.moe import moe_extend, moe_fields, moe_weights
from tp_jax.models.registry import register


class MixtralForCausalLM(CausalLM):
    """The shared causal-LM shell with `feed_forward="moe"`."""


mixtral_config = functools.partial(llama_config, window="all", extra_fields=moe_fields("num_local_experts"),
                                   extend=moe_extend("num_local_experts", renormalize=True))
mixtral_weights = functools.partial(moe_weights, prefix="block_sparse_moe", names=("w1", "w3", "w2"))

register("MixtralForCausalLM", MixtralForCausalLM, config=mixtral_config, weights=mixtral_weights)
