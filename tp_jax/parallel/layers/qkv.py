"""QKVParallelLinear: the fused q/k/v projection, laid out by the head plan (tp_jax.parallel.heads).

W[D, tp * (q_local + 2 kv_local) * head_dim]; rank i's block is [Q_i, K_i, V_i], where
Q_i holds the query heads of the plan's slots on rank i (zeros for padded slots) and
K_i, V_i its KV heads (replicated across ranks when tp > num_kv_heads, as in vLLM).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tp_jax.parallel.heads import HeadPlan, plan_heads
from tp_jax.parallel.layers.base import ParallelModule
from tp_jax.parallel.layers.linear import ColumnParallelLinear
from tp_jax.parallel.layers.loading import PartRows, ShardedParam, expand_heads
from tp_jax.parallel.layers.method import LinearMethod


class QKVParallelLinear(ColumnParallelLinear):
    """X[..., D] -> (Q[..., q_local, hd], K[..., kv_local, hd], V[..., kv_local, hd]) per rank.

    Args:
      hidden_size: D. head_dim: hd. num_heads, num_kv_heads: query and KV heads (None: MHA).
      tp_size: the mesh's tp size; the head plan (`.plan`, `plan_heads`) pads or replicates
        heads so any tp works. bias: q/k/v biases. dtype, rngs, kernel_init, method: as for linear layers.
    Checkpoint parts: "q" `[num_heads*hd, D]`, "k" and "v" `[num_kv_heads*hd, D]` (and the
    biases); a fused q|k|v tensor feeds them through name-table entries with row offsets.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int | None = None,
                 *, tp_size: int = 1, bias: bool = False, dtype=jnp.float32, rngs: nnx.Rngs,
                 kernel_init=None, method: LinearMethod | None = None):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        self.plan: HeadPlan = plan_heads(num_heads, num_kv_heads, tp_size)
        self.q_local, self.kv_local = self.plan.q_local, self.plan.kv_local
        local = (self.q_local + 2 * self.kv_local) * head_dim
        super().__init__(hidden_size, tp_size * local, tp_size=tp_size, bias=bias, gather_output=False,
                         dtype=dtype, rngs=rngs, kernel_init=kernel_init, method=method)

    def statements(self):
        hd, d = self.head_dim, self.in_features
        rows = {"q": (self.num_heads, expand_heads(self.plan.q_heads, hd)),
                "k": (self.num_kv_heads, expand_heads(self.plan.kv_heads, hd)),
                "v": (self.num_kv_heads, expand_heads(self.plan.kv_heads, hd))}
        kernel = {p: PartRows((n * hd, d), r) for p, (n, r) in rows.items()}
        decl = {"kernel": ShardedParam(kernel, split=0, transpose=True)}
        if self.use_bias:
            decl["bias"] = ShardedParam({p: PartRows((n * hd,), r) for p, (n, r) in rows.items()}, split=0)
        return decl

    def split(self, y: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """[..., (q_local + 2 kv_local) * hd] -> q [..., q_local, hd], k, v [..., kv_local, hd]."""
        hd = self.head_dim
        q_end, k_end = self.q_local * hd, (self.q_local + self.kv_local) * hd
        q, k, v = y[..., :q_end], y[..., q_end:k_end], y[..., k_end:]
        return (q.reshape(*q.shape[:-1], self.q_local, hd), k.reshape(*k.shape[:-1], self.kv_local, hd),
                v.reshape(*v.shape[:-1], self.kv_local, hd))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self.split(super().__call__(x))


class AttentionSinks(ParallelModule):
    """gpt-oss's attention sinks: one learned logit per query head, laid out by the head plan like the q rows.

    `weight[tp * q_local]` split over tp: rank r holds the sinks of its query slots (0 for a padded slot, whose
    q and o_proj rows are zero anyway). Checkpoint part: "weight" `[num_heads]`. Called -> this rank's [q_local].
    """

    def __init__(self, plan: HeadPlan, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.plan, self.tp_size = plan, plan.tp
        self.weight = nnx.Param(jnp.zeros((plan.tp * plan.q_local,), dtype),
                                out_sharding=self.loading()["weight"].spec())

    def loading(self):
        return {"weight": ShardedParam({"weight": PartRows((self.plan.num_heads,), expand_heads(self.plan.q_heads, 1))},
                                       split=0)}

    def __call__(self) -> jax.Array:
        return self.weight[...]
