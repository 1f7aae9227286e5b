"""Qwen2ForCausalLM: Llama's config map and name table with a bias on q, k and v but none on o_proj.

Qwen2's sliding window (use_sliding_window, only on layers >= max_window_layers, or as `layer_types` says) is a
per-layer window (tp_jax/models/decoder.py); released checkpoints have it off.
"""

from __future__ import annotations

import functools

from tp_jax.models.causal_lm import CausalLM
from tp_jax.models.llama import llama_config, llama_weights
from tp_jax.models.registry import register


class Qwen2ForCausalLM(CausalLM):
    """The shared causal-LM shell; HF weight names are Llama's."""


# HF Qwen2Attention: q/k/v bias always, o_proj never
register("Qwen2ForCausalLM", Qwen2ForCausalLM,
         config=functools.partial(llama_config, window="per_layer", qkv_bias=True, o_bias=False),
         weights=llama_weights)
