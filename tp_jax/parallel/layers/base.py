"""What every parallel layer shares: the loading interface, params created from their declaration.

A `ParallelModule` declares each param once (`loading()` -> `ShardedParam`); `declared_param`
creates the param from that declaration, so its PartitionSpec and padding mask are derived,
never written a second time. A `MethodLayer` is a ParallelModule whose weight is held and
multiplied by a `LinearMethod` (layers/method.py): the layer states the weight's split, the
method turns that statement into its params and runs the local GEMM.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tp_jax.parallel.layers.loading import LazyTensor, ShardedParam
from tp_jax.parallel.layers.method import LINEAR, UNQUANTIZED, DerivedParam, LinearMethod, WeightParam

Spec = tuple[str | None, ...]


def check_tp_size(tp_size: int, where: str) -> None:
    if not isinstance(tp_size, (int, np.integer)) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"{where}: tp_size={tp_size!r} must be a positive integer.")


def split_size(size: int, tp_size: int, what: str, where: str) -> int:
    """`size // tp_size`, or a clear error when tp does not divide it (no padding defined)."""
    check_tp_size(tp_size, where)
    if size % tp_size:
        raise ValueError(f"{where}: {what}={size} is not divisible by tp={tp_size}, and this layer "
                         f"defines no padding for it; choose a tensor-parallel size that divides {size}.")
    return size // tp_size


def show_init_signature(cls: type) -> None:
    """Make `help(cls)` / `inspect.signature(cls)` show `__init__`'s arguments.

    NNX's metaclass defines `__call__(*args, **kwargs)`, which `inspect` would report instead.
    """
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    cls.__signature__ = inspect.Signature(params)


class ParallelModule(nnx.Module):
    """A module whose params are declared by `loading()` and can be filled from checkpoint tensors.

    Subclasses implement `loading() -> {param name: ShardedParam}` (the one statement of each
    param's split) and create their params with `declared_param`. The loader reads a rank's
    block through `load_block`; tests and small models can use `load_global` + `set_params`.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        show_init_signature(cls)

    def loading(self) -> dict[str, ShardedParam]:
        """{param name: ShardedParam}: the checkpoint parts of each param and how it splits over tp."""
        raise NotImplementedError(f"{type(self).__name__} declares no loading(); a ParallelModule must "
                                  f"return {{param name: ShardedParam}}")

    def load_block(self, name: str, rank: int, tensors: Mapping[str, LazyTensor],
                   names: Mapping[str, str] | None = None) -> np.ndarray:
        """Rank `rank`'s block of param `name`, built from its parts (tensors in the declared layout)."""
        decl = self.loading()
        if name not in decl:
            raise KeyError(f"{type(self).__name__} has no param {name!r}; it has {sorted(decl)}")
        return decl[name].block(rank, tensors, names)

    def load_global(self, tensors: Mapping[str, Mapping[str, LazyTensor]]) -> dict[str, np.ndarray]:
        """The full (global) value of each param: every rank's block, concatenated.

        `tensors`: {param name: {part: tensor}}. For tests and small models; the loader
        places per-device blocks instead.
        """
        out = {}
        for name, decl in self.loading().items():
            parts = tensors[decl.reads if isinstance(decl, DerivedParam) else name]
            blocks = [decl.block(r, parts) for r in range(self.tp_size)]
            dim = decl.param_dim
            out[name] = blocks[0] if dim is None else np.concatenate(blocks, axis=dim)
        return out

    def set_params(self, values: Mapping[str, np.ndarray]) -> None:
        """Set params from global values (e.g. `load_global`'s), checking each shape."""
        for name, value in values.items():
            var = getattr(self, name)
            expected = tuple(var[...].shape)
            if tuple(value.shape) != expected:
                raise ValueError(f"{type(self).__name__}.{name}: value of shape {tuple(value.shape)}, "
                                 f"expected {expected}")
            var.set_value(jnp.asarray(value, var[...].dtype))


ParallelModule.__signature__ = inspect.Signature()      # an abstract base: subclasses bring the arguments


class WeightView:
    """What a layer loop's view of a layer may hold in place of a `MethodLayer`'s weight param: it runs the
    layer's GEMM (`gemm(layer, x)`), e.g. a switched loop's `SlotSwitch` (layers/switched.py)."""

    def gemm(self, layer: MethodLayer, x: jax.Array) -> jax.Array:
        raise NotImplementedError


class MethodLayer(ParallelModule):
    """A ParallelModule with one weight W[out, in] held by a `LinearMethod` (vLLM's `quant_method`).

    Subclasses set `weight_name` ("kernel", "embedding"), `weight_kind` (LINEAR / EMBEDDING),
    `weight_transposed` (the float param is W^T, `[in, out]`), implement `statements()`
    (`{param name: ShardedParam}` of the float layout, the weight's included: the one statement
    of each split) and `weight_shape()` (the float weight's global shape), and call
    `init_weight` in their constructor. `loading()` is `statements()` with the weight's entry
    replaced by the method's params; `self.method.apply(self, x)` is the local GEMM.
    """
    weight_name: ClassVar[str] = "kernel"
    weight_kind: ClassVar[str] = LINEAR
    weight_transposed: ClassVar[bool] = True
    keep_float: ClassVar[bool] = False           # quantization leaves it float (an MoE router, MLA's kv_b_proj)
    switched: ClassVar[bool] = True              # reads its weight only through gemm (a switched loop may)

    def statements(self) -> dict[str, ShardedParam]:
        raise NotImplementedError(f"{type(self).__name__} declares no statements()")

    def weight_shape(self) -> tuple[int, ...]:
        raise NotImplementedError(f"{type(self).__name__} declares no weight_shape()")

    def gemm(self, x: jax.Array) -> jax.Array:
        """`self.method.apply(self, x)`, this rank's GEMM; in a layer loop's view whose weight is a `WeightView`
        (a switched Stack's `SlotSwitch`, layers/switched.py), that view's GEMM."""
        view = getattr(self, self.weight_name).get_value()
        if isinstance(view, WeightView):
            return view.gemm(self, x)
        return self.method.apply(self, x)

    def loading(self) -> dict[str, ShardedParam]:
        decl = self.statements()
        weight = decl.pop(self.weight_name)
        return {**{self.weight_name + s: p.decl for s, p in self._weight_params(weight).items()}, **decl}

    def _weight_params(self, weight: ShardedParam) -> dict[str, WeightParam]:
        return self.method.params(weight, self.weight_name, self.weight_shape(), self.param_dtype)

    def init_weight(self, method: LinearMethod | None, dtype, rngs: nnx.Rngs, init) -> None:
        """Create the weight's params for `method` (None: unquantized, initialized by `init`)."""
        self.method = UNQUANTIZED if method is None else method
        self.param_dtype = jnp.dtype(dtype)
        weight = self.statements()[self.weight_name]
        self.method.check(self, weight)
        for suffix, p in self._weight_params(weight).items():
            setattr(self, self.weight_name + suffix, declared_param(
                rngs, p.decl, p.shape, p.dtype, self.method.initializer(init)))

    def use_method(self, method: LinearMethod) -> None:
        """Re-create the weight's params for `method` on a built layer (the loader does this on an abstract
        model). Leading axes a `Stack` added (layers on pp) are kept; the new params hold zeros."""
        weight = self.statements()[self.weight_name]
        method.check(self, weight)
        first = getattr(self, self.weight_name)
        lead = first[...].ndim - len(self.weight_shape())
        lead_shape, lead_spec = tuple(first[...].shape[:lead]), tuple(first.get_metadata()["out_sharding"][:lead])
        for suffix in self.method.suffixes:
            delattr(self, self.weight_name + suffix)
        self.method = method
        for suffix, p in self._weight_params(weight).items():
            setattr(self, self.weight_name + suffix, nnx.Param(jnp.zeros(lead_shape + p.shape, p.dtype),
                                                               out_sharding=lead_spec + p.decl.spec()))

    def weight(self, suffix: str = "") -> jax.Array:
        """This rank's block of the weight's param `weight_name + suffix` (inside shard_map)."""
        return getattr(self, self.weight_name + suffix)[...]


def declared_param(rngs: nnx.Rngs, decl: ShardedParam, shape: tuple[int, ...], dtype, init=None) -> nnx.Param:
    """An `nnx.Param` of global `shape` whose spec and padding zeros come from its declaration."""
    init = init or nnx.initializers.zeros_init()
    value = init(rngs.params(), shape, dtype)
    mask = decl.padding_mask(shape)
    if mask is not None:
        value = jnp.where(jnp.asarray(mask), jnp.zeros((), dtype), value)
    return nnx.Param(value, out_sharding=decl.spec())


def default_kernel_init():
    return nnx.initializers.lecun_normal()

