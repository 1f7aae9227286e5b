"""ByRows: one weight held by two methods, each GEMM run by the one that is faster for its number of rows.

    ByRows(few=Int8("int8x2"), many=Bfloat16(), max_rows=4)

On XLA:CPU the int8 x int8 dot (YNNPACK) costs about the same for a few digit rows and then grows
fast, while the bf16 x bf16 -> float32 dot reads twice the bytes but stays flat much longer, so which is
the faster depends on the rows and on the CPU (`W8A8x2Bf16Config` picks `max_rows` by CPU; the
measurements: docs/performance.md, "The by-rows threshold"). `ByRows` holds both forms of each weight and picks per
GEMM, at trace time, from the rows of its input x [M, in]: `few` when M <= `max_rows`, else `many`.

The params are `few`'s under its own suffixes ("kernel", "kernel_scale") and `many`'s under
`many_suffix` + its suffixes ("kernel_bf16"); each method reads its own through a view of the layer that
adds the suffix (`_Suffixed`), so both run their own code unchanged, bit for bit; an embedding lookup
reads `many`'s rows. Costs, stated where
"auto" picks it (tp_jax/loaders/quantize.py): the weights take the bytes of both forms (int8 + bf16: 3 bytes a
weight), and a request's numbers depend on the rows of the step it runs in (a decode step alone: `few`'s;
beside 7 others, or a prefill: `many`'s). Name one method ("w8a8x2", "bf16") for batch-invariant
results or for a third of the memory.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import numpy as np

from tp_jax.parallel.layers.method import (DerivedParam, LinearMethod, QuantizationError, SplitGemm, WeightParam,
                                           gemm_parts)


@dataclasses.dataclass(frozen=True)
class ByRows(LinearMethod, SplitGemm):
    """`few` for a GEMM of at most `max_rows` rows, `many` above (module docstring); both hold the weight."""
    few: LinearMethod
    many: LinearMethod
    max_rows: int
    many_suffix: str = "_many"
    name: ClassVar[str] = "by_rows"

    def __post_init__(self):
        if not isinstance(self.max_rows, int) or self.max_rows < 1:
            raise QuantizationError(f"ByRows(max_rows={self.max_rows!r}): give a positive number of rows")
        if set(self.few.suffixes) & {self.many_suffix + s for s in self.many.suffixes}:
            raise QuantizationError(f"ByRows: many_suffix={self.many_suffix!r} makes {self.many.label}'s params "
                                    f"collide with {self.few.label}'s; choose another suffix")

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(k for k in self.few.kinds if k in self.many.kinds)

    @property
    def label(self) -> str:
        return f"{self.few.label} (<= {self.max_rows} rows) / {self.many.label}"

    @property
    def suffixes(self) -> tuple[str, ...]:
        return (*self.few.suffixes, *(self.many_suffix + s for s in self.many.suffixes))

    @property
    def multiply_suffixes(self) -> tuple[str, ...]:
        return (*gemm_parts(self.few).multiply_suffixes,
                *(self.many_suffix + s for s in gemm_parts(self.many).multiply_suffixes))

    def check(self, layer, weight) -> None:
        super().check(layer, weight)
        self.few.check(layer, weight)
        self.many.check(layer, weight)

    def params(self, weight, name, shape, dtype):
        many = {self.many_suffix + s: WeightParam(_reading(p.decl, name), p.shape, p.dtype)
                for s, p in self.many.params(weight, name, shape, dtype).items()}
        return {**self.few.params(weight, name, shape, dtype), **many}

    def _pick(self, rows: int) -> tuple[str, LinearMethod]:
        return ("few", self.few) if rows <= self.max_rows else ("many", self.many)

    def _view(self, key: str, layer):
        return layer if key == "few" else _Suffixed(layer, self.many_suffix)

    def apply(self, layer, x):
        key, method = self._pick(int(np.prod(x.shape[:-1])))
        return method.apply(self._view(key, layer), x)

    def prepare(self, x):
        """{"few" or "many": that method's `prepare(x)`}: the key, static in the pytree, carries the choice to
        `multiply` and `finish`."""
        key, method = self._pick(x.shape[0])
        return {key: gemm_parts(method).prepare(x)}

    def multiply(self, layer, prepared):
        (key, p), = prepared.items()
        method = self.few if key == "few" else self.many
        return gemm_parts(method).multiply(self._view(key, layer), p)

    def finish(self, layer, raw, prepared):
        (key, p), = prepared.items()
        method = self.few if key == "few" else self.many
        return gemm_parts(method).finish(self._view(key, layer), raw, p)

    def embed(self, layer, ids):
        """`many`'s rows, whatever the step (an embedding reads one row a token: no GEMM to choose for); for
        `W8A8x2Bf16Config` the bf16 rows, finer than int8's."""
        return self.many.embed(_Suffixed(layer, self.many_suffix), ids)


def _reading(decl, name: str):
    """`decl` as a param of its own filled from the weight's checkpoint entries (`DerivedParam.reads`): the
    second form's params are named apart ("kernel_many") but read the tensors of "kernel"."""
    if isinstance(decl, DerivedParam):
        return decl
    return DerivedParam(decl.parts, decl.split, decl.transpose, reads=name, dim=decl.param_dim,
                        param_ndim=decl.ndim, make=decl.block)


class _Suffixed:
    """A layer seen by one of ByRows' methods: `weight(s)` is the layer's `weight(suffix + s)`; all else as is."""

    def __init__(self, layer, suffix: str):
        self._layer, self._suffix = layer, suffix

    def weight(self, suffix: str = "") -> jax.Array:
        return self._layer.weight(self._suffix + suffix)

    def __getattr__(self, name):
        return getattr(self._layer, name)
