"""Int8: weight-only int8, symmetric, one scale per output channel, quantized per device slice at load.

W[out, in] ≈ Q * s[:, None] with s[o] = max_i |W[o, i]| / 127 and Q = round(W / s) in
[-127, 127]. The params, derived from the layer's one statement of its split:

    <weight>        int8 [out, in] like the checkpoint (a kernel's rows are its output channels)
    <weight>_scale  float32 [out]: split with the output rows on a column layer and a vocab
                    table; whole on a row layer (every rank holds every output channel)

Stacked experts (`Experts`, kind EXPERTS; `expert_params`) are quantized the same way, per expert
and per output row: `gate_up` int8 `[E_slots, D, 2F]` with `gate_up_scale` float32 `[E_slots, 2F]`,
`down` int8 `[E_slots, F, D]` with `down_scale` `[E_slots, D]` (the float params' kernel layout
and split: over tp on the output rows / the input in the TP layout, whole experts over dp x tp
under EP); the experts' dots are weight-only (int8 cast to the model's dtype, output scaled).

A scale is the max over the *whole* row, whatever the split, so every tp gives the same Q
and s (a row layer's rank reads its rows whole, one chunk at a time, and keeps its
columns). Loading reads a rank's rows in chunks of about `CHUNK_BYTES` of float32, so no
float copy of a whole tensor exists at any time. Two GEMMs, by `activations`:

* "float" (weight-only, W8A16): y = (x Q^T) * s in the layer's dtype, the scale applied to
  the output (exact for per-output-channel scales), Q converted one tile of rows at a time
  (`tiled_matmul`);
* "int8" (vLLM's W8A8, dynamic per token): each row of x is quantized on the fly,
  x ~ q_x * s_x (s_x = max|x_row| / 127), and y = (q_x Q^T)_int32 * s_x * s, an
  int8 x int8 -> int32 dot (`weight_first_dot`). A row layer's rank quantizes its own slice of x
  (no extra collective, as vLLM), so its results differ across tp by that rounding;
* "int8x2" (activations as two int8 digits, ~15 bits): x / s_x = q_1 + q_2 / 254 with q_1 as
  above and q_2 the rounded remainder, and y = ((q_1 Q^T) + (q_2 Q^T) / 254) * s_x * s from
  ONE int8 x int8 -> int32 dot of the 2M stacked rows: the weights are read once, and at
  decode sizes a dot of 2M rows costs about what M rows cost (on CPU one row is padded to
  two anyway). One scale per token at 8 bits lets an outlier input coarsen the row; the second
  digit brings the activation error near bf16's (the perplexities: docs/quantization.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from tp_jax.parallel.layers.loading import ExpertParam, LazyTensor, ShardedParam, check_shape, take_rows
from tp_jax.parallel.layers.method import (EMBEDDING, EXPERTS, LINEAR, DerivedParam, ExpertMethod, LinearMethod,
                                           QuantizationError, SplitGemm, WeightParam, out_in, pad_rows,
                                           converted_tiles, expert_columns, quantize_rows, stacked_kernel,
                                           tiled_matmul)
from tp_jax.parallel.mesh import TP

QMAX = 127
SECOND_DIGIT = 2 * QMAX         # the remainder of x / s_x (in [-1/2, 1/2]) in units of 1/254: q_2 in [-127, 127]
ACTIVATIONS = {"float": "int8", "int8": "w8a8", "int8x2": "w8a8x2"}   # Int8.activations -> its label
CHUNK_BYTES = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class Int8(LinearMethod, SplitGemm, ExpertMethod):
    """int8 weights with per-output-channel float32 scales; `activations` "float" (weight-only) or "int8"
    (W8A8: per-token int8 activations, int32 accumulation). See the module docstring."""
    activations: str = "float"
    name: ClassVar[str] = "int8"
    kinds: ClassVar[tuple[str, ...]] = (LINEAR, EMBEDDING, EXPERTS)

    def __post_init__(self):
        if self.activations not in ACTIVATIONS:
            raise QuantizationError(f"Int8(activations={self.activations!r}): choose 'float' (weight-only), "
                                    f"'int8' (W8A8, per-token int8 activations) or 'int8x2' (two int8 digits)")

    @property
    def label(self) -> str:
        return self.name if self.activations == "float" else ACTIVATIONS[self.activations]   # a subclass's own name

    @property
    def suffixes(self) -> tuple[str, ...]:
        return ("", "_scale")

    def params(self, weight, name, shape, dtype):
        out, inp = out_in(weight, shape)
        values = DerivedParam(weight.parts, weight.split, False, reads=name, dim=weight.split, param_ndim=2,
                              make=lambda r, t, n: per_channel_block(weight, r, t, n, int8_rows, "values"))
        scale = DerivedParam(weight.parts, weight.split, False, reads=name,
                             dim=0 if weight.split == 0 else None, param_ndim=1,
                             make=lambda r, t, n: per_channel_block(weight, r, t, n, int8_rows, "scale"))
        return {"": WeightParam(values, (out, inp), np.dtype(np.int8)),
                "_scale": WeightParam(scale, (out,), np.dtype(np.float32))}

    def expert_params(self, weight: ExpertParam, name: str, shape: tuple[int, ...], dtype) -> dict[str, WeightParam]:
        """The stacked experts' params for the float statement `weight` of global kernel `shape` [S, in, out]:
        int8 values of that shape and layout, float32 scales [S, out] (per expert, per output row)."""
        values = ExpertInt8Param(weight.parts, weight.split, False, reads=name, expert=weight, want="values")
        scale = ExpertInt8Param(weight.parts, weight.split, False, reads=name, expert=weight, want="scale")
        return {"": WeightParam(values, tuple(shape), np.dtype(np.int8)),
                "_scale": WeightParam(scale, (shape[0], shape[-1]), np.dtype(np.float32))}

    def expert_kernel(self, layer, name, slot, dtype, cols=None):
        """The int8 values cast to `dtype` (the scales are `expert_scaled`'s)."""
        return stacked_kernel(layer, name, slot, dtype, cols)

    def expert_scaled(self, layer, y, name, slot, cols=None):
        """y times the per-expert output-channel scales (exact for per-output-channel scales)."""
        s = expert_columns(getattr(layer, name + "_scale")[...], cols, 1)       # [E_local, out]
        return y * (s[slot] if slot is not None else s[:, None, :])

    def expert_tiles(self, layer, name, experts):
        """The int8 values cast one tile at a time (~TILE_BYTES of them in the model's dtype)."""
        return converted_tiles(layer, name, experts, layer.param_dtype)

    @property
    def multiply_suffixes(self) -> tuple[str, ...]:
        return ("",)                             # the scales are applied in `finish`

    def apply(self, layer, x):
        flat = x.reshape(-1, x.shape[-1])
        prepared = self.prepare(flat)
        y = self.finish(layer, self.multiply(layer, prepared), prepared)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def prepare(self, x):
        """int8 activations, x [M, in]: its digit rows and scales (`int8_digits`), made once per GEMM however
        many layers' weights a switched GEMM has branches for; weight-only: x."""
        return x if self.activations == "float" else int8_digits(x, self.activations == "int8x2")

    def multiply(self, layer, prepared):
        """Weight-only: x Q^T in the layer's dtype (`tiled_matmul`); int8 activations: the int32 product of the
        digit rows (`weight_first_dot`)."""
        if self.activations == "float":
            return tiled_matmul(prepared, [layer.weight()], lambda q: q, layer.param_dtype)
        return weight_first_dot(layer.weight(), prepared[0])

    def finish(self, layer, raw, prepared):
        """The scales: the weight's per channel (and the tokens', `digits_finish`)."""
        if self.activations == "float":
            return raw * layer.weight("_scale").astype(layer.param_dtype)
        rows, s = prepared
        return digits_finish(raw, rows.shape[0], s, self.activations == "int8x2") * layer.weight("_scale")

    def embed(self, layer, ids):
        dt = layer.param_dtype
        rows = jnp.take(layer.weight(), ids, axis=0).astype(dt)          # [..., D]
        return rows * jnp.take(layer.weight("_scale"), ids, axis=0)[..., None].astype(dt)


def int8_dot(x: jax.Array, w: jax.Array, two_digits: bool) -> jax.Array:
    """x [..., in] float, w int8 [out, in] -> float32 [..., out] ~ x w^T / s_w: x quantized per token to one int8
    digit (W8A8) or two (`two_digits`: one dot of the stacked digit rows), int8 x int8 dots accumulated in int32."""
    rows, s = int8_digits(x, two_digits)
    return digits_dot(w, rows, s, two_digits).reshape(*x.shape[:-1], w.shape[0])


def int8_digits(x: jax.Array, two_digits: bool) -> tuple[jax.Array, jax.Array]:
    """x [..., in] float -> (rows int8 [M or 2M, in], s float32 [M, 1]), M the tokens: each token's int8 digit
    q1 = round(x / s), s = max|x| / 127, and with `two_digits` the remainder's digit q2 (steps of 1/254) in the
    rows after them."""
    x = x.reshape(-1, x.shape[-1])
    q, s = quantize_rows(x)                                                # [M, in] int8, [M, 1]
    if not two_digits:
        return q, s
    rest = x / jnp.where(s > 0, s, 1.0) - q                                # in [-1/2, 1/2]
    q2 = jnp.clip(jnp.round(rest * SECOND_DIGIT), -QMAX, QMAX).astype(jnp.int8)
    return jnp.concatenate([q, q2]), s                                     # [2M, in]: the digits stacked


def digits_dot(w: jax.Array, rows: jax.Array, s: jax.Array, two_digits: bool) -> jax.Array:
    """`int8_digits`' (rows, s) times int8 w [out, in] -> float32 [M, out] (before the weight's scale)."""
    return digits_finish(weight_first_dot(w, rows), rows.shape[0], s, two_digits)


def weight_first_dot(w: jax.Array, rows: jax.Array) -> jax.Array:
    """int8 w [out, in] (.) int8 rows [R, in] -> int32 [out, R'] (R' >= R: one row is padded to two), the weight as
    the dot's left operand ("fd,md->fm"): XLA:CPU's int8 kernel (YNNPACK) reads the weight faster that way than as
    the right operand ("md,fd->mf") at decode sizes (measured: docs/performance.md)."""
    return jnp.einsum("fd,md->fm", w, pad_rows(rows)[0], preferred_element_type=jnp.int32)


def digits_finish(product: jax.Array, num_rows: int, s: jax.Array, two_digits: bool) -> jax.Array:
    """`weight_first_dot` of `num_rows` digit rows (one digit or two per token) and their tokens' scales
    s [M, 1] -> float32 [M, out] (before the weight's scale)."""
    y = product[:, :num_rows].astype(jnp.float32)                          # [out, M or 2M]
    if two_digits:
        m = num_rows // 2
        y = y[:, :m] + y[:, m:] * (1.0 / SECOND_DIGIT)
    return y.T * s


def per_channel_block(weight: ShardedParam, rank: int, tensors: Mapping[str, LazyTensor], names: Mapping[str, str],
                      quantize_rows: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]], want: str) -> np.ndarray:
    """Rank `rank`'s block of a per-output-channel quantization of the weight `weight` declares:
    `want="values"` [out_local, in_local] or `want="scale"` [out_local].

    `quantize_rows(rows)`: float32 `[c, in]` whole rows -> (values `[c, in]`, scales `[c]`).
    Each part's output rows of this rank are read whole (every input column) in chunks of
    about `CHUNK_BYTES`, so a scale always sees its full row and no float copy of a whole
    tensor exists; a row split then keeps the rank's input columns of the values. The last
    quantized rows are kept (int8, `_LAST`): the values and the scales of a rank, and every
    rank of a row split (which all read every row), are quantized once.
    """
    out = []
    for part, spec in weight.parts.items():
        t = tensors[part]
        check_shape(names.get(part, part), tuple(t.shape), spec.hf_shape)
        out_rows = spec.rows[rank] if weight.split == 0 else np.arange(spec.hf_shape[0])
        cols = spec.rows[rank] if weight.split == 1 else None
        values, scale = _quantized_rows(t, out_rows, spec.hf_shape[1], quantize_rows)
        out.append(scale if want == "scale" else values if cols is None else take_rows(values, cols, 1))
    return np.concatenate(out, axis=0)


_LAST: list = [None, None]                    # [(tensor, rows key, quantizer), (values, scales)]


def _quantized_rows(t: LazyTensor, rows: np.ndarray, width: int, quantize_rows) -> tuple[np.ndarray, np.ndarray]:
    """`quantize_rows` of tensor `t`'s `rows`, read in chunks of ~`CHUNK_BYTES` of float32; the last answer kept
    (the key holds `t` itself, so its id cannot be reused while kept)."""
    key = (t, rows.tobytes(), quantize_rows)
    last = _LAST[0]
    if last is not None and last[0] is t and last[1] == key[1] and last[2] is quantize_rows:
        return _LAST[1]
    per_chunk = max(1, CHUNK_BYTES // (4 * width))
    parts = [quantize_rows(np.asarray(take_rows(t, rows[start:start + per_chunk], 0), np.float32))  # zeros: padding
             for start in range(0, len(rows), per_chunk)]
    answer = (np.concatenate([v for v, _ in parts]), np.concatenate([s for _, s in parts]))
    _LAST[:] = [key, answer]
    return answer


def int8_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [c, in] -> (Q int8 [c, in], s float32 [c]): s = max|row| / 127, Q = round(row / s)."""
    with np.errstate(invalid="ignore"):
        scale = np.abs(rows).max(axis=1) / np.float32(QMAX)   # NaN stays NaN: the loader's finite check names it
    ok = (scale > 0) & np.isfinite(scale)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(ok[:, None], np.rint(rows / np.where(ok, scale, 1)[:, None]), 0)
    return np.clip(q, -QMAX, QMAX).astype(np.int8), scale


@dataclasses.dataclass(frozen=True)
class ExpertInt8Param(DerivedParam):
    """The int8 values (`want="values"`, `[S, in, out]` like the float kernel) or the scales (`"scale"`,
    `[S, out]`) of the stacked experts the float statement `expert` declares: each expert quantized per
    output row by `per_channel_block`, a rank reading only its own experts (EP) or its own rows (TP)."""
    expert: ExpertParam | None = None
    want: str = "values"

    @property
    def param_dim(self) -> int | None:
        if self.want == "values" or self.expert.slots is not None:
            return self.expert.param_dim
        return 1 if self.expert.split == 0 else None            # the output rows split over tp (TP layout)

    def spec(self) -> tuple:
        if self.want == "values":
            return self.expert.spec()
        return (self.expert.spec()[0], TP if self.expert.slots is None and self.expert.split == 0 else None)

    def block(self, rank: int, tensors: Mapping[str, LazyTensor], names: Mapping[str, str] | None = None):
        """Rank `rank`'s experts, stacked; padding slots are zeros (values and scales), nothing read for them."""
        one, names, e_all = self.expert._expert(), names or {}, self.expert
        experts = range(len(e_all.parts) // len(e_all.names)) if e_all.slots is None else e_all.slots[rank]
        inner_rank = rank if e_all.slots is None else 0
        shape = e_all._expert_shape(inner_rank)                  # [in_local, out_local]
        out = []
        for e in experts:
            if e < 0:
                out.append(np.zeros(shape if self.want == "values" else shape[-1:],
                                    np.int8 if self.want == "values" else np.float32))
                continue
            keys = {n: f"{n}.{e}" for n in e_all.names}
            missing = [k for k in keys.values() if k not in tensors]
            if missing:
                raise KeyError(f"missing weight part(s) {missing}")
            b = per_channel_block(one, inner_rank, {n: tensors[k] for n, k in keys.items()},
                                  {n: names.get(k, k) for n, k in keys.items()}, int8_rows, self.want)
            out.append(b.T if self.want == "values" else b)      # values [out, in] -> the kernel's [in, out]
        return np.stack(out)
