"""Linear methods (vLLM's `quant_method`): what a layer's weight is in memory and how its local GEMM runs.

The split of responsibilities, as in vLLM's `LinearBase.quant_method`:

* the **layer** owns the split: its one statement of the weight W[out, in] (a
  `ShardedParam` over the checkpoint parts: which rows or columns each tp rank takes), its
  shapes, and its collectives (the row-parallel all-reduce, the column all-gather);
* the **method** owns the weight's representation: the params standing for W (one float
  kernel; int8 values + per-channel scales; GGUF blocks + scales), each *derived* from the
  layer's statement (so scales split with a column layer's output rows and are whole on a
  row layer, where every rank holds every output channel), how one rank's block of each is
  built from the checkpoint tensors, and the local GEMM `apply(layer, x)`.

A method is a small frozen dataclass, shared by every layer it serves; it holds no arrays.
It also owns the dtypes the dot runs in (operands and accumulator). The methods:
`Unquantized` (here: the float kernel in the model's dtype, bit for bit), `Bfloat16` (here: the
weight in bf16, bf16 x bf16 dots accumulated in float32), `Int8` (layers/int8.py: int8 weights,
float or per-token int8 activations), `GGUFBlocks` (layers/ggml.py: a GGUF file's blocks) and `ByRows`
(layers/by_rows.py: one weight held by two of them, each GEMM run by the one faster for its rows).
Named configurations that pick a method per layer live in layers/quantization.py.

Every dot of a method that is not `Unquantized` goes through `fast_dot` (int8 activations: int8.py's
`weight_first_dot`, the weight as the left operand, its int32 sums converted by `Int8.finish`): its operands
are bf16 or int8 with a float32 / int32 accumulator, the shapes XLA:CPU has fast kernels for (AVX-512 BF16 /
VNNI, AMX), and a single row is padded to two, since XLA:CPU's kernels for those types fall to a much slower
path at M = 1 (docs/performance.md). The result is float32 whatever the operands, so a row layer's
all-reduce runs in float32; layers cast to their dtype after it.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from tp_jax.parallel.layers.loading import LazyTensor, ShardedParam
from tp_jax.parallel.mesh import TP
from tp_jax.parallel.invariant import row_tiled

LINEAR, EMBEDDING, EXPERTS = "linear", "embedding", "experts"   # the kinds of weight a layer holds


class QuantizationError(ValueError):
    """A quantization request that cannot be met: an unknown method, a checkpoint type it cannot keep."""


class UnsupportedLayerError(QuantizationError):
    """A method asked to hold a weight it cannot (a layer kind it does not serve, a split it cannot follow)."""


@dataclasses.dataclass(frozen=True)
class DerivedParam(ShardedParam):
    """A param a method derives from a layer's weight statement (quantized values, scales, ...).

    It keeps the statement's checkpoint parts and split (so the loader checks the same
    tensors, names and shapes) and adds what differs: the param whose name-table entries
    feed it (`reads`, the layer's weight name), the param's own dimension divided over tp
    (`dim`, None: every rank holds it whole), its rank (`param_ndim`), and `make(rank,
    tensors, names)`, which builds one rank's block from the parts' lazy tensors.
    """
    reads: str = ""
    dim: int | None = None
    param_ndim: int = 2
    make: Callable[..., np.ndarray] | None = None

    @property
    def param_dim(self) -> int | None:
        return self.dim

    def spec(self) -> tuple[str | None, ...]:
        return tuple(TP if i == self.dim else None for i in range(self.param_ndim))

    def padding_mask(self, shape):
        return None                     # `make` writes the zeros of padding rows itself

    def block(self, rank: int, tensors: Mapping[str, LazyTensor], names: Mapping[str, str] | None = None):
        missing = [p for p in self.parts if p not in tensors]
        if missing:
            raise KeyError(f"missing weight part(s) {missing}; this param needs {list(self.parts)}")
        return self.make(rank, tensors, names or {})


@dataclasses.dataclass(frozen=True)
class WeightParam:
    """One param a method creates for a weight: its declaration, global shape and dtype."""
    decl: ShardedParam
    shape: tuple[int, ...]
    dtype: Any


class LinearMethod:
    """The interface. A method is a frozen dataclass (hashable: it is static graph data in NNX).

    Class attributes: `name` (for messages), `kinds` (the layer kinds it serves: LINEAR for
    the Column/Row/QKV/Replicated layers, EMBEDDING for the vocab-parallel embedding and LM
    head). A layer calls, with its weight name (`layer.weight_name`, "kernel" or "embedding"):

    * `suffixes`: the params it creates, as suffixes of the weight name ("" is the weight
      name itself: "kernel", "kernel_scale", ...);
    * `check(layer, weight)`: raise `UnsupportedLayerError` (naming the layer and the fix)
      when it cannot hold this layer's weight; called before any param is created;
    * `params(weight, name, shape, dtype)`: {suffix: WeightParam}, each declared from the
      layer's one statement `weight` (HF layout `[out, in]`, parts, split) for a float
      param of global `shape` and `dtype` (the layer's unquantized kernel or table);
    * `apply(layer, x)`: x[..., in_local] -> [..., out_local], this rank's GEMM (no bias, no
      collective: those are the layer's);
    * `embed(layer, ids)`: rows W[ids] -> [..., in] (EMBEDDING kind only);
    * `apply_f32(layer, x)`: `apply` with float32 output (an MoE router's logits);
    * `initializer(init)`: how its params start on a built layer (`init`, the layer's, or None: zeros).

    `float_weight`: the weight is the layer's float param as declared, in the model's dtype (`Unquantized`):
    the loader casts it to the run's dtype, plans no method for it and reports no quantization. A method that
    lists EXPERTS in `kinds` implements `ExpertMethod` too (checked when the class is defined); one whose GEMM
    has work on x alone or on small params after the dot may implement `SplitGemm` (the switched layer loop).
    `file_blocks`: the params are a checkpoint's quantized blocks as stored (GGUF, GPTQ, ...), which only that
    file can refill (`update_weights` takes float arrays for any other method).
    """
    name: ClassVar[str] = "?"
    kinds: ClassVar[tuple[str, ...]] = (LINEAR, EMBEDDING)
    float_weight: ClassVar[bool] = False
    file_blocks: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        kinds = cls.__dict__.get("kinds")
        if isinstance(kinds, tuple) and EXPERTS in kinds and not issubclass(cls, ExpertMethod):
            raise TypeError(f"{cls.__name__} lists {EXPERTS!r} in kinds but is no ExpertMethod: implement "
                            f"expert_params, expert_kernel and expert_scaled (tp_jax/parallel/layers/method.py)")

    @property
    def suffixes(self) -> tuple[str, ...]:
        raise NotImplementedError

    def check(self, layer, weight: ShardedParam) -> None:
        if layer.weight_kind not in self.kinds:
            raise UnsupportedLayerError(
                f"{self.describe()} does not support {describe_layer(layer)}: it serves {list(self.kinds)} layers; "
                f"leave this layer unquantized")

    def params(self, weight: ShardedParam, name: str, shape: tuple[int, ...], dtype) -> dict[str, WeightParam]:
        raise NotImplementedError

    def apply(self, layer, x: jax.Array) -> jax.Array:
        raise NotImplementedError

    def embed(self, layer, ids: jax.Array) -> jax.Array:
        raise NotImplementedError

    def apply_f32(self, layer, x: jax.Array) -> jax.Array:
        """`apply(layer, x)` as float32 (an MoE router's logits)."""
        return self.apply(layer, x).astype(jnp.float32)

    def initializer(self, init):
        """The initializer of the params it creates on a built layer: None (zeros: they are only ever loaded)."""
        return None

    @property
    def label(self) -> str:
        """How reports name the method ("int8", "gguf Q4_1")."""
        return self.name

    def describe(self) -> str:
        return f"quantization method {self.label!r}"


class SplitGemm(abc.ABC):
    """`apply` in three parts, for the switched layer loop (layers/switched.py `SlotSwitch`), whose GEMM keeps
    only the part that reads the weight in its per-slot branches: `prepare(x)` reads x [M, in] alone (int8
    activations' digits) and runs once before them, `multiply(layer, prepared)` reads the params
    `multiply_suffixes` names (the big ones) and is each branch, `finish(layer, raw, prepared)` turns its raw
    output into [M, out_local] with the other params (per-channel scales: small, stacked over the slots) and
    runs once after them. `finish(layer, multiply(layer, p), p)` with `p = prepare(x)` is `apply(layer, x)` bit
    for bit. A method that is none runs whole in each branch (`gemm_parts`)."""

    @property
    @abc.abstractmethod
    def multiply_suffixes(self) -> tuple[str, ...]:
        """The params (`suffixes`) `multiply` reads; `finish` may read the others."""

    @abc.abstractmethod
    def prepare(self, x: jax.Array):
        """The part of `apply` that reads x [M, in] alone (an activation quantization), as a pytree of arrays."""

    @abc.abstractmethod
    def multiply(self, layer, prepared):
        """The part of `apply` that reads the weight's `multiply_suffixes` params, given `prepare(x)`: its raw
        output (a pytree of arrays)."""

    @abc.abstractmethod
    def finish(self, layer, raw, prepared) -> jax.Array:
        """[M, out_local] from `multiply`'s raw output, reading x only through `prepared` and no param of
        `multiply_suffixes`."""


@dataclasses.dataclass(frozen=True)
class WholeGemm(SplitGemm):
    """A method that is no `SplitGemm` in three parts: nothing before, its whole `apply` (every param), nothing
    after."""
    method: LinearMethod

    @property
    def multiply_suffixes(self) -> tuple[str, ...]:
        return self.method.suffixes

    def prepare(self, x):
        return x

    def multiply(self, layer, prepared):
        return self.method.apply(layer, prepared)

    def finish(self, layer, raw, prepared):
        return raw


def gemm_parts(method: LinearMethod) -> SplitGemm:
    """`method`'s GEMM in three parts: the method itself when it is a `SplitGemm`, else `WholeGemm(method)`."""
    return method if isinstance(method, SplitGemm) else WholeGemm(method)


class ExpertMethod(abc.ABC):
    """What stacked MoE experts (`Experts`, kind EXPERTS; layers/moe.py) call of their method (vLLM's
    `FusedMoEMethodBase`). Each of the experts' float kernels `name` ("gate_up", "down"; `[S, in, out]`,
    S expert slots) is held as the params `expert_params` derives from its statement; the experts' GEMMs are
    weight-only: `expert_kernel` gives the kernel (or a tile of its output columns) in the dtype the dot runs
    in and `expert_scaled` applies what the method factored out of it (per-output-row scales) to a product.

    `expert_parts` gives the kernel to the GEMMs, by default as the one part `expert_kernel`.
    `expert_tiles(layer, name, experts)`: in how many tiles of output columns the experts' GEMMs build the
    kernel of `experts` experts (1 for a float kernel, which is held as it is): a method whose kernel is a
    conversion (int8, packed blocks) gives it one tile at a time (`Experts._product`), so no dispatch holds
    the local experts in float at once, only ~`TILE_BYTES` of them per expert GEMM."""

    @abc.abstractmethod
    def expert_params(self, weight, name: str, shape: tuple[int, ...], dtype) -> dict[str, WeightParam]:
        """{suffix: WeightParam} for the float statement `weight` (an `ExpertParam`) of a global kernel `shape`
        and `dtype` (the model's)."""

    @abc.abstractmethod
    def expert_kernel(self, layer, name: str, slot: jax.Array | None, dtype,
                      cols: tuple[jax.Array | int, int] | None = None) -> jax.Array:
        """[E?, in, out] in `dtype` (or the dtype the method's dot runs in): the local experts `slot` (None: all)
        of kernel `name`, before `expert_scaled`; `cols` (start, size): only those output columns."""

    @abc.abstractmethod
    def expert_scaled(self, layer, y: jax.Array, name: str, slot: jax.Array | None,
                      cols: tuple[jax.Array | int, int] | None = None) -> jax.Array:
        """y [..., out], a product with `expert_kernel(layer, name, slot, dtype, cols)` (slot given: one row per
        slot; else [E_local, M, out]), times what the method factored out of kernel `name` (y itself when
        nothing)."""

    def expert_tiles(self, layer, name: str, experts: int) -> int:
        """Tiles of output columns for the kernel of `experts` experts (class docstring): one, the kernel as held."""
        return 1

    def expert_parts(self, layer, name: str, slot: jax.Array | None, dtype,
                     cols: tuple[jax.Array | int, int] | None = None) -> tuple[tuple[jax.Array, slice], ...]:
        """The kernel as ((part [E?, in_part, out], the inputs it multiplies: a slice of x's last axis), ...), the
        product the sum of the parts' dots: one part, `expert_kernel` over every input, unless the method's
        stored order makes other parts cheaper to build (MXFP4's two nibbles of a byte: even and odd inputs)."""
        return ((self.expert_kernel(layer, name, slot, dtype, cols), slice(None)),)


def expert_columns(a: jax.Array, cols: tuple[jax.Array | int, int] | None, axis: int) -> jax.Array:
    """Columns [start, start + size) of `a` along `axis` (`cols` None: `a`); start may be traced (a tile's)."""
    return a if cols is None else jax.lax.dynamic_slice_in_dim(a, cols[0], cols[1], axis=axis)


def converted_tiles(layer, name: str, experts: int, dtype) -> int:
    """Tiles of output columns (dividing them) holding ~`TILE_BYTES` of `experts` experts' kernel `name` converted to
    `dtype`, but at least `EXPERT_TILE_COLUMNS` columns each: `expert_tiles` of a method whose kernel is a
    conversion."""
    inp, out = layer.local_kernel_shape(name)                           # [in, out] of one expert on a rank
    columns = max(EXPERT_TILE_COLUMNS, TILE_BYTES // (experts * inp * jnp.dtype(dtype).itemsize))
    want = -(-out // columns)
    return next(n for n in range(want, out + 1) if out % n == 0)


def stacked_kernel(layer, name: str, slot: jax.Array | None, dtype, cols=None) -> jax.Array:
    """The experts' param `name` as held (its experts `slot`, or all; `cols`: those output columns), cast to `dtype`."""
    w = expert_columns(getattr(layer, name)[...], cols, -1)
    return (w if slot is None else w[slot]).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Unquantized(LinearMethod, ExpertMethod):
    """The float weight as the layer declares it: one param, `local_matmul` / `jnp.take` (today's code);
    stacked experts' float kernels as they are."""
    name: ClassVar[str] = "none"
    kinds: ClassVar[tuple[str, ...]] = (LINEAR, EMBEDDING, EXPERTS)
    float_weight: ClassVar[bool] = True

    @property
    def suffixes(self) -> tuple[str, ...]:
        return ("",)

    def params(self, weight, name, shape, dtype):
        return {"": WeightParam(weight, tuple(shape), dtype)}

    def apply(self, layer, x):
        w = layer.weight()
        spec = "md,df->mf" if layer.weight_transposed else "md,fd->mf"    # kernel [in, out] or table [out, in]
        xs = x.reshape(-1, x.shape[-1]).astype(w.dtype)
        y = row_tiled(lambda rows: jnp.einsum(spec, rows, w), xs)          # batch-invariant (invariant.py)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def embed(self, layer, ids):
        return jnp.take(layer.weight(), ids, axis=0)

    def apply_f32(self, layer, x):
        """x @ W accumulated in float32 by the dot itself (an MoE router's logits; batch-invariant: invariant.py)."""
        return row_tiled(lambda rows: jnp.dot(rows, layer.weight(), preferred_element_type=jnp.float32), x)

    def initializer(self, init):
        return init

    def expert_params(self, weight, name, shape, dtype):
        return {"": WeightParam(weight, tuple(shape), dtype)}

    def expert_kernel(self, layer, name, slot, dtype, cols=None):
        return stacked_kernel(layer, name, slot, dtype, cols)

    def expert_scaled(self, layer, y, name, slot, cols=None):
        return y


UNQUANTIZED = Unquantized()


@dataclasses.dataclass(frozen=True)
class Bfloat16(LinearMethod, SplitGemm):
    """The float weight held in bfloat16; each dot rounds x to bf16 and accumulates in float32.

    A bf16 checkpoint's weights are kept exactly (half the bytes of float32); the activations
    lose their low 16 bits at each dot, as in a bf16 model, but the sums and everything
    between the dots (norms, residual, attention, the KV cache) stay in the model's dtype.
    """
    name: ClassVar[str] = "bf16"

    @property
    def suffixes(self) -> tuple[str, ...]:
        return ("",)

    def params(self, weight, name, shape, dtype):
        return {"": WeightParam(weight, tuple(shape), jnp.dtype(jnp.bfloat16))}

    def apply(self, layer, x):
        w = layer.weight()                                      # bf16: kernel [in, out] or table [out, in]
        return fast_dot(x, w, "md,df->mf" if layer.weight_transposed else "md,fd->mf")

    @property
    def multiply_suffixes(self) -> tuple[str, ...]:
        return self.suffixes

    def prepare(self, x):
        """x rounded to bf16 (`fast_dot` would round it in `apply`): once per switched GEMM."""
        return x.astype(jnp.bfloat16)

    def multiply(self, layer, prepared):
        return self.apply(layer, prepared)

    def finish(self, layer, raw, prepared):
        return raw

    def embed(self, layer, ids):
        return jnp.take(layer.weight(), ids, axis=0).astype(layer.param_dtype)


@dataclasses.dataclass(frozen=True)
class Stored16(LinearMethod):
    """A vocab table (embedding, LM head) held in the 16-bit float dtype its checkpoint stores (float16 or
    bfloat16), each tile of rows cast to the run's dtype inside the dot: the numbers of loading it as float,
    in half of float32's bytes (a quantized checkpoint's float tables, layers/quantization.py `PackedConfig`)."""
    dtype: str = "bfloat16"
    name: ClassVar[str] = "stored16"
    kinds: ClassVar[tuple[str, ...]] = (EMBEDDING,)

    @property
    def suffixes(self) -> tuple[str, ...]:
        return ("",)

    @property
    def label(self) -> str:
        return f"{self.dtype} table"

    def params(self, weight, name, shape, dtype):
        return {"": WeightParam(weight, tuple(shape), jnp.dtype(self.dtype))}

    def apply(self, layer, x):
        return tiled_matmul(x, [layer.weight()], lambda w: w.astype(layer.param_dtype), layer.param_dtype)

    def embed(self, layer, ids):
        return jnp.take(layer.weight(), ids, axis=0).astype(layer.param_dtype)


def local_matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x[..., D] @ W[D, F] -> [..., F] in the kernel's dtype."""
    return jnp.einsum("...d,df->...f", x.astype(kernel.dtype), kernel)


def fast_dot(x: jax.Array, w: jax.Array, spec: str, x_dtype=jnp.bfloat16) -> jax.Array:
    """x[..., D] (.) w with `spec` over the flattened rows ("md,df->mf", "md,fd->mf", ...) -> [..., F] float32.

    The operands are x in `x_dtype` and w as it is (bf16, or int8 with int8 x: accumulated
    in int32 and returned as float32, unscaled). One row is padded to two on CPU (see the
    module docstring).
    """
    acc = jnp.int32 if jnp.issubdtype(x_dtype, jnp.integer) else jnp.float32
    xs, m = pad_rows(x.reshape(-1, x.shape[-1]).astype(x_dtype))          # [M', D]
    y = jnp.einsum(spec, xs, w, preferred_element_type=acc)[:m].astype(jnp.float32)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def pad_rows(xs: jax.Array) -> tuple[jax.Array, int]:
    """([M', ...], M): one row becomes two (a zero row) on CPU, where bf16 / int8 dots take a slow path at M = 1."""
    m = xs.shape[0]
    if m == 1 and jax.default_backend() == "cpu":
        xs = jnp.pad(xs, ((0, 1),) + ((0, 0),) * (xs.ndim - 1))
    return xs, m


def map_tiles(tile: Callable[..., jax.Array], arrays: Sequence[jax.Array], n: int) -> jax.Array:
    """`tile(*parts)` -> [M, out / n] over `n` tiles of the output rows of `arrays` (each [out, ...]) -> [M, out].

    With n > 1 a `lax.map`: one tile's temporaries (a dequantized block of the weight) stay
    in cache and their buffer is reused.
    """
    if n == 1:
        return tile(*arrays)
    out = arrays[0].shape[0]
    y = jax.lax.map(lambda parts: tile(*parts), [a.reshape(n, out // n, *a.shape[1:]) for a in arrays])
    return jnp.moveaxis(y, 0, 1).reshape(y.shape[1], out)                 # [n, M, out / n] -> [M, out]


def quantize_rows(x: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 along `axis`: (q int8, s float32 with `axis` kept as 1), x ~ q * s; s = max|x| / 127."""
    s = jnp.max(jnp.abs(x), axis=axis, keepdims=True).astype(jnp.float32) / 127.0
    q = jnp.round(x / jnp.where(s > 0, s, 1.0)).astype(jnp.int8)
    return q, s


TILE_BYTES = 2 * 2**20         # float bytes of one dequantized tile: stays in cache, and its buffer is reused
EXPERT_TILE_COLUMNS = 128      # the fewest output columns of a converted tile of stacked experts: the batched dots of a
                               # narrower tile over many local experts ran slower than converting them whole (the
                               # tile of gpt-oss-20b's 32 experts then 47 MB, of their 3.2 GB in float32)


def tiled_matmul(x: jax.Array, arrays: Sequence[jax.Array], dequantize: Callable[..., jax.Array], dtype,
                 accumulate=None) -> jax.Array:
    """x[..., in] @ W^T -> [..., out], W[out, in] = dequantize(*arrays) rebuilt one tile of output rows at a time.

    Every array is [out, ...] (quantized values, scales). A tile of ~`TILE_BYTES` of float
    is dequantized, multiplied and dropped, so the float weight never exists whole: on CPU
    that is what makes a quantized GEMM as fast as a float one (a whole fresh float copy
    costs more than the product), and a fused kernel would do the same in registers.
    """
    out, inp = arrays[0].shape[0], x.shape[-1]
    n = num_tiles(out, inp * jnp.dtype(dtype).itemsize)
    xs = x.reshape(-1, inp).astype(dtype)                                 # [M, in]
    y = row_tiled(lambda rows: map_tiles(lambda *parts: jnp.einsum("md,fd->mf", rows, dequantize(*parts).astype(
        dtype), preferred_element_type=accumulate), arrays, n), xs)      # batch-invariant (invariant.py)
    return y.reshape(*x.shape[:-1], out)


def num_tiles(rows: int, row_bytes: int) -> int:
    """The fewest tiles of whole rows, dividing `rows` evenly, with at most ~TILE_BYTES each."""
    want = max(1, -(-rows * row_bytes // TILE_BYTES))
    return next(n for n in range(want, rows + 1) if rows % n == 0)


def out_in(weight: ShardedParam, shape: tuple[int, ...]) -> tuple[int, int]:
    """(out, in) of a float param of global `shape` declared by `weight` (kernels are stored [in, out])."""
    return (shape[1], shape[0]) if weight.transpose else (shape[0], shape[1])


def describe_layer(layer) -> str:
    """`ColumnParallelLinear(in=576, out=1536, tp=2)`: a layer as error messages name it."""
    fields = [f"{k}={getattr(layer, a)}" for k, a in (("in", "in_features"), ("out", "out_features"),
                                                       ("vocab", "num_embeddings"), ("dim", "features"),
                                                       ("tp", "tp_size")) if hasattr(layer, a)]
    return f"{type(layer).__name__}({', '.join(fields)})"
