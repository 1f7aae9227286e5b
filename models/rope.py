"""Rotary position embeddings (HF "rotate_half" layout) with default / linear / dynamic / llama3 scaling.

`dynamic` (NTK) equals `default` for positions below max_position_embeddings, the only
range the engine allows (max_model_len <= max_position_embeddings).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from tp_jax.models.config import RopeConfig


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
