"""Stack: N copies of one module with params stacked on a leading layer axis, run with lax.scan.

The layer axis is sharded on pp (each pipeline stage holds its own layers; with pp = 1
every device holds all of them). Compile time does not grow with depth.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from tp_jax.parallel.mesh import PP


class Stack(nnx.Module):
    def __init__(self, make: Callable[[nnx.Rngs], nnx.Module], num_layers: int, rngs: nnx.Rngs):
        if num_layers < 1:
            raise ValueError(f"Stack: num_layers={num_layers} must be >= 1.")

        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: PP})
        def build(r):
            return make(r)

        self.layers = build(rngs)
        self.num_layers = num_layers

    def __call__(self, fn: Callable, h: jax.Array, carry_xs=None):
        """Scan `h = fn(layer, h, xs_i)` over the local layers; `carry_xs` is per-layer data ([L, ...])."""
        graphdef, state = nnx.split(self.layers)

        def body(h, xs):
            layer_state, x_i = xs
            h, y_i = fn(nnx.merge(graphdef, layer_state), h, x_i)
            return h, y_i

        return jax.lax.scan(body, h, (state, carry_xs))
