"""Running an NNX module's local-shape forward under `jax.shard_map`.

The module's params are global arrays; `in_specs` for them come from each param's own
`out_sharding` metadata (never written twice). Inside, the module is rebuilt from the
local blocks, so its `__call__` sees local shapes and may call the collectives.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P


def shard_module(module: nnx.Module, mesh: Mesh, *, in_specs: tuple, out_specs,
                 method: str | Callable = "__call__", jit: bool = True) -> Callable:
    """`f(*args)` running `module.<method>(*args)` per device under shard_map.

    `method` may also be a function `fn(module, *args)`, for a forward that is not one method.

    `in_specs` / `out_specs` describe the arguments and result (e.g. `P("dp")` for a batch
    sharded on dp, `P()` for replicated). The params are a snapshot taken now.
    """
    graphdef, state = nnx.split(module)
    specs = nnx.get_partition_spec(state)

    def body(state, *args):
        local = nnx.merge(graphdef, state)
        return method(local, *args) if callable(method) else getattr(local, method)(*args)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, *in_specs), out_specs=out_specs, check_vma=False)
    fn = jax.jit(fn) if jit else fn
    return lambda *args: fn(state, *args)


__all__ = ["shard_module", "P"]
