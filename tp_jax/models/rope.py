"""Rotary position embeddings (HF "rotate_half" layout) with default / linear / dynamic / llama3 scaling.

`rope_from_hf` reads the rope fields of an HF config (`rope_parameters`, or the older
`rope_scaling` / `rope_theta`) and refuses scaling types and keys it does not implement.
`dynamic` (NTK) equals `default` for positions below max_position_embeddings, the only
range the engine allows (max_model_len <= max_position_embeddings).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from tp_jax.models.config import UnsupportedConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
ROPE_FIELDS = ("rope_parameters", "rope_scaling", "rope_theta")      # the HF config fields rope_from_hf reads


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (transformers' names): theta and the scaling type with its factors."""
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.type not in ROPE_TYPES:
            raise UnsupportedConfigError(f"rope_scaling type {self.type!r} is not supported; supported: {ROPE_TYPES}")


def rope_from_hf(hf, params=None) -> RopeConfig:
    """The rotary embedding of an HF config; `params`: one entry of a per-layer-type `rope_parameters`
    (Gemma 3: {"sliding_attention": {...}, "full_attention": {...}}) instead of the config's own."""
    if params is None:
        params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None)
    params = dict(params or {})
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


def inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """[head_dim/2] float32 inverse frequencies, as transformers computes them."""
    freq = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    freq = freq.astype(np.float32)
    if rope.type == "linear":
        return (freq / rope.factor).astype(np.float32)
    if rope.type == "llama3":
        return _llama3(freq, rope)
    return freq


def _llama3(freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    old = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = np.where(wavelen > low_wavelen, freq / rope.factor, freq)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, freq: np.ndarray) -> jax.Array:
    """x[B, T, H, hd] rotated by positions[B, T]."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(freq)     # [B, T, hd/2]
    emb = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]          # [B, T, 1, hd]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated * sin).astype(x.dtype)
