"""Model configs: the fields every model shares, and reading a model's own fields from an HF config.

Each model file declares the HF config fields it reads as a map `{field: default}`
(`REQUIRED`: config.json must state it) and builds its frozen config (a `ModelConfig`
subclass) from them with `read_fields`. What `LLM` and the serving engine read is
`ModelConfig`: sizes, head counts, position limit and special tokens.

`read_fields` refuses, naming the field:
* a required field that is missing (or null);
* an *unknown* field: one the model does not read, that is not in `NO_EFFECT` (fields
  with no effect on inference), whose value differs from the HF config class's default.
  Such a field changes the architecture in a way the model does not implement, so it
  must not be silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

# Fields of any HF config that do not change inference (training, bookkeeping, output switches).
NO_EFFECT = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path",
    "output_hidden_states", "output_attentions", "return_dict", "use_cache", "initializer_range",
    "chunk_size_feed_forward", "id2label", "label2id", "problem_type", "pad_token_id", "tokenizer_class",
    "pretraining_tp", "attention_dropout", "hidden_dropout", "embd_pdrop", "attn_pdrop", "resid_pdrop",
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
    "is_encoder_decoder", "prefix", "task_specific_params", "finetuning_task", "_attn_implementation_autoset",
    "_commit_hash", "tie_encoder_decoder", "cross_attention_hidden_size", "unsloth_version", "quantization_config",
})


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
    defaults = _class_defaults(type(hf))
    for name, value in hf.to_dict().items():
        if name in fields or name in NO_EFFECT or name.startswith("_"):
            continue
        if name in defaults and defaults[name] == value:
            continue
        default = f"default {defaults[name]!r}" if name in defaults else "not a field of " + type(hf).__name__
        raise UnsupportedConfigError(
            f"config field {name}={value!r} is not supported by tp_jax's {architecture} ({default}); "
            f"it reads only {sorted(fields)}. Remove the field or set it to the default")


def _class_defaults(cls) -> dict[str, Any]:
    try:
        return cls().to_dict()
    except Exception:       # noqa: BLE001  (a config class that cannot be built without arguments)
        return {}


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
