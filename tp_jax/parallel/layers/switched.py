"""The switched layer loop: a `Stack`'s layers stored one array per local slot, each GEMM a `lax.switch`.

XLA:CPU copies each layer's slice out of a stacked weight before its matmul (a dynamic-slice per weight
per layer, as many bytes again as the matmuls read). `SwitchLoop`, a strategy a `Stack` is given
(`Stack.use_loop`), stores one array per local layer slot instead ([pp, ...] each, still sharded on pp)
and keeps the loop over those slots (`fori_loop`, one layer body). The body runs a view of the layer at
the traced slot index: its small params (norms, biases, the per-channel scales a method applies after
its dot) indexed from stacked copies, and in place of each GEMM layer's weight a `SlotSwitch`, the loop
index and that layer of every slot, with which `MethodLayer.gemm` runs

    y = finish(layer, switch(index, [multiply(slot_j, p) for j in slots]), p),   p = prepare(x)

each branch the dot of slot j's own weight, a whole buffer XLA reads in place. XLA:CPU compiles each
branch apart, so a branch holds only the dot: the method's work on the activations alone
(`SplitGemm.prepare`, layers/method.py) runs before the switch and its scales (`SplitGemm.finish`) after
it, once (a method that is no `SplitGemm` runs whole in each branch: `gemm_parts`), and
the compile time stays near the scan's. Slots held by different methods (GGUF types) switch over each
method's whole `apply`. Same numbers as the scan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tp_jax.parallel.layers.base import MethodLayer, WeightView
from tp_jax.parallel.layers.method import gemm_parts
from tp_jax.parallel.mesh import PP


class SlotSwitch(WeightView):
    """A GEMM weight in a switched loop's view of a layer: the loop's slot index and the same layer of every
    slot (`peers`), whose weights the GEMM switches over. A plain object: static to nnx, never a param."""

    def __init__(self, index: jax.Array, peers: Sequence[MethodLayer]):
        self.index, self.peers = index, tuple(peers)

    def gemm(self, layer: MethodLayer, x: jax.Array) -> jax.Array:
        """`layer.method.apply(layer, x)` with the weight of slot `index` (module doc). A single row is padded to
        two (XLA:CPU generates a kernel for every 1-row dot)."""
        rows = int(np.prod(x.shape[:-1]))
        a = x.reshape(rows, x.shape[-1])
        if rows == 1:
            a = jnp.concatenate([a, a], axis=0)
        if same_method(self.peers):
            parts = gemm_parts(layer.method)
            prepared = parts.prepare(a)
            raw = jax.lax.switch(self.index, [branch(peer, "multiply") for peer in self.peers], prepared)
            y = parts.finish(layer, raw, prepared)
        else:                                                     # layers held by different methods (GGUF types)
            y = jax.lax.switch(self.index, [branch(peer, "apply") for peer in self.peers], a)
        return y[:rows].reshape(*x.shape[:-1], y.shape[-1])


def branch(layer: MethodLayer, op: str):
    """`x -> <op>(layer, x)` ("apply", or `gemm_parts(layer.method)`'s "multiply") as a switch branch that takes the layer's params as arguments of a
    function traced once per (layer structure, op); the structure holds the method (static graph data). The slots
    of a switched Stack share it, so a switch over N slots traces its GEMM once, not N times (each new step shape
    traces the layer loop again)."""
    graphdef, state = nnx.split(layer)
    return functools.partial(_traced_branch(graphdef, op), state)


@functools.lru_cache(maxsize=1024)
def _traced_branch(graphdef, op: str):
    def run(state, x):
        layer = nnx.merge(graphdef, state)
        return getattr(layer.method if op == "apply" else gemm_parts(layer.method), op)(layer, x)
    return jax.jit(run)


def same_method(layers: Sequence[MethodLayer]) -> bool:
    """Whether every layer holds the first's method (a switched GEMM then splits it: `SlotSwitch.gemm`)."""
    return all(layer.method == layers[0].method for layer in layers)


def switch_owned(peers: Sequence[MethodLayer]) -> tuple[str, ...]:
    """The names of the params a switched GEMM over `peers` (one layer of every slot) reads in its branches: the
    method's `multiply_suffixes` (`gemm_parts`) when the peers share it, else every weight param."""
    layer = peers[0]
    suffixes = gemm_parts(layer.method).multiply_suffixes if same_method(peers) else layer.method.suffixes
    return tuple(layer.weight_name + s for s in suffixes)


@dataclasses.dataclass(frozen=True)
class SwitchLoop:
    """The switched layer loop (module doc): `store` splits a Stack's params per local slot, `run` loops over them,
    `view` gives one slot at a traced index."""
    name = "switch"

    def store(self, stack, mesh: jax.sharding.Mesh) -> None:
        """Store one array per local layer slot (`stack.slots`); the stacked arrays are freed."""
        if stack.slots is not None:
            return
        num_local = stack.num_layers // mesh.shape[PP]
        graphdef, state = nnx.split(stack.layers)
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
        stack.slots = nnx.data(nnx.List([nnx.merge(graphdef, jax.tree.map(lambda p: p[j], pieces,
                                                                 is_leaf=lambda p: isinstance(p, tuple)))
                                for j in range(num_local)]))
        stack.layers = None

    def run(self, stack, fn: Callable, h: jax.Array, carry):
        """One layer body in a `fori_loop` over the local slots, GEMM weights switched, the rest indexed."""
        slot = self.view(stack)

        def body(index, c):
            with slot(index) as layer:
                return fn(layer, index, *c)

        return jax.lax.fori_loop(0, len(stack.slots), body, (h, carry))

    def view(self, stack) -> Callable:
        """`slot(index)`: a context giving the layer at a traced local index, each GEMM layer's weight a
        `SlotSwitch` over the slots' own weights, its other params indexed from stacked copies (stacked here:
        build the view once, outside the loop that calls it)."""
        graphdef, _ = nnx.split(stack.slots[0])
        states = [jax.tree.map(lambda x: x[0], nnx.split(slot)[1]) for slot in stack.slots]   # bitcasts
        peers = [nnx.merge(graphdef, state) for state in states]
        same = list(zip(*(_gemm_layers(peer) for peer in peers)))          # each GEMM layer of every slot
        owned = {id(getattr(s[0], name).get_value()) for s in same for name in switch_owned(s)}
        switched = {id(getattr(s[0], s[0].weight_name).get_value()): k for k, s in enumerate(same)}
        flat = [jax.tree.flatten(state) for state in states]
        treedef = flat[0][1]
        kept = [id(x) in owned for x in flat[0][0]]
        gemm = [switched.get(id(x)) for x in flat[0][0]]
        stacked = [None if keep else jnp.stack([leaves[k] for leaves, _ in flat])
                   for k, keep in enumerate(kept)]

        @contextlib.contextmanager
        def slot(index):
            leaves = [SlotSwitch(index, same[gemm[k]]) if gemm[k] is not None else flat[0][0][k] if keep else
                      jax.lax.dynamic_index_in_dim(stacked[k], index, keepdims=False) for k, keep in enumerate(kept)]
            yield nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

        return slot


def _gemm_layers(module: nnx.Module) -> list[MethodLayer]:
    """The layers in `module` whose weight only `MethodLayer.gemm` reads (in graph order)."""
    return [node for _, node in nnx.iter_graph(module) if isinstance(node, MethodLayer) and node.switched]


SWITCH = SwitchLoop()
