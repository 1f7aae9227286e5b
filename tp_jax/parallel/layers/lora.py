"""LoRA on the parallel linear layers (vLLM's vllm/lora/layers/), several adapters in one batch.

A step with adapters passes them to the model as an argument, `LoRAStep(weights, slots, parts)`: for
each target layer of the decoder stack, by its path in a layer ("self_attn.qkv_proj"),

    weights[key] = (A[L, S, in, P * R], B[L, S, R, out])    L stacked layers, S adapter slots,
                                                             P the layer's fused parts (q, k, v)
    slots[B, T]                                              each token's adapter slot (-1: none)
    y += (x @ A_l[s]) @ B_l[s]       for the tokens of slot s

The layer loop (tp_jax/models/cache.py `run_layers`) carries each micro-batch's slots and runs its view of
layer l through `LoRAStep.view(layer, l, slots)`: the same layer, each target's weight a `LoRAWeight` (a
`WeightView`, tp_jax/parallel/layers/base.py) whose GEMM is the target's own (`MethodLayer.gemm`) plus
`add`'s contribution, before the layer's bias and collective. The model's params, its loader and its
layer loops know nothing of LoRA, and nothing is written onto a built layer.

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

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tp_jax.parallel.layers.base import MethodLayer, WeightView


@dataclasses.dataclass(frozen=True)
class LoRAStep:
    """A step's adapters (local blocks, under shard_map): `weights` {key: (A, B)}, each token's `slots`[B, T] and
    each layer's local output columns per fused part (`parts` {key: (n, ...)}, static)."""
    weights: dict[str, tuple[jax.Array, jax.Array]]
    slots: jax.Array
    parts: dict[str, tuple[int, ...]]

    def view(self, layer: nnx.Module, index: jax.Array, slots: jax.Array) -> nnx.Module:
        """`layer` (a loop's view of local stacked layer `index`) with each target's weight a `LoRAWeight` for
        `slots` (its micro-batch's)."""
        targets = {}
        for key, (a, b) in self.weights.items():
            node = _node(layer, key)
            targets[id(getattr(node, node.weight_name).get_value())] = LayerLoRA(node, index, slots, a, b,
                                                                                 self.parts[key])
        graphdef, state = nnx.split(layer)
        leaves, treedef = jax.tree.flatten(state)
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, [targets.get(id(v), v) for v in leaves]))


class LayerLoRA(WeightView):
    """A target layer's weight in a LoRA step's view: `base`, the layer as the loop gave it (its GEMM the method's
    or a switched one), plus its adapters at local layer `index` for the tokens' `slots`."""

    def __init__(self, base: MethodLayer, index: jax.Array, slots: jax.Array, a: jax.Array, b: jax.Array,
                 parts: tuple[int, ...]):
        self.base, self.index, self.slots, self.a, self.b, self.parts = base, index, slots, a, b, parts

    def gemm(self, layer: MethodLayer, x: jax.Array) -> jax.Array:
        return add(x, self.base.gemm(x), self)


def add(x: jax.Array, y: jax.Array, lora: LayerLoRA) -> jax.Array:
    """y (the GEMM of x, local shapes) plus the layer's LoRA contribution, each token's by its slot."""
    rows, flat = x.reshape(-1, x.shape[-1]), lora.slots.reshape(-1)
    out = jax.lax.cond(jnp.any(flat >= 0), lambda: delta(rows, flat, lora.index, lora.a, lora.b, lora.parts),
                       lambda: jnp.zeros((rows.shape[0], y.shape[-1]), jnp.float32))
    return y + out.reshape(y.shape).astype(y.dtype)


def _node(module: nnx.Module, key: str) -> MethodLayer:
    for name in key.split("."):
        module = getattr(module, name)
    return module


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
