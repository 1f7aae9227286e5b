"""Normalization layers: RMSNorm (Llama), GemmaRMSNorm (scale 1 + w) and LayerNorm with bias (GPT-2), replicated
on every tp rank; and QKNorm (OLMo 2), an RMSNorm of q and of k over the whole projection width, whose heads
are split over tp like QKVParallelLinear's.

Both normalize over the last axis in float32 and hold their params whole on every rank
(declared with `split=None`), so they run on the full hidden state between the
row-parallel all-reduce and the next column-parallel layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tp_jax.parallel import collectives
from tp_jax.parallel.heads import HeadPlan
from tp_jax.parallel.layers.base import ParallelModule, check_tp_size
from tp_jax.parallel.layers.loading import PartRows, ShardedParam, expand_heads
from tp_jax.parallel.invariant import row_mean, row_sum
from tp_jax.parallel.mesh import TP


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


class QKNorm(ParallelModule):
    """(q, k) -> (RMSNorm(q) * w_q, RMSNorm(k) * w_k), each over all heads' channels of the projection (OLMo 2: q_norm
    over num_heads * hd, k_norm over num_kv_heads * hd), on the heads a rank holds (the head plan's slots).

    The statistic spans every rank's heads: each rank sums the squares of its slots (padded slots hold zeros; a KV
    head replicated over several ranks counts on its first rank only), one all-reduce over tp adds the q and k
    sums together, and the mean divides by the real width. Weights are laid out like the QKV bias: w_q[tp * q_local
    * hd] and w_k[tp * kv_local * hd], split over tp.

    Args: `plan` (the QKV layer's head plan), `head_dim`, `eps`, `dtype`, `rngs`.
    Checkpoint parts: "q_norm" `[num_heads * hd]`, "k_norm" `[num_kv_heads * hd]`.
    """

    def __init__(self, plan: HeadPlan, head_dim: int, *, eps: float = 1e-6, dtype=jnp.float32, rngs: nnx.Rngs):
        self.plan, self.head_dim, self.eps = plan, head_dim, eps
        self.tp_size = plan.tp
        decl = self.loading()
        self.q_weight = nnx.Param(jnp.ones((plan.tp * plan.q_local * head_dim,), dtype),
                                  out_sharding=decl["q_weight"].spec())
        self.k_weight = nnx.Param(jnp.ones((plan.tp * plan.kv_local * head_dim,), dtype),
                                  out_sharding=decl["k_weight"].spec())
        kv = plan.kv_heads                                           # [tp, kv_local]; count a head's first copy
        first = [[h >= 0 and h not in kv[:r].ravel() for h in row] for r, row in enumerate(kv)]
        self.kv_counted = tuple(tuple(bool(c) for c in row) for row in first)

    def loading(self):
        hd, p = self.head_dim, self.plan
        return {"q_weight": ShardedParam({"q_norm": PartRows((p.num_heads * hd,), expand_heads(p.q_heads, hd))},
                                         split=0),
                "k_weight": ShardedParam({"k_norm": PartRows((p.num_kv_heads * hd,), expand_heads(p.kv_heads, hd))},
                                         split=0)}

    def __call__(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """q[..., q_local, hd], k[..., kv_local, hd] (this rank's slots) -> the same, normalized."""
        q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
        rank = collectives.axis_index(TP) if self.tp_size > 1 else 0
        counted = jnp.asarray(np.asarray(self.kv_counted, np.float32))[rank]
        sq = row_sum(row_sum(q32 * q32))                              # [...] over hd, then the slots
        sk = row_sum(row_sum(k32 * k32) * counted)
        both = jnp.stack([sq, sk], axis=-1)
        if self.tp_size > 1:
            both = collectives.all_reduce(both, TP)                 # one all-reduce for q and k
        hd, p = self.head_dim, self.plan
        inv = jax.lax.rsqrt(both / jnp.asarray([p.num_heads * hd, p.num_kv_heads * hd], jnp.float32) + self.eps)
        wq = self.q_weight[...].reshape(p.q_local, hd)
        wk = self.k_weight[...].reshape(p.kv_local, hd)
        q_out = wq * (q32 * inv[..., 0, None, None]).astype(q.dtype)
        k_out = wk * (k32 * inv[..., 1, None, None]).astype(k.dtype)
        return q_out, k_out
