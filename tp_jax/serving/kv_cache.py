"""The KV cache: K and V for every layer, stacked on the layer axis, sharded like the model.

    k, v: [L, B, S, Hkv_pad, hd]   spec P("pp", "dp", None, "tp", None)

Hkv_pad = tp * kv_local from the head plan: rank i's KV slots are exactly the KV heads
its QKV block computes (replicated heads are cached on every rank that holds them,
padded slots stay zero). The batch is sharded on dp, the layers on pp.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tp_jax.parallel.heads import plan_heads
from tp_jax.parallel.mesh import DP, PP, TP
from tp_jax.parallel.pipeline import padded_layers

CACHE_SPEC = P(PP, DP, None, TP, None)


@dataclasses.dataclass(frozen=True)
class CacheShape:
    num_layers: int
    batch: int
    max_len: int
    kv_heads: int            # padded, global (tp * kv_local)
    head_dim: int
    dtype: np.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.batch, self.max_len, self.kv_heads, self.head_dim)

    def bytes_per_device(self, mesh: Mesh) -> int:
        """K and V bytes held by one device."""
        shards = mesh.shape[PP] * mesh.shape[DP] * mesh.shape[TP]
        return 2 * math.prod(self.shape) * np.dtype(self.dtype).itemsize // shards


def cache_shape(cfg, tp: int, batch: int, max_len: int, dtype, pp: int = 1) -> CacheShape:
    """Layers padded for pp exactly like the model's stacked params (tp_jax.parallel.pipeline)."""
    plan = plan_heads(cfg.num_heads, cfg.num_kv_heads, tp)
    return CacheShape(padded_layers(cfg.num_layers, pp), batch, max_len, plan.padded_kv_heads, cfg.head_dim,
                      np.dtype(dtype))


def new_cache(shape: CacheShape, mesh: Mesh) -> tuple[jax.Array, jax.Array]:
    """Zeroed (k, v), allocated directly on the devices in their shards."""
    sharding = NamedSharding(mesh, CACHE_SPEC)
    zeros = jax.jit(lambda: jnp.zeros(shape.shape, shape.dtype), out_shardings=sharding)
    return zeros(), zeros()
