"""Stack: N copies of one module with params stacked on a leading layer axis, run by a layer loop.

The layer axis is sharded on pp (each pipeline stage holds its own layers; with pp = 1
every device holds all of them). How the local layers run is a strategy the stack is given
(`Stack.use_loop`): `ScanLoop` (the default, the stack as built: one `lax.scan` body, so compile
time does not grow with depth) or `SwitchLoop` (tp_jax/parallel/layers/switched.py: one array per
local layer slot, each GEMM a `lax.switch` over the slots' own weights, read in place; same numbers).

`LLM(layer_loop=...)` picks "scan" or "switch" (`use_layer_loop`); which one "auto" means is the
engine's resolve step's rule (tp_jax/serving/resolve.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from tp_jax.parallel.layers.base import show_init_signature
from tp_jax.parallel.layers.switched import SWITCH
from tp_jax.parallel.mesh import PP


class Stack(nnx.Module):
    """N copies of a module, params stacked on a leading layer axis sharded on pp.

    Args:
      make: `make(rngs) -> module`, called once per layer (under `nnx.vmap`).
      num_layers: N (>= 1).
      rngs: `nnx.Rngs`, split per layer.
      layer_map: slot -> checkpoint layer index (-1: a padding slot, zeros) for the loader, when this stack's
        slots are not the model's own `layer_map` (a stack holding one kind of a model's varied layers).

    `stack(fn, h, carry)` runs `h, carry = fn(layer_i, i, h, carry)` over the local layers by the stack's `loop`
    (`ScanLoop`, or another after `use_loop`) and returns (h, carry); `stack.slot_view()` gives one local slot at
    a traced index. In a name table, a stacked param's path is "<stack path>.layers.<param>" and its checkpoint
    names carry `{i}` for the layer index.
    """

    def __init__(self, make: Callable[[nnx.Rngs], nnx.Module], num_layers: int, rngs: nnx.Rngs,
                 layer_map: tuple[int, ...] | None = None):
        if num_layers < 1:
            raise ValueError(f"Stack: num_layers={num_layers} must be >= 1.")
        if layer_map is not None and len(layer_map) != num_layers:
            raise ValueError(f"Stack: layer_map has {len(layer_map)} slots for num_layers={num_layers}.")
        self.layer_map = None if layer_map is None else tuple(int(i) for i in layer_map)

        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: PP})
        def build(r):
            return make(r)

        self.layers = build(rngs)
        self.num_layers = num_layers
        self.slots = None                        # SwitchLoop: one module per local layer slot (layers None)
        self.loop = SCAN                         # the layer loop strategy (static)

    def __call__(self, fn: Callable, h: jax.Array, carry=None):
        """Run `h, carry = fn(layer, index, h, carry)` over the local layers (index: this rank's slot).

        `carry` is threaded through every layer (e.g. a KV pool each layer writes in place).
        """
        return self.loop.run(self, fn, h, carry)

    def slot_view(self) -> Callable:
        """`view(index)`: a context giving the layer at local slot `index` (a traced int32) alone, for a caller running
        one slot from another stack's loop (the loop's `view`). Build the view once, outside the loop that calls it
        (a switched loop stacks the layers' small params there)."""
        return self.loop.view(self)

    def use_loop(self, loop, mesh: jax.sharding.Mesh) -> None:
        """Run the local layers by `loop` from now on (`SwitchLoop` stores the params per slot first)."""
        loop.store(self, mesh)
        self.loop = loop


@dataclasses.dataclass(frozen=True)
class ScanLoop:
    """The stack as built: one layer body scanned over the stacked params."""
    name = "scan"

    def store(self, stack: Stack, mesh: jax.sharding.Mesh) -> None:
        if stack.layers is None:
            raise ValueError("ScanLoop: this Stack's params are stored per slot (a switched loop's); build it again")

    def run(self, stack: Stack, fn: Callable, h: jax.Array, carry):
        graphdef, state = nnx.split(stack.layers)

        def body(c, xs):
            layer_state, index = xs
            return fn(nnx.merge(graphdef, layer_state), index, *c), None

        num_local = jax.tree.leaves(state)[0].shape[0]
        (h, carry), _ = jax.lax.scan(body, (h, carry), (state, jnp.arange(num_local, dtype=jnp.int32)))
        return h, carry

    def view(self, stack: Stack) -> Callable:
        """`view(index)`: the layer sliced from the stacked params at a traced local index."""
        graphdef, state = nnx.split(stack.layers)

        @contextlib.contextmanager
        def view(index):
            yield nnx.merge(graphdef, jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False),
                                                   state))
        return view


SCAN = ScanLoop()
LAYER_LOOPS = {"scan": SCAN, "switch": SWITCH}


def use_layer_loop(model: nnx.Module, mesh: jax.sharding.Mesh, loop: str) -> None:
    """Run every Stack of `model` by the loop named `loop` ("scan" or "switch")."""
    if loop not in LAYER_LOOPS:
        raise ValueError(f"use_layer_loop: loop={loop!r} must be one of {tuple(LAYER_LOOPS)}")
    for stack in [node for _, node in nnx.iter_graph(model) if isinstance(node, Stack)]:
        stack.use_loop(LAYER_LOOPS[loop], mesh)


show_init_signature(Stack)
