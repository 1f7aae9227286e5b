"""Stack: N copies of one module with params stacked on a leading layer axis, run with lax.scan.

The layer axis is sharded on pp (each pipeline stage holds its own layers; with pp = 1
every device holds all of them). Compile time does not grow with depth.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from tp_jax.parallel.layers.base import show_init_signature
from tp_jax.parallel.mesh import PP


class Stack(nnx.Module):
    """N copies of a module, params stacked on a leading layer axis sharded on pp.

    Args:
      make: `make(rngs) -> module`, called once per layer (under `nnx.vmap`).
      num_layers: N (>= 1).
      rngs: `nnx.Rngs`, split per layer.

    `stack(fn, h, xs)` scans `h, y_i = fn(layer_i, h, xs_i)` over the local layers and returns
    (h, ys). In a name table, a stacked param's path is "<stack path>.layers.<param>" and its
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

    def __call__(self, fn: Callable, h: jax.Array, carry_xs=None):
        """Scan `h = fn(layer, h, xs_i)` over the local layers; `carry_xs` is per-layer data ([L, ...])."""
        graphdef, state = nnx.split(self.layers)

        def body(h, xs):
            layer_state, x_i = xs
            h, y_i = fn(nnx.merge(graphdef, layer_state), h, x_i)
            return h, y_i

        return jax.lax.scan(body, h, (state, carry_xs))


show_init_signature(Stack)
