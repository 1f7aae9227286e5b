"""Qwen2ForCausalLM: Llama's graph with a bias on q, k and v but none on o_proj.

Qwen2's sliding window (use_sliding_window, only on layers >= max_window_layers) is
refused by `config_from_hf` unless no layer slides; released checkpoints have it off.
"""

from __future__ import annotations

from tp_jax.models.config import ModelConfig
from tp_jax.models.llama import LlamaAttention, LlamaForCausalLM, llama_model_with
from tp_jax.models.registry import register


class Qwen2Attention(LlamaAttention):
    def biases(self, cfg: ModelConfig) -> tuple[bool, bool]:
        return True, False                    # q/k/v bias always, o_proj never (HF Qwen2Attention)


@register("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama's params plus q/k/v biases; HF weight names are Llama's (loaders/names.py)."""
    model_cls = llama_model_with(Qwen2Attention)
