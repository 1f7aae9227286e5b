"""OlmoeForCausalLM: Llama's pre-norm layer with OLMo 2's q/k norms over the whole width and routed experts.

    q, k = q_norm(q_proj(x)), k_norm(k_proj(x))      over all heads' channels (`QKNorm`, one tp all-reduce)
    mlp(x) = sum_k p_k expert_k(x)                   p = softmax(router(x)) over the experts, its top k
                                                     (renormalized only with `norm_topk_prob`, off in OLMoE)

Experts are `intermediate_size` wide; no shared expert. The MoE block, expert parallelism and the
name tables are the MoE models' (tp_jax/models/moe.py). `clip_qkv` is refused unless null (its release).
"""

from __future__ import annotations

import functools

from tp_jax.models.causal_lm import CausalLM
from tp_jax.models.decoder import DecoderParts
from tp_jax.models.llama import llama_config
from tp_jax.models.moe import moe_extend, moe_fields, moe_weights
from tp_jax.models.olmo2 import Olmo2Attention, with_qk_norm
from tp_jax.models.registry import register
from tp_jax.parallel.layers import WeightTable


class OlmoeForCausalLM(CausalLM):
    """The shared causal-LM shell with `feed_forward="moe"` and OLMo 2's whole-width q/k norms."""
    parts = DecoderParts(attention=Olmo2Attention)


# the published OLMoE-1B-7B config.json leaves rms_norm_eps to the class default
olmoe_config = functools.partial(llama_config, extra_fields={**moe_fields("num_experts"), "norm_topk_prob": False,
                                                             "rms_norm_eps": 1e-5}, extend=moe_extend("num_experts"))



def olmoe_weights(cfg) -> WeightTable:
    return with_qk_norm(moe_weights(cfg))


register("OlmoeForCausalLM", OlmoeForCausalLM, config=olmoe_config, weights=olmoe_weights)
