"""Dense layers of vLLM's model-parallel toolkit (vllm/model_executor/layers/linear.py).

Each module holds *global* params whose `out_sharding` spec says how they split over
tp; `__call__` is written for the *local* blocks and runs inside `jax.shard_map`.

Y = X A + b with A[D, F]:
* ReplicatedLinear      A on every rank.
* ColumnParallelLinear  A = [A_1, ..., A_p] along F:  X[..., D] -> Y_i[..., F/p]
                        (gather_output: all-gather -> Y[..., F]).
* MergedColumnParallelLinear  several column layers fused into one GEMM; rank i holds
                        [A^0_i, A^1_i, ...], `split` returns the parts.
* RowParallelLinear     A = [A_1; ...; A_p] along D: X_i[..., D/p] -> sum_i X_i A_i,
                        the only all-reduce of a dense layer; the bias is added once,
                        after the reduce.

Every layer states its split once (`statements()`); the local GEMM X_i A_i is its
`method`'s (`method=None`: the float kernel; `Bfloat16()`, `Int8()`, `GGUFBlocks(...)`: see
layers/method.py), so the collectives above are the same whatever the weight is in memory.
A method's GEMM may return float32 (its accumulator) in a layer of a narrower dtype: the
all-reduce then runs in float32 and the layer casts its output to its dtype after it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tp_jax.parallel import collectives
from tp_jax.parallel.layers.base import MethodLayer, check_tp_size, declared_param, default_kernel_init, split_size
from tp_jax.parallel.heads import HeadPlan
from tp_jax.parallel.layers.loading import PartRows, ShardedParam, contiguous_rows, expand_heads
from tp_jax.parallel.layers.method import LinearMethod
from tp_jax.parallel.mesh import TP


class _Linear(MethodLayer):
    """Shared body: a kernel [in, out] held by the layer's method, and an optional bias [out]."""

    def __init__(self, in_features: int, out_features: int, *, tp_size: int, bias: bool, dtype,
                 rngs: nnx.Rngs, kernel_init=None, method: LinearMethod | None = None):
        check_tp_size(tp_size, type(self).__name__)
        self.in_features, self.out_features, self.tp_size = in_features, out_features, tp_size
        self.use_bias = bias
        self.init_weight(method, dtype, rngs, kernel_init or default_kernel_init())
        self.bias = declared_param(rngs, self.statements()["bias"], (out_features,), dtype) if bias else None

    def weight_shape(self) -> tuple[int, int]:
        return self.in_features, self.out_features

    def _weights(self, out_rows: np.ndarray | None, in_rows: np.ndarray | None = None) -> dict[str, ShardedParam]:
        """Declarations for kernel (HF weight [out, in]) and bias (HF [out]).

        `out_rows`: each rank's output rows (column split); `in_rows`: each rank's input
        columns (row split); neither: replicated.
        """
        hf = (self._hf_out(), self._hf_in())
        if in_rows is not None:
            kernel = ShardedParam({"weight": PartRows(hf, in_rows)}, split=1, transpose=True)
        else:
            kernel = ShardedParam({"weight": PartRows(hf, out_rows)}, split=None if out_rows is None else 0,
                                  transpose=True)
        decl = {"kernel": kernel}
        if self.use_bias:
            decl["bias"] = ShardedParam({"bias": PartRows((hf[0],), out_rows)}, split=None if out_rows is None else 0)
        return decl

    def _hf_out(self) -> int:
        return self.out_features

    def _hf_in(self) -> int:
        return self.in_features


class ReplicatedLinear(_Linear):
    """Y = X A + b with A[D, F] on every rank (no collective).

    Args: `in_features`, `out_features`, `tp_size`, `bias`, `dtype`, `rngs`, `kernel_init`, `method`
    (a `LinearMethod`; None: the float kernel). Checkpoint parts: "weight" `[F, D]`, "bias" `[F]`.
    """

    def __init__(self, in_features: int, out_features: int, *, tp_size: int = 1, bias: bool = True,
                 dtype=jnp.float32, rngs: nnx.Rngs, kernel_init=None, method: LinearMethod | None = None):
        super().__init__(in_features, out_features, tp_size=tp_size, bias=bias, dtype=dtype, rngs=rngs,
                         kernel_init=kernel_init, method=method)

    def statements(self):
        return self._weights(None)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.gemm(x)
        return (y + self.bias[...] if self.bias is not None else y).astype(self.param_dtype)


class ColumnParallelLinear(_Linear):
    """A = [A_1, ..., A_p] along F: X[..., D] -> Y_local[..., F/tp], or Y[..., F] when `gather_output`.

    Args:
      in_features, out_features: D and F (global); tp must divide F.
      tp_size: the mesh's tp size. bias: add b[F] (split like F).
      gather_output: all-gather the output to [..., F].
      dtype, rngs, kernel_init: param dtype, `nnx.Rngs`, kernel initializer.
      method: the weight's `LinearMethod` (None: the float kernel).
    Checkpoint parts: "weight" `[F, D]`, "bias" `[F]`.
    """

    def __init__(self, in_features: int, out_features: int, *, tp_size: int = 1, bias: bool = True,
                 gather_output: bool = False, dtype=jnp.float32, rngs: nnx.Rngs, kernel_init=None,
                 method: LinearMethod | None = None):
        self.out_local = split_size(out_features, tp_size, "out_features", type(self).__name__)
        self.gather_output = gather_output
        super().__init__(in_features, out_features, tp_size=tp_size, bias=bias, dtype=dtype, rngs=rngs,
                         kernel_init=kernel_init, method=method)

    def statements(self):
        return self._weights(self._out_rows())

    def _out_rows(self) -> np.ndarray:
        return contiguous_rows(self.out_features, self.tp_size)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.gemm(x)                               # [..., F_local]; LoRA's B split like F (layers/lora.py)
        if self.bias is not None:
            y = y + self.bias[...]
        y = y.astype(self.param_dtype)
        return collectives.all_gather(y, TP, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column layers of sizes `output_sizes` (e.g. gate, up) fused into one GEMM.

    Rank i's block is [A^0_i, A^1_i, ...]; the checkpoint parts are named "0", "1", ...
    (`[output_sizes[k], D]` each). `split(y)` cuts a local output into the parts; with
    `gather_output` the parts come back whole and in order, as if the layers had not been fused.

    Args: `in_features` D, `output_sizes` (tp must divide each), `tp_size`, `bias`,
    `gather_output`, `dtype`, `rngs`, `kernel_init`, `method`.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], *, tp_size: int = 1,
                 bias: bool = True, gather_output: bool = False, dtype=jnp.float32, rngs: nnx.Rngs,
                 kernel_init=None, method: LinearMethod | None = None):
        name = type(self).__name__
        self.output_sizes = tuple(int(s) for s in output_sizes)
        self.local_sizes = tuple(split_size(s, tp_size, f"output_sizes[{i}]", name)
                                 for i, s in enumerate(self.output_sizes))
        super().__init__(in_features, sum(self.output_sizes), tp_size=tp_size, bias=bias,
                         gather_output=gather_output, dtype=dtype, rngs=rngs, kernel_init=kernel_init,
                         method=method)

    def statements(self):
        kernel, bias = {}, {}
        for i, size in enumerate(self.output_sizes):
            rows = contiguous_rows(size, self.tp_size)
            kernel[str(i)] = PartRows((size, self.in_features), rows)
            bias[str(i)] = PartRows((size,), rows)
        decl = {"kernel": ShardedParam(kernel, transpose=True)}
        if self.use_bias:
            decl["bias"] = ShardedParam(bias)
        return decl

    def split(self, y: jax.Array) -> list[jax.Array]:
        """[..., sum(local_sizes)] -> one [..., local_size] array per part."""
        return jnp.split(y, np.cumsum(self.local_sizes)[:-1], axis=-1)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.gemm(x)
        if self.bias is not None:
            y = y + self.bias[...]
        y = y.astype(self.param_dtype)
        if not self.gather_output or self.tp_size == 1:
            return y
        full = jax.lax.all_gather(y, TP, axis=0)                # [tp, ..., F_local]
        parts = [jnp.moveaxis(p, 0, -2).reshape(*p.shape[1:-1], -1) for p in self.split(full)]
        return jnp.concatenate(parts, axis=-1)


class RowParallelLinear(_Linear):
    """A = [A_1; ...; A_p] along D: X_local[..., D/tp] -> Y[..., F] = all_reduce(X_i A_i) + b.

    Args:
      in_features, out_features: D and F (global); tp must divide D.
      tp_size, bias (b[F], replicated, added once after the reduce), dtype, rngs, kernel_init.
      input_is_parallel: False takes the full X[..., D] and keeps this rank's slice.
      reduce_results: False returns the partial sum X_i A_i (+ b on rank 0 only), for a
        caller that reduces later.
      reduce_strategy: the all-reduce (`collectives.STRATEGIES`; None: `collectives.default_strategy()`,
        the same bits in one process or many on CPU).
      in_rows: [tp, D/tp] checkpoint input columns each rank holds (-1 = a zero row), e.g.
        o_proj under a head plan with padded heads (see `over_heads`).
      hf_in_features: the checkpoint weight's input size when it differs from D (padding).
      method: the weight's `LinearMethod` (None: the float kernel); per-output-channel scales
        are whole on every rank here, since every rank holds every output channel.
    Checkpoint parts: "weight" `[F, hf_in_features]`, "bias" `[F]`.
    """

    def __init__(self, in_features: int, out_features: int, *, tp_size: int = 1, bias: bool = True,
                 input_is_parallel: bool = True, reduce_results: bool = True,
                 reduce_strategy: str | None = None, in_rows: np.ndarray | None = None,
                 hf_in_features: int | None = None, dtype=jnp.float32, rngs: nnx.Rngs, kernel_init=None,
                 method: LinearMethod | None = None):
        name = type(self).__name__
        self.in_local = split_size(in_features, tp_size, "in_features", name)
        if reduce_strategy is not None and reduce_strategy not in collectives.STRATEGIES:
            raise ValueError(f"{name}: reduce_strategy={reduce_strategy!r}; choose one of "
                             f"{collectives.STRATEGIES}.")
        if in_rows is not None and np.shape(in_rows) != (tp_size, self.in_local):
            raise ValueError(f"{name}: in_rows has shape {np.shape(in_rows)}, expected "
                             f"({tp_size}, {self.in_local})")
        self.input_is_parallel, self.reduce_results = input_is_parallel, reduce_results
        self.reduce_strategy = reduce_strategy
        # a tuple, not an array: nnx treats array attributes as data (state), this is static
        self.in_rows = None if in_rows is None else tuple(map(tuple, np.asarray(in_rows).tolist()))
        self.hf_in_features = in_features if hf_in_features is None else hf_in_features
        super().__init__(in_features, out_features, tp_size=tp_size, bias=bias, dtype=dtype, rngs=rngs,
                         kernel_init=kernel_init, method=method)

    @classmethod
    def over_heads(cls, plan: HeadPlan, head_dim: int, out_features: int, **kwargs) -> RowParallelLinear:
        """The output projection (o_proj) after attention laid out by a head plan.

        Input: the plan's query slots x head_dim per rank (padded slots read zero rows);
        checkpoint weight `[out_features, num_heads * head_dim]`. `kwargs`: `tp_size` is the
        plan's; pass `bias`, `dtype`, `rngs`, ... as to the constructor.
        """
        return cls(plan.padded_q_heads * head_dim, out_features, tp_size=plan.tp,
                   in_rows=expand_heads(plan.q_heads, head_dim), hf_in_features=plan.num_heads * head_dim,
                   **kwargs)

    def _hf_in(self) -> int:
        return self.hf_in_features

    def statements(self):
        in_rows = np.asarray(self.in_rows) if self.in_rows is not None else contiguous_rows(self.in_features,
                                                                                            self.tp_size)
        return self._weights(None, in_rows)

    def __call__(self, x: jax.Array) -> jax.Array:
        if not self.input_is_parallel and self.tp_size > 1:
            start = collectives.axis_index(TP) * self.in_local
            x = jax.lax.dynamic_slice_in_dim(x, start, self.in_local, axis=-1)
        y = self.gemm(x)                        # partial sum [..., F] (float32 from a fast method), LoRA's too
        if self.reduce_results:
            y = collectives.all_reduce(y, TP, self.reduce_strategy)
            return (y + self.bias[...] if self.bias is not None else y).astype(self.param_dtype)
        if self.bias is None:
            return y
        first = collectives.axis_index(TP) == 0 if self.tp_size > 1 else True
        return y + jnp.where(first, self.bias[...], jnp.zeros_like(self.bias[...]))
