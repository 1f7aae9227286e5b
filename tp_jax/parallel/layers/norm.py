"""Normalization layers, replicated on every tp rank: RMSNorm (Llama), GemmaRMSNorm (scale 1 + w) and
LayerNorm with bias (GPT-2).

Both normalize over the last axis in float32 and hold their params whole on every rank
(declared with `split=None`), so they run on the full hidden state between the
row-parallel all-reduce and the next column-parallel layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tp_jax.parallel.layers.base import ParallelModule, check_tp_size
from tp_jax.parallel.layers.loading import PartRows, ShardedParam
from tp_jax.parallel.invariant import row_mean


class RMSNorm(ParallelModule):
    """y = x / sqrt(mean(x^2) + eps) * w over the last axis; w[D] on every rank.

    Args: `dim` D, `eps`, `tp_size`, `dtype`, `rngs`. Checkpoint part: "weight" `[D]`.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, tp_size: int = 1, dtype=jnp.float32, rngs: nnx.Rngs):
        check_tp_size(tp_size, type(self).__name__)
        self.dim, self.eps, self.tp_size = dim, eps, tp_size
        self.weight = nnx.Param(jnp.ones((dim,), dtype), out_sharding=self.loading()["weight"].spec())

    def loading(self):
        return {"weight": ShardedParam({"weight": PartRows((self.dim,))}, split=None)}

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(row_mean(x32 * x32, keepdims=True) + self.eps)   # batch-invariant sum
        return self.weight[...] * x32.astype(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """y = x / sqrt(mean(x^2) + eps) * (1 + w), all in float32, then cast (Gemma's norm: w stored as an offset
    from 1, and the scale applied before the cast, where Llama's RMSNorm casts first).

    Args and checkpoint part: as `RMSNorm`'s. An all-zero w (a pipeline identity slot) is the plain RMS norm.
    """

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(row_mean(x32 * x32, keepdims=True) + self.eps)
        return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class LayerNorm(ParallelModule):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * w + b over the last axis; w[D], b[D] on every rank.

    Args: `dim` D, `eps`, `bias` (False: no b), `tp_size`, `dtype`, `rngs`.
    Checkpoint parts: "weight" `[D]` and "bias" `[D]` (torch's `nn.LayerNorm`).
    """

    def __init__(self, dim: int, *, eps: float = 1e-5, bias: bool = True, tp_size: int = 1, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        check_tp_size(tp_size, type(self).__name__)
        self.dim, self.eps, self.tp_size, self.use_bias = dim, eps, tp_size, bias
        decl = self.loading()
        self.weight = nnx.Param(jnp.ones((dim,), dtype), out_sharding=decl["weight"].spec())
        self.bias = nnx.Param(jnp.zeros((dim,), dtype), out_sharding=decl["bias"].spec()) if bias else None

    def loading(self):
        decl = {"weight": ShardedParam({"weight": PartRows((self.dim,))}, split=None)}
        if self.use_bias:
            decl["bias"] = ShardedParam({"bias": PartRows((self.dim,))}, split=None)
        return decl

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = row_mean(x32, keepdims=True)                             # batch-invariant sums
        var = row_mean(jnp.square(x32 - mean), keepdims=True)
        y = ((x32 - mean) * jax.lax.rsqrt(var + self.eps)).astype(x.dtype) * self.weight[...]
        return y + self.bias[...] if self.bias is not None else y
