"""The model config: a frozen dataclass built from a Hugging Face config by one function.

`config_from_hf` reads what the supported architectures use and refuses what they do
not support (an unknown rope scaling type, a sliding window where the architecture has
none or only on some layers, another activation), naming the field; nothing is silently
ignored. The few fields whose meaning depends on the architecture (q/k norm, sliding
window) are read through the per-architecture tables below.
"""

from __future__ import annotations

import dataclasses
import os

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")

# Architectures with a per-head RMSNorm on q and k before RoPE (weights q_norm / k_norm [head_dim]).
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM",)
# How an architecture reads `sliding_window`: "all" -> every layer slides (Mistral); "per_layer" -> only
# the layers HF marks "sliding_attention" (Qwen2/3: use_sliding_window, layers >= max_window_layers), which
# tp_jax refuses unless no layer slides. Any other architecture must leave sliding_window unset.
SLIDING_WINDOW_MODES = {"MistralForCausalLM": "all", "Qwen2ForCausalLM": "per_layer",
                        "Qwen3ForCausalLM": "per_layer"}


class UnsupportedConfigError(ValueError):
    """A config field (or value) tp_jax does not implement."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelConfig: {f}={v!r} must be a positive integer.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig: num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}.")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"ModelConfig: sliding_window={self.sliding_window!r} must be a positive integer "
                             f"(the number of most recent keys a query sees, itself included) or None.")
        if self.rope.type not in ROPE_TYPES:
            raise UnsupportedConfigError(f"rope_scaling type {self.rope.type!r} is not supported; "
                                         f"supported: {ROPE_TYPES}")


def rope_from_hf(hf) -> RopeConfig:
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UnsupportedConfigError(f"config field rope_scaling/rope_parameters: rope_type {kind!r} is not "
                                     f"supported; supported: {', '.join(ROPE_TYPES)}")
    known = {"rope_theta", "rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings"}
    extra = sorted(k for k, v in params.items() if k not in known and v not in (None, 1.0))
    if extra:
        raise UnsupportedConfigError(f"config field rope_parameters has unsupported keys {extra} "
                                     f"(rope_type {kind!r})")
    return RopeConfig(theta=float(theta), type=kind, factor=float(params.get("factor", 1.0)),
                      low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                      high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                      original_max_position_embeddings=int(params.get(
                          "original_max_position_embeddings", getattr(hf, "max_position_embeddings", 8192))))


def _eos_ids(hf) -> tuple[int, ...]:
    eos = getattr(hf, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def _check_supported(hf, arch: str) -> None:
    act = getattr(hf, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedConfigError(f"config field hidden_act={act!r} is not supported for {arch}; only 'silu'")
    if getattr(hf, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise UnsupportedConfigError(f"config field partial_rotary_factor={hf.partial_rotary_factor} "
                                     f"is not supported")


def _sliding_window(hf, arch: str) -> int | None:
    """The window every layer uses (None: full attention), or UnsupportedConfigError naming the field."""
    window = getattr(hf, "sliding_window", None)
    mode = SLIDING_WINDOW_MODES.get(arch)
    if window is None or mode == "all":
        return None if window is None else int(window)
    if mode == "per_layer":
        if not getattr(hf, "use_sliding_window", False):
            return None
        first = int(getattr(hf, "max_window_layers", 0) or 0)
        types = list(getattr(hf, "layer_types", None) or
                     ["sliding_attention" if i >= first else "full_attention" for i in range(hf.num_hidden_layers)])
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
        if not sliding:
            return None
        raise UnsupportedConfigError(
            f"config field use_sliding_window=true (sliding_window={window}, max_window_layers={first}) gives "
            f"{arch} layers {sliding[0]}..{sliding[-1]} a sliding window and the others full attention; tp_jax "
            f"does not support per-layer windows. Set use_sliding_window to false for full attention")
    raise UnsupportedConfigError(f"config field sliding_window={window} (an active sliding window) is not "
                                 f"supported for {arch}; set it to null for full attention")


def config_from_hf(hf) -> ModelConfig:
    """ModelConfig from a `transformers.PretrainedConfig` (e.g. `AutoConfig.from_pretrained(dir)`)."""
    from tp_jax.models.registry import check_architecture
    arch = check_architecture(hf)
    _check_supported(hf, arch)
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    return ModelConfig(
        architecture=arch, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads, head_dim=head_dim,
        rms_norm_eps=float(hf.rms_norm_eps), rope=rope_from_hf(hf),
        max_position_embeddings=int(getattr(hf, "max_position_embeddings", 2048)),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(hf, "attention_bias", False)), mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=arch in QK_NORM_ARCHITECTURES, sliding_window=_sliding_window(hf, arch),
        bos_token_id=getattr(hf, "bos_token_id", None), eos_token_ids=_eos_ids(hf))


def load_config(model_dir: str) -> ModelConfig:
    """ModelConfig from `model_dir/config.json`, with errors that name the file."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {model_dir!r}; a Hugging Face model directory needs "
                                f"config.json next to its *.safetensors files")
    from transformers import AutoConfig
    try:
        hf = AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    return config_from_hf(hf)
