"""Olmo2ForCausalLM: Llama's config map and name table with post-norm blocks and q/k norms over the whole width.

    h += post_attention_layernorm(attn(h))            no norm before attention or the MLP (norm_placement="post")
    h += post_feedforward_layernorm(mlp(h))
    q, k = q_norm(q_proj(x)), k_norm(k_proj(x))       RMSNorm over all num_heads * hd (num_kv_heads * hd) channels

Under tp the heads of q and k are split, so their norms' statistics span every rank: `QKNorm`
(tp_jax/parallel/layers/norm.py) adds the ranks' sums of squares in one all-reduce per layer (q and k
together), the one collective OLMo 2 adds to Llama's two per layer.
"""

from __future__ import annotations

import functools

from tp_jax.models.causal_lm import CausalLM
from tp_jax.models.decoder import DecoderConfig
from tp_jax.models.llama import llama_config, llama_weights
from tp_jax.models.registry import register


class Olmo2ForCausalLM(CausalLM):
    """The shared causal-LM shell; `config.norm_placement == "post"` and `config.qk_norm_full`."""


def _post_norm(f: dict, arch: str):
    return DecoderConfig, {"norm_placement": "post", "qk_norm_full": True}


register("Olmo2ForCausalLM", Olmo2ForCausalLM, config=functools.partial(llama_config, extend=_post_norm),
         weights=llama_weights)
