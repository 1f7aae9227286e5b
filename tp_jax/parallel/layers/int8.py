"""Int8: weight-only int8, symmetric, one scale per output channel, quantized per device slice at load.

W[out, in] ≈ Q * s[:, None] with s[o] = max_i |W[o, i]| / 127 and Q = round(W / s) in
[-127, 127]. The params, derived from the layer's one statement of its split:

    <weight>        int8 [out, in] like the checkpoint (a kernel's rows are its output channels)
    <weight>_scale  float32 [out]: split with the output rows on a column layer and a vocab
                    table; whole on a row layer (every rank holds every output channel)

A scale is the max over the *whole* row, whatever the split, so every tp gives the same Q
and s (a row layer's rank reads its rows whole, one chunk at a time, and keeps its
columns). Loading reads a rank's rows in chunks of about `CHUNK_BYTES` of float32, so no
float copy of a whole tensor exists at any time. The GEMM: y = (x Q^T) * s, the scale
applied to the output (exact for per-output-channel scales), Q converted one tile of rows
at a time (`tiled_matmul`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from tp_jax.parallel.layers.loading import LazyTensor, ShardedParam, check_shape, take_rows
from tp_jax.parallel.layers.method import DerivedParam, LinearMethod, WeightParam, out_in, tiled_matmul

QMAX = 127
CHUNK_BYTES = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class Int8(LinearMethod):
    """Weight-only int8 with per-output-channel float32 scales (see the module docstring)."""
    name: ClassVar[str] = "int8"

    @property
    def suffixes(self) -> tuple[str, ...]:
        return ("", "_scale")

    def params(self, weight, name, shape, dtype):
        out, inp = out_in(weight, shape)
        values = DerivedParam(weight.parts, weight.split, False, reads=name, dim=weight.split, param_ndim=2,
                              make=lambda r, t, n: quantize_block(weight, r, t, n)[0])
        scale = DerivedParam(weight.parts, weight.split, False, reads=name,
                             dim=0 if weight.split == 0 else None, param_ndim=1,
                             make=lambda r, t, n: quantize_block(weight, r, t, n, values=False)[1])
        return {"": WeightParam(values, (out, inp), np.dtype(np.int8)),
                "_scale": WeightParam(scale, (out,), np.dtype(np.float32))}

    def apply(self, layer, x):
        dt = layer.param_dtype
        return tiled_matmul(x, [layer.weight()], lambda q: q, dt) * layer.weight("_scale").astype(dt)

    def embed(self, layer, ids):
        dt = layer.param_dtype
        rows = jnp.take(layer.weight(), ids, axis=0).astype(dt)          # [..., D]
        return rows * jnp.take(layer.weight("_scale"), ids, axis=0)[..., None].astype(dt)


def quantize_block(weight: ShardedParam, rank: int, tensors: Mapping[str, LazyTensor], names: Mapping[str, str],
                   values: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
    """Rank `rank`'s (Q [out_local, in_local], s [out_local]) for the weight `weight` declares.

    Each part's output rows of this rank are read whole (every input column), in chunks:
    the scale sees the full row, then the rank's input columns (a row split) are kept.
    `values=False` computes the scales only.
    """
    qs, ss = [], []
    for part, spec in weight.parts.items():
        t = tensors[part]
        check_shape(names.get(part, part), tuple(t.shape), spec.hf_shape)
        out_rows = spec.rows[rank] if weight.split == 0 else np.arange(spec.hf_shape[0])
        cols = spec.rows[rank] if weight.split == 1 else None
        per_chunk = max(1, CHUNK_BYTES // (4 * spec.hf_shape[1]))
        for start in range(0, len(out_rows), per_chunk):
            q, s = _quantize_rows(t, out_rows[start:start + per_chunk], cols, values)
            qs.append(q)
            ss.append(s)
    scale = np.concatenate(ss)
    if not values:
        return None, scale
    return np.concatenate(qs, axis=0), scale


def _quantize_rows(t: LazyTensor, rows: np.ndarray, cols: np.ndarray | None, values: bool):
    slab = np.asarray(take_rows(t, rows, 0), np.float32)  # [c, in]: whole rows (zeros for padding rows)
    with np.errstate(invalid="ignore"):
        scale = np.abs(slab).max(axis=1) / np.float32(QMAX)   # NaN stays NaN: the loader's finite check names it
    if not values:
        return None, scale
    if cols is not None:
        slab = take_rows(slab, cols, 1)
    ok = (scale > 0) & np.isfinite(scale)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(ok[:, None], np.rint(slab / np.where(ok, scale, 1)[:, None]), 0)
    return np.clip(q, -QMAX, QMAX).astype(np.int8), scale
