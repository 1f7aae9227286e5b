"""MistralForCausalLM: Llama's config map and name table with sliding-window attention on every layer.

A query at position p sees the keys at positions p - w < k <= p (w = `sliding_window`,
itself included), exactly transformers' `sliding_window_overlay`; its cache keeps the
last w - 1 keys plus the new one, so cached decode sees the same keys. The attention part
reads `cfg.sliding_window` (None for Mistral checkpoints without a window), so only the
config map (every layer slides) differs from Llama.
"""

from __future__ import annotations

import functools

from tp_jax.models.causal_lm import CausalLM
from tp_jax.models.llama import llama_config, llama_weights
from tp_jax.models.registry import register


class MistralForCausalLM(CausalLM):
    """The shared causal-LM shell; `config.sliding_window` bounds every layer's attention."""


register("MistralForCausalLM", MistralForCausalLM, config=functools.partial(llama_config, window="all"),
         weights=llama_weights)
