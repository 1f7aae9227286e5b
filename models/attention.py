"""Causal grouped-query attention on one rank's local heads, with an optional KV cache.

Shapes: q[B, T, Hq, hd], k/v[B, S, Hkv, hd], Hq = Hkv * G (the head plan keeps G
uniform per rank). A query at position p sees keys at positions <= p (and, with a
sliding window w, > p - w). Cache slots past a sequence's length hold stale values;
they are never read, because writes happen before reads and the mask stops at p.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_cache(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """cache[B, S, H, hd] with new[B, T, H, hd] written at positions[B, T] (out of range: dropped)."""
    b = jnp.arange(cache.shape[0])[:, None]
    return cache.at[b, positions].set(new.astype(cache.dtype), mode="drop")


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
              scale: float, window: int | None = None) -> jax.Array:
    """softmax(q k^T * scale + mask) v -> [B, T, Hq * hd]; q_pos[B, T], k_pos[S] or [B, S]."""
    b, t, hq, hd = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    k_pos = k_pos if k_pos.ndim == 2 else k_pos[None]
    allowed = k_pos[:, None, :] <= q_pos[:, :, None]                             # [B, T, S]
    if window is not None:
        allowed &= k_pos[:, None, :] > q_pos[:, :, None] - window
    scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, hq * hd)
