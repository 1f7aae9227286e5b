"""Batch-invariant building blocks: a row's result never depends on how many other rows share the call.

XLA:CPU picks kernels by shape. A float32 reduction along a row (a norm's mean of squares) is vectorized
one way for a few rows and another for many, and a float32 dot goes to one library for 2-32 rows and to
another above: the same row then sums in another order and its last bits change, which bf16 / int8
rounding downstream turns into different tokens. What keeps a row's numbers its own here:

    row_sum(x)          sum over the last axis in an order fixed by its length alone (a halving tree of
                        element-wise adds, which compute each element alike whatever the shape)
    row_mean(x)         row_sum / length
    row_softmax(x)      softmax / log-softmax over the last axis, the exponentials summed by row_sum
    row_log_softmax(x)  (inside the engine's step, jax.nn's sum moved a logprob's last bit with the rows)
    row_tiled(dot, x)   dot(x[M, K]) -> [M, F] with every float32 dot over exactly ROW_TILE rows (M = 1
                        padded to 2): XLA:CPU's kernel for 2-32 rows sums each row alike whatever the rows
                        (more inputs of M rows may follow x, tiled alike: the MoE block's routing)

    consistent_jit(f)   jax.jit(f) compiled with three XLA:CPU options (CONSISTENT_MATH):
                        platform-dependent math off: no approximate reciprocals or square roots in vector
                        bodies beside exact ones in loop tails (which rows land in a tail depends on how many
                        there are), and YNNPACK dots in their "consistent arithmetic" mode;
                        the MLIR fusion emitters off (the classic loop emitter instead): with them, a decode
                        row's float32 numbers on the embedded SmolLM2 moved by ~3e-6 in a logprob when a
                        prefill shared its step, and by 3e-2 once the default's bf16 rounding carried them;
                        YNNPACK given each dot alone, not whole graphs of a dot's neighbours: its fused
                        exp(x - max(x)) gave a row other bits beside 2 or more rows at widths 32 to 1024
                        (tests/test_invariant.py). With all three not a bit moves in the engine's tests
                        (tests/test_batch_invariance.py), at no measured cost in decode speed

bf16 x bf16 -> float32 and int8 x int8 -> int32 dots of 2 rows and more, and batched dots of a fixed
per-batch shape, are already invariant there (tests/test_batch_invariance.py checks each of these).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

ROW_TILE = 32
CONSISTENT_MATH = {"xla_cpu_enable_platform_dependent_math": False, "xla_cpu_use_fusion_emitters": False,
                   "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


def consistent_jit(fn: Callable | None = None, **kwargs):
    """`jax.jit(fn, **kwargs)` with `CONSISTENT_MATH` (an XLA:CPU option; other backends ignore it)."""
    if fn is None:
        return lambda f: consistent_jit(f, **kwargs)
    return jax.jit(fn, compiler_options=CONSISTENT_MATH, **kwargs)


def row_sum(x: jax.Array, keepdims: bool = False) -> jax.Array:
    """x summed over its last axis: zero-padded to a power of two, then halved by element-wise adds."""
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x if keepdims else x[..., 0]


def row_mean(x: jax.Array, keepdims: bool = False) -> jax.Array:
    return row_sum(x, keepdims) / x.shape[-1]


def row_softmax(x: jax.Array) -> jax.Array:
    """`jax.nn.softmax(x, axis=-1)`, its sum taken by `row_sum` (-inf entries: 0; a row's maximum is exact)."""
    e = jnp.exp(x - jax.lax.stop_gradient(x.max(-1, keepdims=True)))
    return e / row_sum(e, keepdims=True)


def row_log_softmax(x: jax.Array) -> jax.Array:
    """`jax.nn.log_softmax(x, axis=-1)`, its sum taken by `row_sum`."""
    shifted = x - jax.lax.stop_gradient(x.max(-1, keepdims=True))
    return shifted - jnp.log(row_sum(jnp.exp(shifted), keepdims=True))


def row_tiled(dot: Callable[..., jax.Array], x: jax.Array, *more: jax.Array) -> jax.Array:
    """dot(x, *more) for x[M, K] (and `more`: other inputs of M rows, tiled alike) -> [M, ...], every call of `dot` on
    a fixed number of rows: M = 1 padded to 2, up to ROW_TILE rows at once, more in tiles of ROW_TILE (`lax.map`),
    the last one zero-padded. Off CPU: dot(x, *more)."""
    m = x.shape[0]
    if jax.default_backend() != "cpu" or 1 < m <= ROW_TILE:
        return dot(x, *more)
    rows = 2 if m == 1 else -(-m // ROW_TILE) * ROW_TILE
    padded = [jnp.pad(a, ((0, rows - m),) + ((0, 0),) * (a.ndim - 1)) for a in (x, *more)]
    if m == 1:
        return dot(*padded)[:1]
    n = rows // ROW_TILE
    y = jax.lax.map(lambda t: dot(*t), tuple(a.reshape(n, ROW_TILE, *a.shape[1:]) for a in padded))
    return y.reshape(rows, *y.shape[2:])[:m]
