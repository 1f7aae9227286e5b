"""GGUFBlocks: llama.cpp's Q8_0 / Q4_0 / Q4_1 weights kept as their blocks, multiplied block by block inside the GEMM.

A GGUF row of W[out, in] is in/32 blocks of 32 weights; each block holds an f16 scale d
(Q4_1: and an f16 min m) and 32 quantized values q:

    Q8_0  34 bytes: d, q int8[32]                     w = q d
    Q4_0  18 bytes: d, 16 bytes of nibbles             w = (q - 8) d
    Q4_1  20 bytes: d, m, 16 bytes of nibbles          w = q d + m
    (byte j of the nibbles: q_j in its low 4 bits, q_{j+16} in its high 4 bits)

The method splits the blocks into params, each [out, ...] like the checkpoint weight and
derived from the layer's one statement of its split:

    <weight>        the values: int8 [out, in] (Q8_0) or packed uint8 [out, in/2] (Q4_*)
    <weight>_scale  float16 [out, in/32]
    <weight>_min    float16 [out, in/32] (Q4_1)

A column split (and a vocab table) takes whole rows of all three; a row split takes whole
blocks of every row, so a rank's input columns must be runs of 32 (checked before
loading, naming the layer). Sizes come from the `gguf` package (`GGML_QUANT_SIZES`), its
numpy `dequantize` is the reference in the tests. The checkpoint tensors must offer their
raw blocks: `quant_type` and `blocks()` (a lazy `[rows, in/32, bytes per block]` uint8
view), as the GGUF loader's tensors do; `QuantizedArray` wraps raw bytes held in memory.

The GEMM, by `dot` (one tile of output rows at a time, `map_tiles`):

* "float32": each tile dequantized to float32, bit for bit the `gguf` package's weights,
  and multiplied in float32 (the exact reference path);
* "bf16": each tile dequantized to bf16 (Q4: the exact 4-bit value times its f16 scale,
  rounded once to bf16), x rounded to bf16, accumulated in float32.

The 4-bit dots never interleave the nibbles: byte j of a block holds elements j and j + 16,
so the low nibbles multiply x's first 16 elements of each block and the high ones its last
16 (x is rearranged, a few KB, instead of the weight).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import gguf
import jax
import jax.numpy as jnp
import numpy as np

from tp_jax.parallel.layers.loading import LazyTensor, PartRows, ShardedParam
from tp_jax.parallel.layers.method import (DerivedParam, LinearMethod, QuantizationError, UnsupportedLayerError,
                                           WeightParam, describe_layer, map_tiles, num_tiles, out_in, pad_rows,
                                           tiled_matmul)

BLOCK = 32


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """Byte layout of one block: f16 fields (suffix -> byte offset) and the values after them."""
    fields: tuple[tuple[str, int], ...]
    values_at: int
    values_dtype: type
    nibbles: bool                    # two 4-bit values per byte

    @property
    def values_per_block(self) -> int:
        return BLOCK // 2 if self.nibbles else BLOCK


FORMATS = {
    "Q8_0": BlockFormat((("_scale", 0),), 2, np.int8, nibbles=False),
    "Q4_0": BlockFormat((("_scale", 0),), 2, np.uint8, nibbles=True),
    "Q4_1": BlockFormat((("_scale", 0), ("_min", 2)), 4, np.uint8, nibbles=True),
}
for _name, _fmt in FORMATS.items():           # the gguf package is the authority on sizes
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[_name]] == (
        BLOCK, _fmt.values_at + _fmt.values_per_block), _name
KEPT = tuple(FORMATS)
DOTS = ("float32", "bf16")


def type_size(qtype: str) -> int:
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1]


@dataclasses.dataclass(frozen=True)
class GGUFBlocks(LinearMethod):
    """GGUF blocks of `qtype` ("Q8_0", "Q4_0", "Q4_1") kept as they are on disk, multiplied by `dot` ("float32"
    or "bf16"; module docstring)."""
    qtype: str
    dot: str = "float32"
    name: ClassVar[str] = "gguf"
    file_blocks: ClassVar[bool] = True

    def __post_init__(self):
        if self.qtype not in FORMATS:
            raise QuantizationError(f"GGUF quant type {self.qtype!r} is not kept quantized; kept: {list(KEPT)}")
        if self.dot not in DOTS:
            raise QuantizationError(f"GGUFBlocks(dot={self.dot!r}): choose one of {list(DOTS)}")

    @property
    def format(self) -> BlockFormat:
        return FORMATS[self.qtype]

    @property
    def suffixes(self) -> tuple[str, ...]:
        return ("", *(s for s, _ in self.format.fields))

    @property
    def label(self) -> str:
        return f"gguf {self.qtype}" + ("" if self.dot == "float32" else f" ({self.dot} dot)")

    def check(self, layer, weight: ShardedParam) -> None:
        super().check(layer, weight)
        for part, spec in weight.parts.items():
            if spec.hf_shape[-1] % BLOCK:
                raise UnsupportedLayerError(
                    f"{self.describe()} cannot hold {describe_layer(layer)}: weight part {part!r} has "
                    f"{spec.hf_shape[-1]} input columns, not whole {BLOCK}-element blocks")
            if weight.split == 1 and block_rows(spec.rows) is None:
                raise UnsupportedLayerError(
                    f"{self.describe()} cannot hold {describe_layer(layer)}: its input columns split over "
                    f"tp={layer.tp_size} into {spec.rows.shape[1]} per rank, not runs of whole {BLOCK}-element "
                    f"blocks; choose a tp whose share of the input is a multiple of {BLOCK}, or load with "
                    f"quantization=None (dequantized float)")

    def params(self, weight, name, shape, dtype):
        out, inp = out_in(weight, shape)
        dim = weight.split                 # the param is [out, ...] like the checkpoint: the split dim as is
        raw = raw_statement(weight, self.qtype)

        def derived(field: str) -> DerivedParam:
            return DerivedParam(weight.parts, weight.split, False, reads=name, dim=dim, param_ndim=2,
                                make=lambda r, t, n: split_fields(raw.block(r, blocks_of(t, self.qtype, n), n),
                                                                  self.format)[field])

        fmt, nb = self.format, inp // BLOCK
        out_params = {"": WeightParam(derived(""), (out, nb * fmt.values_per_block), np.dtype(fmt.values_dtype))}
        for suffix, _ in fmt.fields:
            out_params[suffix] = WeightParam(derived(suffix), (out, nb), np.dtype(np.float16))
        return out_params

    def dequantize(self, values, scale, minimum=None):
        """float32 [..., in] from a block's params (leading dims free: a local table or looked-up rows)."""
        return blocks_to_float(jnp, self.qtype, values, scale, minimum)

    def _arrays(self, layer):
        return [layer.weight(s) for s in self.suffixes]

    def apply(self, layer, x):
        if self.dot == "float32":
            return tiled_matmul(x, self._arrays(layer), self.dequantize, layer.param_dtype)
        arrays = self._arrays(layer)
        out, inp = arrays[0].shape[0], x.shape[-1]
        xs, m = pad_rows(x.reshape(-1, inp).astype(jnp.float32))           # [M', in]
        y = bf16_block_dot(self.qtype, xs, arrays, num_tiles(out, inp * 2))[:m]
        return y.reshape(*x.shape[:-1], out)

    def embed(self, layer, ids):
        rows = [jnp.take(a, ids, axis=0) for a in self._arrays(layer)]
        return self.dequantize(*rows).astype(layer.param_dtype)


def halves(qtype: str, values: jax.Array, nb: int) -> list[jax.Array]:
    """A tile's values [f, nb * bytes] -> the weight's integer values q, [f, nb, k] each (int8), matching
    `split_x`: Q8_0 one [f, nb, 32]; Q4_* the low and the high nibbles, [f, nb, 16] each (Q4_0: q - 8)."""
    v = values.reshape(values.shape[0], nb, -1)
    if not FORMATS[qtype].nibbles:
        return [v]
    parts = [(v & 0x0F).astype(jnp.int8), (v >> 4).astype(jnp.int8)]
    return [p - 8 for p in parts] if qtype == "Q4_0" else parts


def split_x(qtype: str, xb: jax.Array) -> list[jax.Array]:
    """x's blocks [M, nb, 32] -> the pieces each of `halves` multiplies: [M, nb, 32], or its two halves of 16."""
    return [xb[..., :BLOCK // 2], xb[..., BLOCK // 2:]] if FORMATS[qtype].nibbles else [xb]


def bf16_block_dot(qtype: str, xs: jax.Array, arrays, n: int) -> jax.Array:
    """[M, in] x the blocks -> [M, out] float32: each tile's weight w = q d (+ m) rounded to bf16, bf16 dots."""
    m, inp = xs.shape
    nb = inp // BLOCK
    xparts = [p.astype(jnp.bfloat16).reshape(m, -1) for p in split_x(qtype, xs.reshape(m, nb, BLOCK))]

    def tile(values, scale, minimum=None):                                # -> [M, f]
        d = scale[..., None].astype(jnp.float32)
        y = 0.0
        for xp, q in zip(xparts, halves(qtype, values, nb)):
            w = q.astype(jnp.float32) * d + (0.0 if minimum is None else minimum[..., None].astype(jnp.float32))
            y = y + jnp.einsum("md,fd->mf", xp, w.astype(jnp.bfloat16).reshape(w.shape[0], -1),
                               preferred_element_type=jnp.float32)
        return y

    return map_tiles(tile, arrays, n)


def blocks_to_float(xp, qtype: str, values, scale, minimum=None):
    """float32 [..., nb * 32] from the fields of blocks of `qtype`, in numpy or jax.numpy (`xp`).

    The same operations in the same order as the `gguf` package's dequantizer, so the
    results are bit for bit its own.
    """
    fmt = FORMATS[qtype]
    v = values.reshape(*scale.shape, fmt.values_per_block)                  # [..., nb, bytes]
    if fmt.nibbles:
        q = xp.concatenate([v & 0x0F, v >> 4], axis=-1).astype(xp.float32)  # [..., nb, 32]
        q = q - 8 if qtype == "Q4_0" else q
    else:
        q = v.astype(xp.float32)
    w = q * scale[..., None].astype(xp.float32)
    if minimum is not None:
        w = w + minimum[..., None].astype(xp.float32)
    return w.reshape(*scale.shape[:-1], scale.shape[-1] * BLOCK)


def dequantize_raw(raw: np.ndarray, qtype: str) -> np.ndarray:
    """numpy, vectorized over every row at once: [rows, nb * bytes] uint8 blocks of a kept type -> float32
    [rows, nb * 32] (the loader's float path; `gguf.quants.dequantize` loops over small groups of rows)."""
    raw, size = np.asarray(raw), type_size(qtype)
    fields = split_fields(raw.reshape(raw.shape[0], raw.shape[1] // size, size), FORMATS[qtype])
    return blocks_to_float(np, qtype, *(fields[s] for s in ("", *(f for f, _ in FORMATS[qtype].fields))))


def block_rows(rows: np.ndarray) -> np.ndarray | None:
    """[tp, n] input-column maps -> [tp, n/32] block maps (-1: a padding block), None if not whole blocks."""
    rows = np.asarray(rows)
    if rows.shape[1] % BLOCK:
        return None
    runs = rows.reshape(rows.shape[0], -1, BLOCK)
    first = runs[..., :1]
    pad = (runs < 0).all(-1)
    whole = (first % BLOCK == 0) & (runs == first + np.arange(BLOCK)).all(-1, keepdims=True)
    if not (pad | whole[..., 0]).all():
        return None
    return np.where(pad, -1, first[..., 0] // BLOCK)


def raw_statement(weight: ShardedParam, qtype: str) -> ShardedParam:
    """The weight's statement over its raw blocks `[out, in/32, bytes]`: rows as is, columns as blocks."""
    size = type_size(qtype)
    parts = {}
    for part, spec in weight.parts.items():
        rows = block_rows(spec.rows) if weight.split == 1 else spec.rows
        parts[part] = PartRows((spec.hf_shape[0], spec.hf_shape[1] // BLOCK, size), rows)
    return ShardedParam(parts, weight.split, transpose=False)


def blocks_of(tensors: Mapping[str, LazyTensor], qtype: str, names: Mapping[str, str]) -> dict[str, LazyTensor]:
    """Each part's raw-block view, or QuantizationError naming a tensor that is not `qtype` blocks."""
    out = {}
    for part, t in tensors.items():
        got = getattr(t, "quant_type", None)
        if got != qtype or not hasattr(t, "blocks"):
            raise QuantizationError(f"tensor {names.get(part, part)!r} is {got or type(t).__name__}, not {qtype} "
                                    f"blocks; GGUFBlocks({qtype!r}) reads the raw blocks of {qtype} tensors")
        out[part] = t.blocks()
    return out


def split_fields(raw: np.ndarray, fmt: BlockFormat) -> dict[str, np.ndarray]:
    """[rows, nb, bytes] uint8 blocks -> {"": values [rows, nb*per_block], "_scale"/"_min": f16 [rows, nb]}."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    rows, nb = raw.shape[:2]
    out = {"": raw[..., fmt.values_at:].copy().view(fmt.values_dtype).reshape(rows, nb * fmt.values_per_block)}
    for suffix, at in fmt.fields:
        out[suffix] = raw[..., at:at + 2].copy().view(np.float16).reshape(rows, nb)
    return out


class QuantizedArray:
    """GGUF-quantized rows held in memory as a lazy tensor: `raw` [out, in/32 * bytes] uint8 of `qtype`.

    `shape` is the float weight's `[out, in]`; `t[index]` dequantizes (numpy, the `gguf`
    package), `blocks()` is the raw `[out, in/32, bytes]` view `GGUFBlocks` reads.
    """

    def __init__(self, raw: np.ndarray, qtype: str):
        size = type_size(qtype)
        self.raw, self.quant_type = np.asarray(raw, np.uint8), qtype
        self.shape = (self.raw.shape[0], self.raw.shape[1] // size * BLOCK)

    @classmethod
    def quantize(cls, w: np.ndarray, qtype: str) -> QuantizedArray:
        return cls(gguf.quants.quantize(np.asarray(w, np.float32), gguf.GGMLQuantizationType[qtype]), qtype)

    def blocks(self) -> np.ndarray:
        return self.raw.reshape(self.shape[0], self.shape[1] // BLOCK, -1)

    def __getitem__(self, index) -> np.ndarray:
        return gguf.quants.dequantize(self.raw, gguf.GGMLQuantizationType[self.quant_type])[index]
