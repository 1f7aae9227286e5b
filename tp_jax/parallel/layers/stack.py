"""Stack: N copies of one module with params stacked on a leading layer axis, run with lax.scan.

The layer axis is sharded on pp (each pipeline stage holds its own layers; with pp = 1
every device holds all of them). Compile time does not grow with depth.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from tp_jax.parallel.layers.base import show_init_signature
from tp_jax.parallel.mesh import PP


class Stack(nnx.Module):
    """N copies of a module, params stacked on a leading layer axis sharded on pp.

    Args:
      make: `make(rngs) -> module`, called once per layer (under `nnx.vmap`).
      num_layers: N (>= 1).
      rngs: `nnx.Rngs`, split per layer.

    `stack(fn, h, carry)` scans `h, carry = fn(layer_i, i, h, carry)` over the local layers and
    returns (h, carry). In a name table, a stacked param's path is "<stack path>.layers.<param>" and its
    checkpoint names carry `{i}` for the layer index.
    """

    def __init__(self, make: Callable[[nnx.Rngs], nnx.Module], num_layers: int, rngs: nnx.Rngs):
        if num_layers < 1:
            raise ValueError(f"Stack: num_layers={num_layers} must be >= 1.")

        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: PP})
        def build(r):
            return make(r)

        self.layers = build(rngs)
        self.num_layers = num_layers

    def __call__(self, fn: Callable, h: jax.Array, carry=None):
        """Scan `h, carry = fn(layer, index, h, carry)` over the local layers (index: this rank's slot).

        `carry` is threaded through every layer (e.g. a KV pool each layer writes in place).
        """
        graphdef, state = nnx.split(self.layers)

        def body(c, xs):
            layer_state, index = xs
            return fn(nnx.merge(graphdef, layer_state), index, *c), None

        num_local = jax.tree.leaves(state)[0].shape[0]
        (h, carry), _ = jax.lax.scan(body, (h, carry), (state, jnp.arange(num_local, dtype=jnp.int32)))
        return h, carry


show_init_signature(Stack)
