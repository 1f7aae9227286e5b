"""Qwen2ForCausalLM: Llama's graph with a bias on q, k and v but none on o_proj.

Qwen2's sliding window (use_sliding_window, only on layers >= max_window_layers) is
refused by the config map unless no layer slides; released checkpoints have it off.
"""

from __future__ import annotations

import functools

from tp_jax.models.config import ModelConfig
from tp_jax.models.llama import LlamaAttention, LlamaForCausalLM, llama_config, llama_model_with, llama_weights
from tp_jax.models.registry import register

QKV_BIAS, O_BIAS = True, False            # HF Qwen2Attention: q/k/v bias always, o_proj never


class Qwen2Attention(LlamaAttention):
    def biases(self, cfg: ModelConfig) -> tuple[bool, bool]:
        return QKV_BIAS, O_BIAS


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama's params plus q/k/v biases; HF weight names are Llama's."""
    model_cls = llama_model_with(Qwen2Attention)


register("Qwen2ForCausalLM", Qwen2ForCausalLM, config=functools.partial(llama_config, window="per_layer"),
         weights=functools.partial(llama_weights, qkv_bias=QKV_BIAS, o_bias=O_BIAS))
