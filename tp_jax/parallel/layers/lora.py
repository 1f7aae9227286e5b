"""LoRA on the parallel linear layers (vLLM's vllm/lora/layers/), several adapters in one batch.

A target layer (Column, MergedColumn, QKV or Row) holds no LoRA param: it carries a static
`lora_key` (e.g. "self_attn.qkv_proj"), and while a step traces, `active(weights, slots)` gives
every layer of the stack its adapters' slices and each token's adapter slot:

    weights[key] = (A[L, S, in, P * R], B[L, S, P * R, out])    L stacked layers, S adapter slots,
                                                                 P the layer's fused parts (q, k, v)
    y += onehot(slot)-masked (x @ A_l[s]) @ B_l[s]              per token; slot -1: nothing added

Each pair is split as its layer (vLLM's rule): a column layer's A is whole and its B split like
its output (part p's B in the rows of A's block p: one block-diagonal B for the fused parts); a
row layer's A is split like its input and its B whole, so its contribution is a partial sum
added before the layer's own all-reduce: no collective of LoRA's own for any layer kind. The
scale (alpha / r, or alpha / sqrt(r) for rsLoRA) is folded into B when an adapter is loaded.

The shrink runs every slot's A and keeps each token's own (`x @ A` for S slots, masked), the
expand one dot over the S * P * R masked columns: exact for a token without an adapter (its
contribution is zero), and no gather of per-token weights (scripts/bench_lora.py).
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp

_state = threading.local()


@contextlib.contextmanager
def active(weights: dict[str, tuple[jax.Array, jax.Array]], slots: jax.Array):
    """While a forward traces: the LoRA weights (local blocks, under shard_map) and slots[B, T] (-1: none)."""
    previous = getattr(_state, "step", None)
    _state.step = (weights, slots)
    try:
        yield
    finally:
        _state.step = previous


def token_slots() -> jax.Array | None:
    """The step's slots[B, T] when LoRA is active (the layer loop carries them with their micro-batch)."""
    step = getattr(_state, "step", None)
    return None if step is None else step[1]


@contextlib.contextmanager
def layer(index: jax.Array, slots: jax.Array | None):
    """Inside the layer loop: the local stacked layer `index` and its micro-batch's slots."""
    previous = getattr(_state, "layer", None)
    _state.layer = None if slots is None else (index, slots)
    try:
        yield
    finally:
        _state.layer = previous


def add(module, x: jax.Array, y: jax.Array) -> jax.Array:
    """y plus `module`'s LoRA contribution for x (local shapes), or y when LoRA is off for it."""
    key = getattr(module, "lora_key", None)
    step, at = getattr(_state, "step", None), getattr(_state, "layer", None)
    if key is None or step is None or at is None or key not in step[0]:
        return y
    a, b = step[0][key]
    index, slots = at
    a = jax.lax.dynamic_index_in_dim(a, index, keepdims=False)        # [S, in, P * R]
    b = jax.lax.dynamic_index_in_dim(b, index, keepdims=False)        # [S, P * R, out]
    return y + delta(x, slots, a, b).astype(y.dtype)


def delta(x: jax.Array, slots: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """(x @ A[slot]) @ B[slot] per token in float32, zero where slot < 0; x[..., in], slots[...]."""
    s, _, r = a.shape
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    u = jnp.einsum("ti,sir->tsr", rows, a.astype(jnp.float32), precision=hi)
    mask = slots.reshape(-1)[:, None] == jnp.arange(s, dtype=slots.dtype)[None, :]
    u = jnp.where(mask[:, :, None], u, 0.0).reshape(rows.shape[0], s * r)
    out = jnp.dot(u, b.astype(jnp.float32).reshape(s * r, -1), precision=hi)
    return out.reshape(*x.shape[:-1], out.shape[-1])
