"""Stack: N copies of one module with params stacked on a leading layer axis, run with lax.scan.

The layer axis is sharded on pp (each pipeline stage holds its own layers; with pp = 1
every device holds all of them). Compile time does not grow with depth.

`unstack(mesh)` trades that for speed where a step reads every weight once (decode): XLA:CPU
copies each layer's slice out of a stacked weight before its matmul (a dynamic-slice per weight
per layer, as many bytes again as the matmuls read), so a serving engine stores one array per
local layer slot instead ([pp, ...] each, still sharded on pp) and keeps the loop over those slots
(`fori_loop`, one layer body): each linear layer's GEMM in the body is a `lax.switch` over the slots
whose branch j is the dot of slot j's own weight (`MethodLayer.gemm`), a whole buffer XLA reads in
place; the other params (norms, biases, the per-channel scales a method applies after its dot: small)
are stacked and indexed per layer. XLA:CPU compiles each branch apart, so a branch holds only the dot:
the method's work on the activations alone (`LinearMethod.prepare`) runs before the switch and its
scales (`LinearMethod.finish`) after it, once, and the compile time stays near the scan's. Same
numbers as the scan.

`LLM(layer_loop=...)` picks "scan" (the stack as built) or "switch" (`unstack`); which one "auto"
means is the engine's resolve step's rule (tp_jax/serving/resolve.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from tp_jax.parallel.layers.base import MethodLayer, show_init_signature
from tp_jax.parallel.mesh import PP


class Stack(nnx.Module):
    """N copies of a module, params stacked on a leading layer axis sharded on pp.

    Args:
      make: `make(rngs) -> module`, called once per layer (under `nnx.vmap`).
      num_layers: N (>= 1).
      rngs: `nnx.Rngs`, split per layer.
      layer_map: slot -> checkpoint layer index (-1: a padding slot, zeros) for the loader, when this stack's
        slots are not the model's own `layer_map` (a stack holding one kind of a model's varied layers).

    `stack(fn, h, carry)` runs `h, carry = fn(layer_i, i, h, carry)` over the local layers (a scan; a switched
    loop after `unstack`) and returns (h, carry); `stack.slot_view()` gives one local slot at a traced index.
    In a name table, a stacked param's path is "<stack path>.layers.<param>" and its checkpoint names carry
    `{i}` for the layer index.
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
        self.slots = None                        # after unstack(): one module per local layer slot

    def __call__(self, fn: Callable, h: jax.Array, carry=None):
        """Run `h, carry = fn(layer, index, h, carry)` over the local layers (index: this rank's slot).

        `carry` is threaded through every layer (e.g. a KV pool each layer writes in place).
        """
        if self.slots is not None:
            return self._switched(fn, h, carry)
        graphdef, state = nnx.split(self.layers)

        def body(c, xs):
            layer_state, index = xs
            return fn(nnx.merge(graphdef, layer_state), index, *c), None

        num_local = jax.tree.leaves(state)[0].shape[0]
        (h, carry), _ = jax.lax.scan(body, (h, carry), (state, jnp.arange(num_local, dtype=jnp.int32)))
        return h, carry

    def _switched(self, fn: Callable, h: jax.Array, carry):
        """The loop of `unstack()`: one layer body, GEMM weights switched, the rest indexed."""
        slot = self._switched_slot()

        def body(index, c):
            with slot(index) as layer:
                return fn(layer, index, *c)

        return jax.lax.fori_loop(0, len(self.slots), body, (h, carry))

    def _switched_slot(self):
        """`slot(index)`: a context giving the unstacked layer at a traced local index, its GEMMs switched over
        the slots' own weights and its other params indexed from stacked copies."""
        graphdef, _ = nnx.split(self.slots[0])
        states = [jax.tree.map(lambda x: x[0], nnx.split(slot)[1]) for slot in self.slots]   # bitcasts
        peers = [nnx.merge(graphdef, state) for state in states]
        owned = _gemm_weights(peers)
        flat = [jax.tree.flatten(state) for state in states]
        treedef = flat[0][1]
        kept = [id(x) in owned for x in flat[0][0]]
        stacked = [None if keep else jnp.stack([leaves[k] for leaves, _ in flat])
                   for k, keep in enumerate(kept)]
        slots_of = [_gemm_layers(peer) for peer in peers]

        @contextlib.contextmanager
        def slot(index):
            leaves = [flat[0][0][k] if keep else jax.lax.dynamic_index_in_dim(stacked[k], index, keepdims=False)
                      for k, keep in enumerate(kept)]
            layer = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
            with contextlib.ExitStack() as switching:
                for k, node in enumerate(_gemm_layers(layer)):
                    switching.enter_context(node.switching(index, [same[k] for same in slots_of]))
                yield layer

        return slot

    def slot_view(self) -> Callable:
        """`view(index)`: a context giving the layer at local slot `index` (a traced int32) alone, for a caller running
        one slot from another stack's loop: sliced from the stacked params, or (after `unstack`) with its GEMMs
        switched over the slots. Build the view once, outside the loop that calls it (it stacks the switched
        layers' small params)."""
        if self.slots is not None:
            return self._switched_slot()
        graphdef, state = nnx.split(self.layers)

        @contextlib.contextmanager
        def view(index):
            yield nnx.merge(graphdef, jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False),
                                                   state))
        return view

    def unstack(self, mesh: jax.sharding.Mesh) -> None:
        """Store one array per local layer slot, looped over with switched GEMMs (see the module doc); the
        stacked arrays are freed."""
        if self.slots is not None:
            return
        pp = mesh.shape[PP]
        num_local = self.num_layers // pp
        graphdef, state = nnx.split(self.layers)
        specs = nnx.get_partition_spec(state)

        slicers = {}                             # spec -> one jitted slicer (jit reuses it for equal shapes)

        def split_leaf(x, spec):                 # stage s's slot j = layer s * num_local + j, no data moves
            if spec not in slicers:              # a traced slot index: one small compile per shape, not per slot
                slicers[spec] = jax.jit(jax.shard_map(lambda a, j: jax.lax.dynamic_slice_in_dim(a, j, 1),
                                                      mesh=mesh, in_specs=(spec, jax.P()), out_specs=spec,
                                                      check_vma=False))
            out = tuple(slicers[spec](x, jnp.int32(j)) for j in range(num_local))
            x.delete()                           # one weight's worth of extra memory at a time
            return out

        pieces = jax.tree.map(split_leaf, state, specs)
        self.slots = nnx.data(nnx.List([nnx.merge(graphdef, jax.tree.map(lambda p: p[j], pieces,
                                                                is_leaf=lambda p: isinstance(p, tuple)))
                               for j in range(num_local)]))
        self.layers = None


def _gemm_layers(module: nnx.Module) -> list[MethodLayer]:
    """The layers in `module` whose weight only `MethodLayer.gemm` reads (in graph order)."""
    return [node for _, node in nnx.iter_graph(module) if isinstance(node, MethodLayer) and node.switched]


def _gemm_weights(peers: list[nnx.Module]) -> set[int]:
    """ids of the first slot's arrays only the switched GEMMs' branches read (`MethodLayer.switch_owned`: the
    weights, not their biases, nor the scales a method applies after its dot), the same layers of `peers`."""
    layers = list(zip(*(_gemm_layers(peer) for peer in peers)))
    return {id(getattr(same[0], name).get_value()) for same in layers for name in same[0].switch_owned(same)}


LAYER_LOOPS = ("scan", "switch")


def unstack_all(model: nnx.Module, mesh: jax.sharding.Mesh) -> None:
    """`Stack.unstack` every Stack in `model` (in place)."""
    for stack in [node for _, node in nnx.iter_graph(model) if isinstance(node, Stack)]:
        stack.unstack(mesh)


def use_layer_loop(model: nnx.Module, mesh: jax.sharding.Mesh, loop: str) -> None:
    """Run every Stack of `model` with `loop` ("scan" or "switch")."""
    if loop not in LAYER_LOOPS:
        raise ValueError(f"use_layer_loop: loop={loop!r} must be one of {LAYER_LOOPS}")
    if loop == "switch":
        unstack_all(model, mesh)


show_init_signature(Stack)
