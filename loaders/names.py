"""HF tensor name -> tp_jax param tables, one per architecture family.

An entry maps an HF name (with `{i}` for the layer index) to a param path and the
*part* of that param it fills: fused params take several HF tensors (q/k/v -> qkv_proj,
gate/up -> gate_up_proj), like vLLM's `stacked_params_mapping`.
"""

from __future__ import annotations

import dataclasses

L = "model.layers.layers"          # the Stack's stacked layer module


@dataclasses.dataclass(frozen=True)
class Entry:
    hf: str           # e.g. "model.layers.{i}.self_attn.q_proj.weight"
    param: str        # e.g. "model.layers.layers.self_attn.qkv_proj.kernel"
    part: str         # e.g. "q"


def _linear(hf_prefix: str, module: str, part: str | None = None) -> list[Entry]:
    """Kernel and bias entries; unfused layers (part None) name their parts "weight" / "bias"."""
    return [Entry(f"{hf_prefix}.weight", f"{module}.kernel", part or "weight"),
            Entry(f"{hf_prefix}.bias", f"{module}.bias", part or "bias")]


LLAMA: list[Entry] = [
    Entry("model.embed_tokens.weight", "model.embed_tokens.embedding", "weight"),
    Entry("model.norm.weight", "model.norm.weight", "weight"),
    Entry("lm_head.weight", "lm_head.embedding", "weight"),
    Entry("model.layers.{i}.input_layernorm.weight", f"{L}.input_layernorm.weight", "weight"),
    Entry("model.layers.{i}.post_attention_layernorm.weight", f"{L}.post_attention_layernorm.weight", "weight"),
    *_linear("model.layers.{i}.self_attn.q_proj", f"{L}.self_attn.qkv_proj", "q"),
    *_linear("model.layers.{i}.self_attn.k_proj", f"{L}.self_attn.qkv_proj", "k"),
    *_linear("model.layers.{i}.self_attn.v_proj", f"{L}.self_attn.qkv_proj", "v"),
    *_linear("model.layers.{i}.self_attn.o_proj", f"{L}.self_attn.o_proj"),
    *_linear("model.layers.{i}.mlp.gate_proj", f"{L}.mlp.gate_up_proj", "0"),
    *_linear("model.layers.{i}.mlp.up_proj", f"{L}.mlp.gate_up_proj", "1"),
    *_linear("model.layers.{i}.mlp.down_proj", f"{L}.mlp.down_proj"),
]

# Qwen3: Llama's names plus the per-head q/k norms (Qwen2's q/k/v biases are already in LLAMA's
# `_linear` entries; an entry whose param the model lacks is never asked for).
QWEN3: list[Entry] = [
    *LLAMA,
    Entry("model.layers.{i}.self_attn.q_norm.weight", f"{L}.self_attn.q_norm.weight", "weight"),
    Entry("model.layers.{i}.self_attn.k_norm.weight", f"{L}.self_attn.k_norm.weight", "weight"),
]

TABLES: dict[str, list[Entry]] = {"LlamaForCausalLM": LLAMA, "MistralForCausalLM": LLAMA,
                                  "Qwen2ForCausalLM": LLAMA, "Qwen3ForCausalLM": QWEN3}

# HF tensors that carry no weights we need (buffers saved by old checkpoints).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def table_for(architecture: str) -> list[Entry]:
    if architecture not in TABLES:
        raise ValueError(f"no weight-name table for architecture {architecture!r}; known: {sorted(TABLES)}")
    return TABLES[architecture]
