"""RMSNorm with a replicated weight (HF LlamaRMSNorm numerics: normalize in float32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tp_jax.parallel.layers.base import ParallelModule, check_tp_size
from tp_jax.parallel.layers.loading import PartRows, ShardedParam, replicated_rows


class RMSNorm(ParallelModule):
    """y = x / sqrt(mean(x^2) + eps) * w over the last axis; w[D] on every rank. HF part: "weight"."""

    def __init__(self, dim: int, *, eps: float = 1e-6, tp_size: int = 1, dtype=jnp.float32, rngs: nnx.Rngs):
        check_tp_size(tp_size, type(self).__name__)
        self.dim, self.eps, self.tp_size = dim, eps, tp_size
        self.weight = nnx.Param(jnp.ones((dim,), dtype), out_sharding=(None,))

    def loading(self):
        return {"weight": ShardedParam({"weight": PartRows((self.dim,), replicated_rows(self.dim, self.tp_size))})}

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)
