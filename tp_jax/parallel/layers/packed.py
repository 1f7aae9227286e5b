"""PackedWeight: a published quantized checkpoint's weights (GPTQ, AWQ, FP8, compressed-tensors, MXFP4) kept quantized.

The checkpoint tensors are `PackedTensor`s (tp_jax/loaders/packed.py): integer values q (4- or 8-bit,
unsigned) or FP8 values, a scale and a zero point per group of inputs, and each input's group. One rank's
block is rebuilt from them in one layout, whatever the format, [out, ...] like the checkpoint weight:

    <weight>         uint8 [out, in/2] (4-bit: byte j of each run of L inputs holds input j in its low
                     nibble and input j + L/2 in its high one, so the dot splits x, never the weight;
                     act order: inputs 2j and 2j + 1), or FP8's e4m3 bit patterns (uint8 [out, in]),
                     or uint8 [out, in] (8-bit), or MXFP4's FP4 e2m1 codes uint8 [out, in/2] in its stored
                     order (byte j holds inputs 2j (low nibble) and 2j + 1)
    <weight>_scale   [out, in / L] in the checkpoint scales' dtype: one column per run of L inputs of the block
                     (MXFP4: its E8M0 exponent bytes s, uint8: the scale is 2^(s - 127))
    <weight>_zero    uint8, the same shape (not for FP8, nor for a symmetric scheme: its one zero point is
                     the method's `zero`, e.g. 8 for 4-bit, checked against any stored zero points)

    w[o, i] = (q[o, i] - zero[o, i // L]) * scale[o, i // L]        (FP8, FP4: q[o, i] * scale[o, i // L])

L (`local_group`) is the largest run length that divides every rank's input columns into runs of one
group each: the group size when a row-parallel split keeps groups whole, smaller when a tp cuts a group
(each rank then holds the group's scale for its part: exact, no refusal). GPTQ's act order (`desc_act`),
where an input's group is its `g_idx`, keeps every group's scale on every rank and one more param:

    <weight>_group   int32 [1, in]: each input column's group (a padding column: the extra zero group)

with `_scale` / `_zero` [out, G + 1] (column G is zeros), so a row-parallel rank gathers the scales of
its own inputs: act order under row parallelism, exactly. A column split takes output rows of every param.
Padding rows and columns (heads padded for tp) dequantize to exact zeros.

The GEMM, by `dot`, one tile of output rows at a time (`tiled_matmul`, batch-invariant): "float32"
dequantizes each tile in float32 (for ints of 8 bits or fewer and float16 / bfloat16 / float32 scales,
exactly the checkpoint's weights) and multiplies in the run's dtype; "bf16" rounds each dequantized tile
and x to bf16 and accumulates in float32.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

import jax

from tp_jax.parallel.layers.loading import ExpertParam, ShardedParam, check_shape
from tp_jax.parallel.invariant import row_tiled
from tp_jax.parallel.layers.method import (EXPERTS, LINEAR, DerivedParam, ExpertMethod, LinearMethod, QuantizationError,
                                           UnsupportedLayerError, WeightParam, converted_tiles, describe_layer,
                                           expert_columns, map_tiles, num_tiles, out_in, tiled_matmul)
from tp_jax.parallel.mesh import TP

KINDS = ("int4", "int8", "fp8", "fp4")
DOTS = ("float32", "bf16")
NAN_EXPONENT = 255              # E8M0's NaN code
MIN_RUN = 8                     # a shorter run of one group per scale column: the act-order layout instead
FLOAT_CODES = ("fp8", "fp4")    # values that are float codes (signed, no zero points)
NIBBLES = ("int4", "fp4")       # two values a byte


@dataclasses.dataclass(frozen=True)
class PackedWeight(LinearMethod):
    """`quant_type` ("gptq", ...) values of `kind` with per-run scales (`local_group` inputs; 0: act order)."""
    quant_type: str
    kind: str
    local_group: int
    dot: str = "float32"
    groups: int = 0               # act order: the groups every rank's `_scale` holds (and one of zeros)
    file_blocks: ClassVar[bool] = True
    scale_dtype: str = "float32"  # as the checkpoint stores its scales (float16, bfloat16: exact in float32)
    zero: int = -1                # a symmetric scheme's one zero point (no `_zero` param); -1: zeros per group
    name: ClassVar[str] = "packed"
    kinds: ClassVar[tuple[str, ...]] = (LINEAR,)

    def __post_init__(self):
        if self.kind not in KINDS or self.dot not in DOTS:
            raise QuantizationError(f"PackedWeight(kind={self.kind!r}, dot={self.dot!r}): kind one of {list(KINDS)}, "
                                    f"dot one of {list(DOTS)}")

    @property
    def act_order(self) -> bool:
        return self.local_group == 0

    @property
    def suffixes(self) -> tuple[str, ...]:
        zeros = () if self.kind in FLOAT_CODES or self.zero >= 0 else ("_zero",)
        return ("", "_scale") + zeros + (("_group",) if self.act_order else ())

    @property
    def label(self) -> str:
        return f"{self.quant_type} {self.kind}" + ("" if self.dot == "float32" else f" ({self.dot} dot)")

    def check(self, layer, weight: ShardedParam) -> None:
        super().check(layer, weight)
        if self.kind in NIBBLES and weight.split == 1:
            odd = [p for p, s in weight.parts.items() if s.rows.shape[1] % 2]
            if odd:
                raise UnsupportedLayerError(f"{self.describe()} cannot hold {describe_layer(layer)}: a rank's "
                                            f"{weight.parts[odd[0]].rows.shape[1]} input columns are odd; 4-bit "
                                            f"values pack two per byte")

    def params(self, weight, name, shape, dtype):
        out, inp = out_in(weight, shape)
        split = weight.split
        whole = 0 if split == 0 else None                      # dim of params every rank holds in full columns

        def derived(field: str, dim) -> DerivedParam:
            return DerivedParam(weight.parts, split, False, reads=name, dim=dim, param_ndim=2,
                                make=lambda r, t, n: rank_block(self, weight, field, r, t, n))

        values = {"int4": ((out, inp // 2), np.uint8), "int8": ((out, inp), np.uint8),
                  "fp8": ((out, inp), np.uint8),                          # FP8: its e4m3 bit patterns
                  "fp4": ((out, inp // 2), np.uint8)}[self.kind]           # FP4: e2m1 codes, as MXFP4 stores them
        params = {"": WeightParam(derived("", split), values[0], np.dtype(values[1]))}
        if self.act_order:
            scale_shape, scale_dim = (out, self.groups + 1), whole
            params["_group"] = WeightParam(derived("_group", 1 if split == 1 else None), (1, inp), np.dtype(np.int32))
        else:
            scale_shape, scale_dim = (out, inp // self.local_group), split
        params["_scale"] = WeightParam(derived("_scale", scale_dim), scale_shape, jnp.dtype(self.scale_dtype))
        if "_zero" in self.suffixes:
            params["_zero"] = WeightParam(derived("_zero", scale_dim), scale_shape, np.dtype(np.uint8))
        return params

    @property
    def split_nibbles(self) -> bool:
        """4-bit values laid out by runs: byte j of a run of L holds inputs j (low) and j + L/2 (high)."""
        return self.kind == "int4" and not self.act_order

    def dequantize(self, values, scale, zero=None, group=None):
        """float32 [f, in] from a tile's params (`group`: the act-order columns' groups, [in])."""
        if self.split_nibbles:
            v = values.reshape(values.shape[0], -1, self.local_group // 2)
            q = jnp.concatenate([v & 0x0F, v >> 4], axis=-1).reshape(values.shape[0], -1).astype(jnp.float32)
        elif self.kind == "int4":
            q = jnp.stack([values & 0x0F, values >> 4], axis=-1).reshape(values.shape[0], -1).astype(jnp.float32)
        elif self.kind == "fp4":
            q = e2m1_to_float32(jnp.stack([values & 0x0F, values >> 4], axis=-1).reshape(values.shape[0], -1))
        elif self.kind == "fp8":
            q = e4m3_to_float32(values)
        else:
            q = values.astype(jnp.float32)
        scale = e8m0_to_float32(scale) if self.scale_dtype == "uint8" else scale.astype(jnp.float32)
        if zero is None and self.zero >= 0:
            q = q - float(self.zero)
        if group is not None:
            s = jnp.take(scale, group, axis=1)
            return q * s if zero is None else (q - jnp.take(zero, group, axis=1).astype(jnp.float32)) * s
        f, n = q.shape
        qg = q.reshape(f, n // self.local_group, self.local_group)
        w = qg * scale[..., None] if zero is None else (qg - zero[..., None].astype(jnp.float32)) * scale[..., None]
        return w.reshape(f, n)

    def apply(self, layer, x):
        arrays = [layer.weight(s) for s in self.suffixes if s != "_group"]
        group = layer.weight("_group")[0] if self.act_order else None
        dequantize = lambda *parts: self.dequantize(*parts, group=group)                # noqa: E731
        if self.split_nibbles:
            dtype = layer.param_dtype if self.dot == "float32" else jnp.bfloat16
            return self._halves_matmul(x, arrays, dtype)
        if self.dot == "float32":
            return tiled_matmul(x, arrays, dequantize, layer.param_dtype)
        return tiled_matmul(x, arrays, dequantize, jnp.bfloat16, accumulate=jnp.float32)

    def _halves_matmul(self, x, arrays, dtype):
        """x[..., in] @ W^T for split-nibble 4-bit values: x's halves of each run rearranged (a few KB), not the
        weight; one tile of output rows at a time, batch-invariant (`row_tiled`); float32 accumulation."""
        out, inp, h = arrays[0].shape[0], x.shape[-1], self.local_group // 2
        n = num_tiles(out, inp * jnp.dtype(dtype).itemsize)

        def rows(xs):
            runs = xs.reshape(xs.shape[0], -1, 2, h)
            x_lo, x_hi = runs[:, :, 0].reshape(xs.shape[0], -1), runs[:, :, 1].reshape(xs.shape[0], -1)
            return map_tiles(_nibble_tile(self, x_lo, x_hi, dtype), arrays, n)
        y = row_tiled(rows, x.reshape(-1, inp).astype(dtype))
        return y.astype(jnp.float32).reshape(*x.shape[:-1], out)


@dataclasses.dataclass(frozen=True)
class PackedExperts(LinearMethod, ExpertMethod):
    """Stacked MoE experts (`Experts`: gate_up, down) held as `PackedWeight`s, one per param (`methods`: name ->
    its 2-D method), each expert's params stacked `[E_slots, ...]` and split like the float experts (each
    expert's rows or columns over tp; whole experts over dp x tp under EP). The expert GEMMs read their
    kernels through `expert_kernel`, one tile of output rows at a time (`expert_tiles`): the experts a step
    reads, dequantized in float32 (exactly the checkpoint's weights), in the run's dtype or, for the "bf16" dot,
    bfloat16 (x rounded to bf16 too, float32 sums); weight-only, as int8 experts are cast."""
    methods: tuple[tuple[str, PackedWeight], ...]
    file_blocks: ClassVar[bool] = True
    name: ClassVar[str] = "packed"
    kinds: ClassVar[tuple[str, ...]] = (EXPERTS,)

    def method(self, name: str) -> PackedWeight:
        return dict(self.methods)[name]

    @property
    def suffixes(self) -> tuple[str, ...]:
        return self.methods[0][1].suffixes

    @property
    def label(self) -> str:
        return self.methods[0][1].label

    def expert_params(self, weight: ExpertParam, name: str, shape: tuple[int, ...], dtype) -> dict[str, WeightParam]:
        """The stacked params of the float statement `weight` (kernels [S, in, out]): each of the 2-D method's
        params per expert, stacked."""
        one = weight._expert()
        flat = self.method(name).params(one, name, tuple(shape[1:]), None)
        return {suffix: WeightParam(ExpertPackedParam(weight.parts, weight.split, False, reads=name, expert=weight,
                                                      inner=p.decl, method=self.method(name), field=suffix,
                                                      local_shape=_local_shape(p, weight), dtype=p.dtype),
                                    (shape[0], *p.shape), p.dtype) for suffix, p in flat.items()}

    def _arrays(self, layer, name: str, slot, cols) -> dict[str, jax.Array]:
        """Param `name`'s packed arrays (suffix -> [E?, out, ...]) of the experts `slot`, output rows `cols`."""
        arrays = {s: getattr(layer, name + s)[...] for s in self.method(name).suffixes}
        arrays = {s: a if s == "_group" else expert_columns(a, cols, 1) for s, a in arrays.items()}   # [S, out, .]
        return arrays if slot is None else {s: a[slot] for s, a in arrays.items()}

    def expert_parts(self, layer, name, slot, dtype, cols=None):
        """MXFP4 (kind "fp4" in runs, as stored): two parts, the low nibbles' weights for the even inputs and the
        high nibbles' for the odd ones, so the stored bytes are never interleaved (x's inputs are picked instead,
        a few KB; measured 1.5x faster than one interleaved kernel on XLA:CPU); any other kind, one part."""
        method = self.method(name)
        if method.kind != "fp4" or method.act_order:
            return super().expert_parts(layer, name, slot, dtype, cols)
        arrays = self._arrays(layer, name, slot, cols)
        values, scale = arrays[""], arrays["_scale"]                           # [E?, out, in/2], [E?, out, in/L]
        s = e8m0_to_float32(scale)[..., None]
        dot_dtype = self.dot_dtype(name, dtype)

        def half(codes):                         # input 2j (or 2j + 1) is in group 2j // L: j // (L / 2)
            w = (e2m1_to_float32(codes).reshape(*scale.shape, method.local_group // 2) * s).reshape(codes.shape)
            return jnp.swapaxes(w, -1, -2).astype(dot_dtype)                   # [E?, in/2, out]
        return ((half(values & 0x0F), slice(0, None, 2)), (half(values >> 4), slice(1, None, 2)))

    def expert_kernel(self, layer, name: str, slot: jax.Array | None, dtype, cols=None) -> jax.Array:
        """[E?, in, out]: the experts `slot` (None: every local expert) of param `name` (`cols`: those output
        rows of the packed params), dequantized in float32, in `dtype` (the "bf16" dot: bfloat16)."""
        method = self.method(name)
        arrays = self._arrays(layer, name, slot, cols)
        group = arrays.pop("_group", None)
        lead = arrays[""].shape[:-2]
        flat = [a.reshape(-1, *a.shape[-2:]) for a in arrays.values()]
        if group is None:
            w = jax.vmap(method.dequantize)(*flat)
        else:
            w = jax.vmap(lambda *a: method.dequantize(*a[:-1], group=a[-1][0]))(*flat, group.reshape(-1, 1, group.shape[-1]))
        return jnp.swapaxes(w.reshape(*lead, *w.shape[-2:]), -1, -2).astype(self.dot_dtype(name, dtype))

    def expert_scaled(self, layer, y, name, slot, cols=None):
        return y                                   # the scales are inside `expert_kernel`'s dequantized weights

    def expert_tiles(self, layer, name, experts):
        """The packed params dequantized one tile of output rows at a time (~TILE_BYTES of float32 per tile)."""
        return converted_tiles(layer, name, experts, jnp.float32)

    def dot_dtype(self, name: str, dtype):
        """What kernel `name`'s dots run in: bf16 for the "bf16" dot, else the model's `dtype`."""
        return jnp.bfloat16 if self.method(name).dot == "bf16" else dtype


def e2m1_to_float32(c: jax.Array) -> jax.Array:
    """FP4 e2m1 codes (uint8 0..15) -> float32 exactly, by integer ops: bit 3 the sign, magnitude m = c & 7 is
    0, 0.5 (m = 1) or 2^((m >> 1) - 1) * (1 + (m & 1) / 2) (m >= 2: 1, 1.5, 2, 3, 4, 6)."""
    c = c.astype(jnp.uint32)
    m = c & 7
    normal = (((m >> 1) + 126) << 23) | ((m & 1) << 22)
    bits = jnp.where(m >= 2, normal, jnp.where(m == 1, jnp.uint32(126 << 23), jnp.uint32(0)))
    return jax.lax.bitcast_convert_type(((c >> 3) << 31) | bits, jnp.float32)


def e8m0_to_float32(s: jax.Array) -> jax.Array:
    """E8M0 exponents (uint8) -> 2^(s - 127) in float32, exactly for s in 1..254 (the exponent field itself);
    s = 0 gives 0 (2^-127 is subnormal, which XLA:CPU flushes to zero anyway)."""
    return jax.lax.bitcast_convert_type(s.astype(jnp.uint32) << 23, jnp.float32)


def e4m3_to_float32(u: jax.Array) -> jax.Array:
    """float8_e4m3fn bit patterns (uint8) -> their float32 values, exactly, by integer ops: a normal value's
    exponent rebiased (7 -> 127) and mantissa shifted into place, a subnormal m * 2^-9, 0x7f / 0xff NaN.
    (XLA:CPU's own float8 -> float32 conversion measured slower in the decode step: docs/performance.md.)"""
    u = u.astype(jnp.uint32)
    sign, e, m = (u >> 7) << 31, (u >> 3) & 15, u & 7
    normal = jax.lax.bitcast_convert_type(sign | ((e + 120) << 23) | (m << 20), jnp.float32)
    sub = jnp.where(sign > 0, -1.0, 1.0) * m.astype(jnp.float32) * (2.0 ** -9)
    return jnp.where((u & 0x7F) == 0x7F, jnp.nan, jnp.where(e == 0, sub, normal))


def _nibble_tile(method: PackedWeight, x_lo, x_hi, dtype):
    """One tile's [M, f] from split-nibble values: the low nibbles times x's first halves of each run, the high
    ones times its second halves (no interleave), each dequantized in float32 and cast to `dtype`."""
    def tile(values, scale, zero=None):
        f, h = values.shape[0], method.local_group // 2
        v = values.reshape(f, -1, h)
        s = scale.astype(jnp.float32)[..., None]
        z = float(max(method.zero, 0)) if zero is None else zero.astype(jnp.float32)[..., None]
        y = 0.0
        for xp, q in ((x_lo, v & 0x0F), (x_hi, v >> 4)):
            w = ((q.astype(jnp.float32) - z) * s).astype(dtype).reshape(f, -1)
            y = y + jnp.einsum("md,fd->mf", xp, w, preferred_element_type=jnp.float32)
        return y
    return tile


def _local_shape(p: WeightParam, weight: ExpertParam) -> tuple[int, ...]:
    """One rank's block of the 2-D param `p` (one expert): its split dim divided over the statement's ranks."""
    shape, dim = list(p.shape), p.decl.param_dim
    if dim is not None and weight.slots is None:
        ranks = next(iter(weight.parts.values())).rows.shape[0]
        shape[dim] //= ranks
    return tuple(shape)


@dataclasses.dataclass(frozen=True)
class ExpertPackedParam(DerivedParam):
    """`field` of the packed experts the float statement `expert` declares, `[S, ...]`: each expert's rank block
    (`inner`, the 2-D param of one expert) stacked; a rank reads only its experts (EP) or its rows (TP)."""
    expert: ExpertParam | None = None
    inner: DerivedParam | None = None
    method: PackedWeight | None = None
    field: str = ""
    local_shape: tuple[int, ...] = ()
    dtype: object = None                   # the param's dtype (a never-routed slot's zeros)

    @property
    def param_dim(self) -> int | None:
        if self.expert.slots is not None:
            return 0
        return None if self.inner.param_dim is None else self.inner.param_dim + 1

    def spec(self) -> tuple:
        lead = self.expert.spec()[0]
        inner = self.inner.param_dim if self.expert.slots is None else None
        return (lead, *(TP if i == inner else None for i in range(2)))

    def block(self, rank, tensors, names=None):
        e_all, names = self.expert, names or {}
        one = e_all._expert()
        experts = range(len(e_all.parts) // len(e_all.names)) if e_all.slots is None else e_all.slots[rank]
        inner_rank = rank if e_all.slots is None else 0
        out = []
        for e in experts:
            if e < 0:
                out.append(np.zeros(self.local_shape, self.dtype))
                continue
            keys = {n: f"{n}.{e}" for n in e_all.names}
            missing = [k for k in keys.values() if k not in tensors]
            if missing:
                raise KeyError(f"missing weight part(s) {missing}")
            out.append(rank_block(self.method, one, self.field, inner_rank, {n: tensors[k] for n, k in keys.items()},
                                  {n: names.get(k, k) for n, k in keys.items()}))
        return np.stack(out)


def for_experts(quant_type: str, statements: Mapping[str, ExpertParam], tensors: Mapping[str, object],
                dot: str) -> PackedExperts:
    """`PackedExperts` for an `Experts` layer: each param's run length from its own statement; the tensors
    (gate/up, every layer and expert) give the kind and the group size, which down shares (checked at load)."""
    return PackedExperts(tuple((name, for_layer(quant_type, weight, tensors, dot, columns=name == "gate_up"))
                               for name, weight in statements.items()))


def for_layer(quant_type: str, weight: ShardedParam, tensors: Mapping[str, object], dot: str,
              label: str = "", columns: bool = True) -> PackedWeight:
    """The method for a layer whose weight statement is `weight`, filled by the `PackedTensor`s `tensors`
    (every layer and part): the run length L its ranks' columns allow (module docstring). `columns=False`:
    the tensors are another param's (an expert's gate/up for its down): only their kind and group size count."""
    ts = [as_packed(t) for t in tensors.values()]
    kinds = {t.kind for t in ts}
    if len(kinds) > 1:
        raise QuantizationError(f"the tensors of one param mix {sorted(kinds)} values ({label}); a param stacks "
                                f"every layer and fuses q/k/v or gate/up, so it holds one kind")
    kind = kinds.pop()
    dtypes = {np.dtype(t.scale_dtype).name for t in ts}
    scale_dtype = dtypes.pop() if len(dtypes) == 1 else "float32"
    zeros = {t.zero_point for t in ts}
    zero = zeros.pop() if len(zeros) == 1 and None not in zeros else -1
    if any(t.act_order for t in ts):
        counts = {t.num_groups for t in ts} if columns else \
            {-(-p.hf_shape[1] // t.group_size) for p in weight.parts.values() for t in ts}
        if len(counts) > 1:
            raise QuantizationError(f"act-order tensors of one param hold different group counts {sorted(counts)}")
        return PackedWeight(quant_type, kind, 0, dot, counts.pop(), scale_dtype, zero)
    sizes = {t.group_size for t in ts}
    run = math.gcd(*sizes)
    if weight.split == 1:
        for spec in weight.parts.values():
            run = math.gcd(run, _run_length(spec.rows, run))
    elif columns:
        run = math.gcd(run, *(t.shape[1] for t in ts))
    else:
        run = math.gcd(run, *(p.hf_shape[1] for p in weight.parts.values()))
    if run < min(MIN_RUN, *sizes) or (weight.split == 1 and len(sizes) > 1) or (kind in NIBBLES and run % 2):
        return PackedWeight(quant_type, kind, 0, dot, max(t.num_groups for t in ts), scale_dtype, zero)
    return PackedWeight(quant_type, kind, run, dot, 0, scale_dtype, zero)


def _run_length(rows: np.ndarray, group: int) -> int:
    """The largest L dividing `group` and each rank's column count such that every run of L columns of
    every rank is in one group of `group` inputs, or all padding."""
    rows = np.asarray(rows)
    n = rows.shape[1]
    for size in sorted((d for d in range(1, group + 1) if group % d == 0 and n % d == 0), reverse=True):
        runs = rows.reshape(rows.shape[0], -1, size)
        g = np.where(runs >= 0, runs // group, -1)
        if ((g == g[..., :1]).all(-1) & ((runs >= 0).all(-1) | (runs < 0).all(-1))).all():
            return size
    return 1


def as_packed(t, what: str = "this tensor"):
    """The packed weight behind a lazy tensor (a `TensorView`'s `packed()`), or QuantizationError."""
    if getattr(t, "is_packed", False):
        t = t.packed()
    if not hasattr(t, "values"):
        raise QuantizationError(f"tensor {what} is not a quantized weight; the packed methods read its values "
                                f"and scales (load with quantization=None)")
    return t


def _take(a: np.ndarray, idx: np.ndarray, lo: int, axis: int) -> np.ndarray:
    """`a` (read from index `lo` on) at `idx` along `axis`, zeros where idx < 0."""
    out = np.take(a, np.where(idx >= 0, idx - lo, 0), axis=axis)
    pad = (idx < 0).reshape([-1 if d == axis else 1 for d in range(a.ndim)])
    return np.where(pad, np.zeros((), a.dtype), out)


def rank_block(method: PackedWeight, weight: ShardedParam, field: str, rank: int, tensors, names) -> np.ndarray:
    """Rank `rank`'s block of `field` ("", "_scale", "_zero", "_group"), each part read for its slice only."""
    blocks = []
    for part, spec in weight.parts.items():
        name = names.get(part, part)
        check_shape(name, tuple(tensors[part].shape), spec.hf_shape)
        t = as_packed(tensors[part], f"{name!r} of a {method.quant_type} checkpoint")
        out, inp = t.shape
        o = spec.rows[rank] if weight.split == 0 else np.arange(out)
        i = spec.rows[rank] if weight.split == 1 else np.arange(inp)
        blocks.append(_field(method, t, field, np.asarray(o), np.asarray(i)))
    if field == "_group":                              # one input order for the fused parts (q/k/v, gate/up)
        if any(not np.array_equal(b, blocks[0]) for b in blocks[1:]):
            raise QuantizationError(f"the fused parts {list(weight.parts)} ({', '.join(names.values())}) order their "
                                    f"inputs differently (g_idx); load with quantization=None")
        return blocks[0]
    return blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=1 if weight.split == 1 else 0)


def _bounds(idx: np.ndarray) -> slice:
    valid = idx[idx >= 0]
    return slice(int(valid.min()), int(valid.max()) + 1) if valid.size else slice(0, 1)


def _field(method: PackedWeight, t, field: str, o: np.ndarray, i: np.ndarray) -> np.ndarray:
    o_sl, i_sl = _bounds(o), _bounds(i)
    cols = _take(t.groups(i_sl), i, i_sl.start, 0)                    # each column's group, -1: padding
    if field == "":
        if method.zero >= 0:
            stored = t.zeros(o_sl)
            if stored is not None and (stored != method.zero).any():
                raise QuantizationError(f"{t!r} is symmetric (one zero point, {method.zero}) by its config, but its "
                                        f"stored zero points hold {sorted(set(np.unique(stored)) - {method.zero})[:4]}; "
                                        f"correct quantization_config.sym, or load with quantization=None")
        q = _take(_take(t.values(o_sl, i_sl), o, o_sl.start, 0), i, i_sl.start, 1)
        if method.kind == "fp8":
            return np.ascontiguousarray(q).view(np.uint8)
        if method.kind == "fp4":                 # the stored order: inputs 2j (low nibble) and 2j + 1 of byte j
            return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
        if method.split_nibbles:                 # byte j of a run of L: inputs j (low) and j + L/2 (high)
            runs = q.reshape(q.shape[0], -1, 2, method.local_group // 2)
            q = (runs[:, :, 0] | (runs[:, :, 1] << 4)).astype(np.uint8).reshape(q.shape[0], -1)
        elif method.kind == "int4":
            q = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
        return q
    if field == "_group":
        return np.where(cols >= 0, cols, t.num_groups).astype(np.int32)[None, :]
    valid = cols[cols >= 0]                       # the groups this rank's columns read: only those are read
    g_sl = slice(None) if method.act_order or not valid.size else slice(int(valid.min()), int(valid.max()) + 1)
    per_group = t.scales(o_sl, g_sl).astype(method.scale_dtype) if field == "_scale" else t.zeros(o_sl, g_sl)
    per_group = _take(per_group, o, o_sl.start, 0)
    if field == "_scale" and method.kind == "fp4" and (per_group == NAN_EXPONENT).any():
        raise QuantizationError(f"{t!r} holds E8M0 scale {NAN_EXPONENT}, the format's NaN code, which no quantizer "
                                f"writes; check the checkpoint, or load with quantization=None (dequantized as "
                                f"transformers reads it)")
    if method.act_order:
        return np.concatenate([per_group, np.zeros((len(o), 1), per_group.dtype)], axis=1)
    runs = cols.reshape(-1, method.local_group) - (g_sl.start or 0)
    if (runs != runs[:, :1]).any():
        raise QuantizationError(f"{t!r}: its groups of {t.group_size} inputs do not fall in whole runs of "
                                f"{method.local_group} columns on this rank (a param with another group size than "
                                f"its layer's other params); load with quantization=None")
    return _take(per_group, np.where(cols.reshape(runs.shape)[:, 0] >= 0, runs[:, 0], -1), 0, 1)
