"""vLLM's GroupCoordinator as functions over a named mesh axis, for use inside `shard_map`.

all_reduce (strategies "ordered", "psum", "one_shot", "two_shot", "auto"), all_gather, reduce_scatter,
broadcast from a source index, and send_to_next / send_to_prev along the pipeline axis.
On an axis of size 1 every function returns its input and emits no collective.

Sums in a multi-process CPU run are "ordered" by default: the members' values are gathered (a copy,
exact) and added in rank order, ((x_0 + x_1) + x_2) + ..., on every member. A float sum's last bits
depend on its order, and the order of XLA's all-reduce is its implementation's: XLA:CPU's in-process
collectives add in rank order (`ordered_sum`'s bits: tests/test_collectives.py), Gloo's, which carry
every collective of a multi-process CPU run, in another. With psum there, 2 processes x 4 devices
gave the default model's logprobs other bits than 1 process x 8 devices (by up to 2e-2 once its bf16
dots carried them); ordered, the same bits (tests/test_multihost.py). Elsewhere the default is XLA's
psum: one process's all-reduce on CPU, NCCL's or the TPU's on accelerators (tp x fewer bytes).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tp_jax.parallel.mesh import PP, TP

STRATEGIES = ("ordered", "psum", "one_shot", "two_shot", "auto")


@dataclasses.dataclass
class AllReduceThresholds:
    """Message sizes (bytes) at which "auto" switches strategy; tune with scripts/bench_collectives.py.

    size <= one_shot_max_bytes -> one_shot; size <= two_shot_max_bytes -> two_shot; else psum.
    The defaults follow vLLM's custom all-reduce (one-shot for small, two-shot for medium).
    """
    one_shot_max_bytes: int = 256 * 1024
    two_shot_max_bytes: int = 8 * 1024 * 1024


THRESHOLDS = AllReduceThresholds()


def set_all_reduce_thresholds(one_shot_max_bytes: int, two_shot_max_bytes: int) -> None:
    """The message sizes at which `all_reduce(..., "auto")` switches strategy: one_shot up to
    `one_shot_max_bytes`, two_shot up to `two_shot_max_bytes`, XLA's psum above (measure them with
    scripts/bench_collectives.py)."""
    if not 0 <= one_shot_max_bytes <= two_shot_max_bytes:
        raise ValueError(f"set_all_reduce_thresholds: need 0 <= one_shot_max_bytes ({one_shot_max_bytes})"
                         f" <= two_shot_max_bytes ({two_shot_max_bytes}).")
    THRESHOLDS.one_shot_max_bytes = one_shot_max_bytes
    THRESHOLDS.two_shot_max_bytes = two_shot_max_bytes


def axis_size(axis: str) -> int:
    return jax.lax.axis_size(axis)


def axis_index(axis: str = TP) -> jax.Array:
    return jax.lax.axis_index(axis)


def choose_strategy(nbytes: int) -> str:
    if nbytes <= THRESHOLDS.one_shot_max_bytes:
        return "one_shot"
    if nbytes <= THRESHOLDS.two_shot_max_bytes:
        return "two_shot"
    return "psum"


def default_strategy() -> str:
    """The all-reduce of a sum whose strategy is not named: "ordered" in a multi-process CPU run, else "psum"
    (the module doc)."""
    return "ordered" if jax.default_backend() == "cpu" and jax.process_count() > 1 else "psum"


def all_reduce(x: jax.Array, axis: str = TP, strategy: str | None = None) -> jax.Array:
    """Sum of `x` over `axis`; every member gets the sum. `strategy`: one of `STRATEGIES`, None for
    `default_strategy()` ("ordered": the same bits whatever implements the collectives; see the module doc)."""
    strategy = default_strategy() if strategy is None else strategy
    if strategy not in STRATEGIES:
        raise ValueError(f"all_reduce: unknown strategy {strategy!r}; choose one of {STRATEGIES}.")
    n = axis_size(axis)
    if n == 1:
        return x
    if strategy == "auto":
        strategy = choose_strategy(x.size * x.dtype.itemsize)
    if strategy == "ordered":
        return ordered_sum(jax.lax.all_gather(x, axis, axis=0))
    if strategy == "psum":
        return jax.lax.psum(x, axis)
    if strategy == "one_shot":
        return jnp.sum(jax.lax.all_gather(x, axis, axis=0), axis=0, dtype=x.dtype)
    return _two_shot(x, axis, n)


def ordered_sum(parts: jax.Array) -> jax.Array:
    """parts[n, ...] summed over the first axis in index order: ((p_0 + p_1) + p_2) + ..."""
    total = parts[0]
    for i in range(1, parts.shape[0]):
        total = total + parts[i]
    return total


def _two_shot(x: jax.Array, axis: str, n: int) -> jax.Array:
    flat = x.reshape(-1)
    pad = (-flat.size) % n
    flat = jnp.pad(flat, (0, pad))
    part = jax.lax.psum_scatter(flat, axis, scatter_dimension=0, tiled=True)
    full = jax.lax.all_gather(part, axis, axis=0, tiled=True)
    return full[:x.size].reshape(x.shape)


def all_gather(x: jax.Array, axis: str = TP, dim: int = -1) -> jax.Array:
    """Concatenate the members' `x` along `dim` (tiled), in axis-index order."""
    if axis_size(axis) == 1:
        return x
    return jax.lax.all_gather(x, axis, axis=dim % x.ndim, tiled=True)


def reduce_scatter(x: jax.Array, axis: str = TP, dim: int = -1) -> jax.Array:
    """Sum over `axis`, then member i keeps the i-th of n equal chunks along `dim`. Where `default_strategy()` is
    "ordered" the chunks are exchanged (an all-to-all, exact), then added in rank order (the module doc)."""
    n = axis_size(axis)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter: dimension {dim} of size {x.shape[dim]} does not split "
                         f"into {n} equal chunks; pad it to a multiple of {n}.")
    dim = dim % x.ndim
    if default_strategy() != "ordered":
        return jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)
    chunks = jnp.stack(jnp.split(x, n, axis=dim))                  # [n, ...]: chunk j goes to member j
    return ordered_sum(jax.lax.all_to_all(chunks, axis, split_axis=0, concat_axis=0, tiled=True))


def broadcast(x: jax.Array, src: int = 0, axis: str = TP) -> jax.Array:
    """Every member gets member `src`'s `x`."""
    n = axis_size(axis)
    if not 0 <= src < n:
        raise ValueError(f"broadcast: src={src} is outside axis {axis!r} of size {n}.")
    if n == 1:
        return x
    keep = jax.lax.axis_index(axis) == src
    return jax.lax.psum(jnp.where(keep, x, jnp.zeros_like(x)), axis)


def send_to_next(x: jax.Array, axis: str = PP) -> jax.Array:
    """Stage i sends `x` to stage i+1; returns what this stage received (zeros on stage 0)."""
    n = axis_size(axis)
    if n == 1:
        return x
    return jax.lax.ppermute(x, axis, [(i, i + 1) for i in range(n - 1)])


def send_to_prev(x: jax.Array, axis: str = PP) -> jax.Array:
    """Stage i sends `x` to stage i-1; returns what this stage received (zeros on the last)."""
    n = axis_size(axis)
    if n == 1:
        return x
    return jax.lax.ppermute(x, axis, [(i, i - 1) for i in range(1, n)])
