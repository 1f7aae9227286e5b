"""Per-device loading: each device's block of each param, read from a weight source and placed
one device at a time (docs/design.md, "Per-device loading").

A *source* has `keys()`, `__contains__` and `get(name) -> lazy tensor` (`.shape` and
numpy slicing): safetensors, GGUF and Orbax readers all qualify. The param's own layer
builds the block (`load_block`) from its parts, each seen through its entry's view
(layout, row offset); this module only finds the rank and the layer range of a device's
index, converts the dtype and checks that the block is finite. Nothing here holds more
than one device block at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from tp_jax.loaders.bind import (Binding, CheckpointMismatchError, MissingWeightError, NameTableError, as_table,
                                 bind, check_source)
from tp_jax.parallel.layers import Entry, MethodLayer, WeightTable
from tp_jax.parallel.layers.method import DerivedParam
from tp_jax.parallel.mesh import TP


class NonFiniteWeightError(ValueError):
    """A checkpoint tensor holding NaN or infinity (or overflowing the run dtype)."""


def _tp_dim(spec) -> int | None:
    for i, axis in enumerate(spec):
        if axis == TP or (isinstance(axis, tuple) and TP in axis):
            return i
    return None


def _shards(entry, mesh: Mesh) -> int:
    """How many blocks a spec entry cuts its dimension into: tp, or dp x tp for experts split over both."""
    axes = entry if isinstance(entry, tuple) else (entry,)
    return int(np.prod([mesh.shape[a] for a in axes]))


def _check_finite(block: np.ndarray, b: Binding, names: dict[str, str], rank: int, source_block) -> None:
    if not np.issubdtype(block.dtype, np.floating) and block.dtype.kind != "V":
        bad = 0
    else:
        bad = int(block.size - np.count_nonzero(np.isfinite(block)))
    if not bad:
        return
    tensors = sorted(set(names.values()))
    src_bad = int(np.size(source_block) - np.count_nonzero(np.isfinite(np.asarray(source_block, np.float32))))
    why = ("hold NaN or infinity: the checkpoint is damaged; re-download or re-convert it" if src_bad else
           f"overflow {block.dtype} (values beyond its range): load in float32 or bfloat16")
    raise NonFiniteWeightError(f"tensor(s) {tensors} (param {b.path!r}, tp rank {rank}) {why}; {bad} non-finite "
                               f"value(s) in this block. check_weights=False skips this check")


def place_param(b: Binding, abstract, spec, mesh: Mesh, source, dtype, layer_map: Sequence[int],
                check_finite: bool = True) -> jax.Array:
    """The global array of one param, each device's block built by its layer from `source`.

    Stacked params follow `layer_map` (slot -> HF layer; -1 = an identity layer: zeros).
    Float params are cast to `dtype`; a param a linear method derived (int8 values, scales,
    GGUF blocks) or gave its own dtype (`Bfloat16`'s weight) keeps the dtype the method gave it.
    """
    shape = tuple(abstract.shape)
    if isinstance(b.decl, DerivedParam) or _method_weight(b):
        dtype = np.dtype(abstract.dtype)
    tp_dim = _tp_dim(spec)
    tp = None if tp_dim is None else _shards(spec[tp_dim], mesh)

    def one(rank: int, layer: int | None) -> np.ndarray:
        names = b.tensor_names(layer)
        raw = b.module.load_block(b.name, rank, b.tensors(source, layer), names)
        with np.errstate(over="ignore"):               # overflow is reported by the finite check
            block = np.asarray(raw, dtype=dtype)
        if check_finite:
            _check_finite(block, b, names, rank, raw)
        return block

    def block(index):
        rank = 0 if tp_dim is None else (index[tp_dim].start or 0) // (shape[tp_dim] // tp)
        if not b.stacked:
            return one(rank, None)
        local = tuple(len(range(*sl.indices(n))) for sl, n in zip(index, shape))
        out = np.zeros(local, dtype)                   # filled layer by layer: no list of layers, no stack copy
        for j, layer in enumerate(layer_map[i] for i in range(*index[0].indices(shape[0]))):
            if layer >= 0:
                out[j] = one(rank, layer)
        return out

    return _place(shape, NamedSharding(mesh, spec), block, dtype)


def _method_weight(b: Binding) -> bool:
    """Whether `b` is the weight of a layer whose method chose the weight's dtype (any but a `float_weight` one)."""
    return isinstance(b.module, MethodLayer) and b.name == b.module.weight_name and not b.module.method.float_weight


def _place(shape: tuple[int, ...], sharding: NamedSharding, block, dtype) -> jax.Array:
    """The global array from `block(index)`, one device at a time: each host block is put on its device
    and dropped before the next is read (`jax.make_array_from_callback` holds every device's block at
    once: a whole param in host memory), and a block several devices share is read once, then copied."""
    arrays, done = [], {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple((s.start, s.stop) for s in index)
        if key in done:
            arrays.append(jax.device_put(done[key], device))
            continue
        host = block(index)
        done[key] = jax.device_put(host, device)
        del host
        jax.block_until_ready(done[key])               # the host block is freed before the next one is read
        arrays.append(done[key])
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays, dtype=dtype)


def load_state(model: nnx.Module, mesh: Mesh, source, table: WeightTable | Sequence[Entry], num_layers: int, dtype,
               progress: bool = True, *, check_weights: bool = True) -> dict:
    """Real params for an abstract `model` (from `nnx.eval_shape`), placed per device.

    Everything is checked before any tensor data is read: the table against the model
    (`bind`), then the checkpoint's names and shapes against the table (`check_source`).
    `check_weights` checks every block for NaN / infinity as it is read (cheap: one pass
    over data already in memory). A model with pipeline padding exposes `layer_map`
    (stacked slot -> HF layer, -1 = identity). Returns {param path: jax.Array} for `fill`.
    """
    table = as_table(table)
    layer_map = tuple(getattr(model, "layer_map", range(num_layers)))
    bindings = bind(model, table)
    check_source(bindings, source, table, num_layers)
    state = nnx.state(model, nnx.Param)
    flat_specs = dict(nnx.to_flat_state(nnx.get_partition_spec(state)))
    flat_state = dict(nnx.to_flat_state(state))
    loaded = {}
    from tqdm.auto import tqdm
    with tqdm(total=len(bindings), desc="loading weights", unit="param", disable=not progress) as bar:
        for b in bindings:
            loaded[b.key] = place_param(b, flat_state[b.key].get_value(), flat_specs[b.key].get_value(), mesh,
                                        source, dtype, b.layer_map or layer_map, check_weights)
            bar.update(1)
    return loaded


def fill(model: nnx.Module, loaded: dict) -> None:
    """Put `load_state`'s arrays into the (abstract) model's params, in place."""
    for path, value in loaded.items():
        module = model
        for p in path[:-1]:
            module = module[p] if isinstance(p, int) else getattr(module, str(p))
        getattr(module, str(path[-1])).set_value(value)


__all__ = ["bind", "check_source", "load_state", "fill", "place_param", "MissingWeightError", "NameTableError",
           "CheckpointMismatchError", "NonFiniteWeightError"]
