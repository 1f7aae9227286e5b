"""What every parallel layer shares: sharded param creation and the loading interface."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tp_jax.parallel.layers.loading import LazyTensor, ShardedParam

Spec = tuple[str | None, ...]


def check_tp_size(tp_size: int, where: str) -> None:
    if not isinstance(tp_size, (int, np.integer)) or tp_size < 1:
        raise ValueError(f"{where}: tp_size={tp_size!r} must be a positive integer.")


def split_size(size: int, tp_size: int, what: str, where: str) -> int:
    """`size // tp_size`, or a clear error when tp does not divide it (no padding defined)."""
    check_tp_size(tp_size, where)
    if size % tp_size:
        raise ValueError(f"{where}: {what}={size} is not divisible by tp={tp_size}, and this layer "
                         f"defines no padding for it; choose a tensor-parallel size that divides {size}.")
    return size // tp_size


class ParallelModule(nnx.Module):
    """A module whose params are declared by `loading()` and can be filled from HF tensors."""

    def loading(self) -> dict[str, ShardedParam]:
        raise NotImplementedError

    def load_block(self, name: str, rank: int, tensors: Mapping[str, LazyTensor],
                   names: Mapping[str, str] | None = None) -> np.ndarray:
        """Rank `rank`'s block of param `name`, built from full HF-layout tensors."""
        decl = self.loading()
        if name not in decl:
            raise KeyError(f"{type(self).__name__} has no param {name!r}; it has {sorted(decl)}")
        return decl[name].block(rank, tensors, names)

    def load_global(self, tensors: Mapping[str, Mapping[str, LazyTensor]]) -> dict[str, np.ndarray]:
        """The full (global) value of each param: every rank's block, concatenated.

        For tests and small models; the loader places per-device blocks instead.
        """
        out = {}
        for name, decl in self.loading().items():
            dim = sharded_dim(getattr(self, name).get_metadata().get("out_sharding"))
            blocks = [decl.block(r, tensors[name]) for r in range(self.tp_size)]
            out[name] = blocks[0] if dim is None else np.concatenate(blocks, axis=dim)
        return out

    def set_params(self, values: Mapping[str, np.ndarray]) -> None:
        for name, value in values.items():
            var = getattr(self, name)
            expected = tuple(var[...].shape)
            if tuple(value.shape) != expected:
                raise ValueError(f"{type(self).__name__}.{name}: value of shape {tuple(value.shape)}, "
                                 f"expected {expected}")
            var.set_value(jnp.asarray(value, var[...].dtype))


def sharded_dim(spec: Spec | None) -> int | None:
    """The index of the first sharded dimension of a spec, None when replicated."""
    for i, axis in enumerate(spec or ()):
        if axis is not None:
            return i
    return None


def make_param(rngs: nnx.Rngs, shape: tuple[int, ...], spec: Spec, dtype, init=None,
               zero_mask: np.ndarray | None = None) -> nnx.Param:
    """An `nnx.Param` of global `shape` carrying `spec`; `zero_mask` zeroes padding entries."""
    init = init or nnx.initializers.zeros_init()
    value = init(rngs.params(), shape, dtype)
    if zero_mask is not None:
        value = jnp.where(jnp.asarray(zero_mask), jnp.zeros((), dtype), value)
    return nnx.Param(value, out_sharding=spec)


def padding_mask(rows: np.ndarray, shape: tuple[int, ...], dim: int) -> np.ndarray | None:
    """A broadcastable mask, True where `rows` (flattened over ranks) is padding."""
    flat = np.asarray(rows).reshape(-1) < 0
    if not flat.any():
        return None
    return flat.reshape([-1 if i == dim else 1 for i in range(len(shape))])


def default_kernel_init():
    return nnx.initializers.lecun_normal()


def local_matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x[..., D] @ W[D, F] -> [..., F] in the kernel's dtype."""
    return jnp.einsum("...d,df->...f", x.astype(kernel.dtype), kernel)
