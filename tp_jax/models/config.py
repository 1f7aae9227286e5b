"""Model configs: the fields every model shares, and reading a model's own fields from an HF config.

Each model file declares the HF config fields it reads as a map `{field: default}`
(`REQUIRED`: config.json must state it) and builds its frozen config (a `ModelConfig`
subclass) from them with `read_fields`. What `LLM` and the serving engine read is
`ModelConfig`: sizes, head counts, position limit and special tokens.

The rule for every other field follows what the field does, not a list of harmless names
(docs/adding_a_model.md, "The config map"). `read_fields` refuses, naming the field and the fix:
* a required field that is missing (or null);
* `quantization_config` of a method or scheme tp_jax does not read (bitsandbytes, AQLM, GPTQ's 3-bit, ...),
  named by its method, scheme and field (`quantization_refusal`, models/quant_config.py), before any
  weight is read; GPTQ, AWQ, FP8 and compressed-tensors are read by the loader (loaders/packed.py);
* a field that transformers' reference implementation of the architecture reads
  (`tp_jax/models/reference.py`, from its source), that the model map does not read, with a value
  other than the config class's default: it changes the math in a way tp_jax does not
  implement. Reads that matter only for training (`TRAINING_ONLY`: dropout, weight init,
  the padding index's gradient) are exempt;
* a field of `ACTIVE_ELSEWHERE` set to an active value: switches that change the math in a
  sibling architecture (M-RoPE, interleaved rotary, soft-capping, Granite's multipliers);
  the reference of *this* architecture ignores them, so a config stating them was written
  for a model that would run differently.
Everything else (special tokens, generation defaults, `torchscript`, `auto_map`,
`is_llama_config`, `n_ctx`, ...) is never read by the reference and is accepted.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

# Fields the reference reads only when training: dropout is off at inference, init is overwritten
# by the checkpoint, the padding index only zeroes its embedding row's gradient.
TRAINING_ONLY = frozenset({"initializer_range", "pad_token_id", "use_cache"})
TRAINING_ONLY_SUFFIXES = ("dropout", "pdrop")

# field -> (its inactive values, what it does where it is read). Refused when set to anything else.
ACTIVE_ELSEWHERE = {
    "use_mrope": ((None, False), "multimodal rotary positions (Qwen2-VL's M-RoPE)"),
    "rope_interleaved": ((None, False), "rotary embedding over interleaved pairs (GPT-J layout) instead of halves"),
    "partial_rotary_factor": ((None, 1, 1.0), "rotary embedding on only part of each head"),
    "attn_logit_softcapping": ((None, 0, 0.0), "tanh soft-capping of attention scores (Gemma 2)"),
    "final_logit_softcapping": ((None, 0, 0.0), "tanh soft-capping of the logits (Gemma 2)"),
    "query_pre_attn_scalar": ((None,), "another attention scale (Gemma 2)"),
    "embedding_multiplier": ((None, 1, 1.0), "a scaled token embedding (Granite)"),
    "residual_multiplier": ((None, 1, 1.0), "scaled residual branches (Granite)"),
    "attention_multiplier": ((None,), "another attention scale (Granite)"),
    "logits_scaling": ((None, 1, 1.0), "scaled logits (Granite)"),
    "clip_qkv": ((None,), "clipped q/k/v activations (OLMo)"),
}

class UnsupportedConfigError(ValueError):
    """A config field (or value) tp_jax does not implement, or a required one that is missing."""


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What every model's config holds (the engine and `LLM` read only these).

    Args:
      architecture: the HF `architectures[0]` name the model is registered under.
      vocab_size, hidden_size, num_layers: sizes.
      num_heads, num_kv_heads, head_dim: attention heads (KV cache layout and head plan).
      max_position_embeddings: the longest sequence the model supports.
      tie_word_embeddings: the LM head is the token embedding.
      bos_token_id, eos_token_ids: special tokens from the config.
    """
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{type(self).__name__}: {f}={v!r} must be a positive integer.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{type(self).__name__}: num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}.")


def read_fields(hf, fields: Mapping[str, Any], architecture: str, raw: Mapping | None = None) -> dict[str, Any]:
    """{field: value} for every field of `fields` ({HF name: default or REQUIRED}) from `hf`.

    `raw` is config.json's own dict when there is one: required fields must be stated
    there, not filled in by transformers' class defaults. Unknown fields are refused
    (see the module docstring).
    """
    out = {}
    for name, default in fields.items():
        value = getattr(hf, name, None)
        stated = raw is None or name in raw
        if default is REQUIRED and (value is None or not stated):
            where = "config.json" if raw is not None else "the config"
            raise UnsupportedConfigError(f"{where} lacks the field {name!r}, which {architecture} requires "
                                         f"(required: {sorted(k for k, d in fields.items() if d is REQUIRED)})")
        out[name] = default if value is None else value
    check_unknown_fields(hf, fields, architecture)
    return out


def check_unknown_fields(hf, fields: Mapping[str, Any], architecture: str) -> None:
    """Refuse the fields of `hf` outside `fields` that change the math (the rule in the module docstring)."""
    from tp_jax.models.reference import modeling_module, reference_reads
    quantization_refusal(getattr(hf, "quantization_config", None))
    read = reference_reads(hf, architecture)
    defaults = _class_defaults(type(hf))
    for name, value in hf.to_dict().items():
        if name in fields or name.startswith("_") or name == "quantization_config":
            continue
        if name in ACTIVE_ELSEWHERE and value not in ACTIVE_ELSEWHERE[name][0]:
            raise UnsupportedConfigError(
                f"config field {name}={value!r} asks for {ACTIVE_ELSEWHERE[name][1]}, which tp_jax's {architecture} "
                f"does not implement; this config was written for another model. Remove the field or set it "
                f"to {ACTIVE_ELSEWHERE[name][0][-1]!r} only if the checkpoint was trained without it")
        if read is not None and name not in read:
            continue                  # the reference never reads it: it cannot change the result
        if name in TRAINING_ONLY or name.endswith(TRAINING_ONLY_SUFFIXES):
            continue
        if name in defaults and defaults[name] == value:
            continue
        default = f"default {defaults[name]!r}" if name in defaults else "not a field of " + type(hf).__name__
        why = (f"transformers' {architecture} reads it ({modeling_module(hf).rsplit('.', 1)[-1]}.py and the rotary / "
               f"mask code it calls), so it changes the model" if read is not None
               else f"tp_jax reads only {sorted(fields)}")
        raise UnsupportedConfigError(
            f"config field {name}={value!r} is not supported by tp_jax's {architecture} ({default}); {why}, and "
            f"tp_jax does not implement it. Remove the field or set it to the default only if the checkpoint "
            f"was trained that way")


def quantization_refusal(qc) -> None:
    """UnsupportedConfigError for a `quantization_config` tp_jax does not read (models/quant_config.py),
    naming its method, scheme and deciding field; nothing for float weights or a format it reads."""
    from tp_jax.models.quant_config import QuantConfigError, checkpoint_quant
    try:
        checkpoint_quant(qc)
    except QuantConfigError as e:
        raise UnsupportedConfigError(str(e)) from None


def _class_defaults(cls) -> dict[str, Any]:
    try:
        return cls().to_dict()
    except Exception:       # noqa: BLE001  (a config class that cannot be built without arguments)
        return {}


def head_dim_of(f: Mapping[str, Any], hidden: str, heads: str) -> int:
    """f[hidden] // f[heads] (read fields), or UnsupportedConfigError when the heads do not divide the width."""
    d, n = f[hidden], f[heads]
    if d % n:
        raise UnsupportedConfigError(f"config fields {hidden}={d} and {heads}={n}: {hidden} must be a multiple "
                                     f"of {heads}")
    return d // n


def only_silu(act, arch: str) -> None:
    """UnsupportedConfigError unless `hidden_act` is SiLU (the gated MLPs of the Llama family and Phi-3)."""
    if act not in ("silu", "swish"):
        raise UnsupportedConfigError(f"config field hidden_act={act!r} is not supported for {arch}; only 'silu'")


def eos_ids(eos) -> tuple[int, ...]:
    """`eos_token_id` (an int, a list or None) as a tuple."""
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def config_from_hf(hf, raw: Mapping | None = None) -> ModelConfig:
    """The registered model's config from a `transformers.PretrainedConfig` (e.g. `AutoConfig.from_pretrained`).

    `raw`: config.json's dict, when the config came from one (checks required fields).
    """
    from tp_jax.models.registry import architecture_of
    return architecture_of(hf).config(hf, raw)


def load_config(model_dir: str) -> ModelConfig:
    """The model config from `model_dir/config.json`, with errors that name the file."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {model_dir!r}; a Hugging Face model directory needs "
                                f"config.json next to its *.safetensors files")
    from transformers import AutoConfig
    try:
        with open(path) as f:
            raw = json.load(f)
        if not isinstance(raw, dict):
            raise ValueError("the file does not hold a JSON object")
        hf = AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    return config_from_hf(hf, raw)
