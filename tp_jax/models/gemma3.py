"""Gemma3ForCausalLM (the text model): Gemma 2's layer with per-head q/k norms ((1 + w) RMSNorm over head_dim)
and two rotary embeddings: the sliding layers rotate with the local base (`rope_parameters["sliding_attention"]`,
10000), the global ones with theta 1e6 and its scaling (`rope_parameters["full_attention"]`); `layer_types` (or
the older `sliding_window_pattern`, 6: five sliding layers, then a global one) says which layer is which.
No soft-capping in released checkpoints (read if set).
"""

from __future__ import annotations

import functools

from tp_jax.models.causal_lm import CausalLM
from tp_jax.models.gemma2 import gemma_config
from tp_jax.models.llama import llama_weights
from tp_jax.models.registry import register


class Gemma3ForCausalLM(CausalLM):
    """The shared causal-LM shell; Gemma 2's params plus self_attn.q_norm / k_norm [head_dim] per layer."""


register("Gemma3ForCausalLM", Gemma3ForCausalLM,
         config=functools.partial(gemma_config, qk_norm=True, local_rope=True), weights=llama_weights)
