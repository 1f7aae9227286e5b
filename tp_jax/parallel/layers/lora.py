"""LoRA on the parallel linear layers (vLLM's vllm/lora/layers/), several adapters in one batch.

A target layer (Column, MergedColumn, QKV or Row) holds no LoRA param: it carries a static
`lora_key` (e.g. "self_attn.qkv_proj"), and while a step traces, `active(weights, slots, parts)`
gives every layer of the stack its adapters' slices and each token's adapter slot:

    weights[key] = (A[L, S, in, P * R], B[L, S, R, out])    L stacked layers, S adapter slots,
                                                             P the layer's fused parts (q, k, v)
    y += (x @ A_l[s]) @ B_l[s]       for the tokens of slot s; slot -1: nothing added

Each pair is split as its layer (vLLM's rule): a column layer's A is whole and its B split like
its output (part p's columns of B read part p's R columns of x @ A); a row layer's A is split like
its input and its B whole, so its contribution is a partial sum added before the layer's own
all-reduce: no collective of LoRA's own for any layer kind. The scale (alpha / r, or
alpha / sqrt(r) for rsLoRA) is folded into B when an adapter is loaded.

Each token's A and B are gathered from its slot and multiplied with its own row (one small dot
each): a row's numbers never depend on its neighbours, a token without an adapter adds exact zeros,
and a step where no token has one skips LoRA (a `lax.cond`). scripts/bench_lora.py measured this
against per-slot masked dots and `jax.lax.ragged_dot` (docs/performance.md, "LoRA").
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp
import numpy as np

_state = threading.local()


@contextlib.contextmanager
def active(weights: dict[str, tuple[jax.Array, jax.Array]], slots: jax.Array, parts: dict[str, tuple[int, ...]]):
    """While a forward traces: the LoRA weights (local blocks, under shard_map), slots[B, T] (-1: none) and each
    layer's local output columns per fused part (static)."""
    previous = getattr(_state, "step", None)
    _state.step = (weights, slots, parts)
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
    (a, b), parts = step[0][key], step[2][key]
    index, slots = at
    rows, flat = x.reshape(-1, x.shape[-1]), slots.reshape(-1)
    out = jax.lax.cond(jnp.any(flat >= 0), lambda: delta(rows, flat, index, a, b, parts),
                       lambda: jnp.zeros((rows.shape[0], y.shape[-1]), jnp.float32))
    return y + out.reshape(y.shape).astype(y.dtype)


def delta(rows: jax.Array, flat: jax.Array, index: jax.Array, a: jax.Array, b: jax.Array,
          parts: tuple[int, ...]) -> jax.Array:
    """Each token's (x @ A) @ B in float32, zero where its slot is < 0: rows[T, in], flat[T] slots, the
    layer's A[L, S, in, P * R] and B[L, S, R, out] (B's columns the parts': each reads its R columns of
    x @ A). Each token's A and B are gathered, so one dot per token: a row's numbers are its own."""
    hi = jax.lax.Precision.HIGHEST
    safe = jnp.clip(flat, 0, a.shape[1] - 1)
    u = jnp.einsum("ti,tir->tr", rows.astype(jnp.float32), a[index, safe].astype(jnp.float32), precision=hi)
    u = jnp.where((flat >= 0)[:, None], u, 0.0)
    bt = b[index, safe].astype(jnp.float32)                                # [T, R, out]
    r, cols = b.shape[2], np.cumsum((0,) + tuple(parts))
    outs = [jnp.einsum("tr,tro->to", u[:, p * r:(p + 1) * r], bt[:, :, cols[p]:cols[p + 1]], precision=hi)
            for p in range(len(parts))]
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-1)
