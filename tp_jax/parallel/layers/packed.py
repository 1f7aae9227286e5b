"""PackedWeight: a published quantized checkpoint's weights (GPTQ, AWQ, FP8, compressed-tensors) kept quantized.

The checkpoint tensors are `PackedTensor`s (tp_jax/loaders/packed.py): integer values q (4- or 8-bit,
unsigned) or FP8 values, a scale and a zero point per group of inputs, and each input's group. One rank's
block is rebuilt from them in one layout, whatever the format, [out, ...] like the checkpoint weight:

    <weight>         uint8 [out, in/2] (4-bit: input 2j in the low nibble, 2j + 1 in the high one),
                     uint8 [out, in] (8-bit) or float8_e4m3fn [out, in] (FP8)
    <weight>_scale   float32 [out, in / L]: one column per run of L inputs of the rank's block
    <weight>_zero    uint8, the same shape (not for FP8)

    w[o, i] = (q[o, i] - zero[o, i // L]) * scale[o, i // L]        (FP8: q[o, i] * scale[o, i // L])

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

from tp_jax.parallel.layers.loading import ShardedParam, check_shape
from tp_jax.parallel.layers.method import (LINEAR, DerivedParam, LinearMethod, QuantizationError,
                                           UnsupportedLayerError, WeightParam, describe_layer, out_in, tiled_matmul)

KINDS = ("int4", "int8", "fp8")
DOTS = ("float32", "bf16")
MIN_RUN = 8                     # a shorter run of one group per scale column: the act-order layout instead


@dataclasses.dataclass(frozen=True)
class PackedWeight(LinearMethod):
    """`quant_type` ("gptq", ...) values of `kind` with per-run scales (`local_group` inputs; 0: act order)."""
    quant_type: str
    kind: str
    local_group: int
    dot: str = "float32"
    groups: int = 0               # act order: the groups every rank's `_scale` holds (and one of zeros)
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
        return ("", "_scale") + (() if self.kind == "fp8" else ("_zero",)) + (("_group",) if self.act_order else ())

    @property
    def label(self) -> str:
        return f"{self.quant_type} {self.kind}" + ("" if self.dot == "float32" else f" ({self.dot} dot)")

    def check(self, layer, weight: ShardedParam) -> None:
        super().check(layer, weight)
        if self.kind == "int4" and weight.split == 1:
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
                  "fp8": ((out, inp), jnp.float8_e4m3fn)}[self.kind]
        params = {"": WeightParam(derived("", split), values[0], np.dtype(values[1]))}
        if self.act_order:
            scale_shape, scale_dim = (out, self.groups + 1), whole
            params["_group"] = WeightParam(derived("_group", 1 if split == 1 else None), (1, inp), np.dtype(np.int32))
        else:
            scale_shape, scale_dim = (out, inp // self.local_group), split
        params["_scale"] = WeightParam(derived("_scale", scale_dim), scale_shape, np.dtype(np.float32))
        if self.kind != "fp8":
            params["_zero"] = WeightParam(derived("_zero", scale_dim), scale_shape, np.dtype(np.uint8))
        return params

    def dequantize(self, values, scale, zero=None, group=None):
        """float32 [f, in] from a tile's params (`group`: the act-order columns' groups, [in])."""
        if self.kind == "int4":
            q = jnp.stack([values & 0x0F, values >> 4], axis=-1).reshape(values.shape[0], -1).astype(jnp.float32)
        else:
            q = values.astype(jnp.float32)
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
        if self.dot == "float32":
            return tiled_matmul(x, arrays, dequantize, layer.param_dtype)
        return tiled_matmul(x, arrays, dequantize, jnp.bfloat16, accumulate=jnp.float32)


def for_layer(quant_type: str, weight: ShardedParam, tensors: Mapping[str, object], dot: str,
              label: str = "") -> PackedWeight:
    """The method for a layer whose weight statement is `weight`, filled by the `PackedTensor`s `tensors`
    (every layer and part): the run length L its ranks' columns allow (module docstring)."""
    ts = [as_packed(t) for t in tensors.values()]
    kinds = {t.kind for t in ts}
    if len(kinds) > 1:
        raise QuantizationError(f"the tensors of one param mix {sorted(kinds)} values ({label}); a param stacks "
                                f"every layer and fuses q/k/v or gate/up, so it holds one kind")
    kind = kinds.pop()
    if any(t.act_order for t in ts):
        counts = {t.num_groups for t in ts}
        if len(counts) > 1:
            raise QuantizationError(f"act-order tensors of one param hold different group counts {sorted(counts)}")
        return PackedWeight(quant_type, kind, 0, dot, counts.pop())
    sizes = {t.group_size for t in ts}
    run = math.gcd(*sizes)
    if weight.split == 1:
        for spec in weight.parts.values():
            run = math.gcd(run, _run_length(spec.rows, run))
    else:
        run = math.gcd(run, *(t.shape[1] for t in ts))
    if run < min(MIN_RUN, *sizes) or (weight.split == 1 and len(sizes) > 1):
        return PackedWeight(quant_type, kind, 0, dot, max(t.num_groups for t in ts))
    return PackedWeight(quant_type, kind, run, dot)


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
    if hasattr(t, "packed") and hasattr(getattr(t, "tensor", None), "values"):
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
        q = _take(_take(t.values(o_sl, i_sl), o, o_sl.start, 0), i, i_sl.start, 1)
        if method.kind == "int4":
            q = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
        return q
    if field == "_group":
        return np.where(cols >= 0, cols, t.num_groups).astype(np.int32)[None, :]
    per_group = t.scales(o_sl) if field == "_scale" else t.zeros(o_sl)
    per_group = _take(per_group, o, o_sl.start, 0)
    if method.act_order:
        return np.concatenate([per_group, np.zeros((len(o), 1), per_group.dtype)], axis=1)
    runs = cols.reshape(-1, method.local_group)[:, 0]
    return _take(per_group, runs, 0, 1)
