"""Per-device loading: each device's block of each param, read from a weight source and placed
with `jax.make_array_from_callback` (DESIGN.md contract 3).

A *source* has `keys()`, `__contains__` and `get(name) -> lazy tensor` (`.shape` and
numpy slicing): safetensors, GGUF and Orbax readers all qualify. The param's own layer
builds the block (`load_block`); this module only finds the layer, the rank and the
layer range of a device's index, and converts the dtype. Nothing here holds more than
one device block at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from tp_jax.parallel.layers.loading import WeightShapeError
from tp_jax.loaders.names import Entry
from tp_jax.parallel.mesh import TP


class MissingWeightError(KeyError):
    def __str__(self):
        return str(self.args[0])


@dataclasses.dataclass
class Binding:
    """One model param and the HF tensors (templates, `{i}` = layer) that fill its parts."""
    path: str
    module: nnx.Module
    name: str
    parts: dict[str, str]
    stacked: bool

    def hf_names(self, layer: int | None) -> dict[str, str]:
        return {p: t.format(i=layer) for p, t in self.parts.items()}


def bind(model: nnx.Module, table: Sequence[Entry]) -> list[Binding]:
    """Match every param of `model` with its table entries; refuse params nothing fills."""
    state = nnx.state(model, nnx.Param)
    by_param: dict[str, dict[str, str]] = {}
    for e in table:
        by_param.setdefault(e.param, {})[e.part] = e.hf
    out = []
    for path, _ in nnx.to_flat_state(state):
        key = ".".join(str(p) for p in path)
        if key not in by_param:
            raise ValueError(f"no checkpoint tensor maps to param {key!r}; add it to the name table")
        module = model
        for p in path[:-1]:
            module = getattr(module, str(p))
        parts = by_param[key]
        stacked = any("{i}" in t for t in parts.values())
        out.append(Binding(key, module, str(path[-1]), parts, stacked))
    return out


def check_source(bindings: list[Binding], source, num_layers: int) -> None:
    """Every needed tensor exists with the shape its layer expects, before anything is read."""
    missing = []
    for b in bindings:
        decl = b.module.loading()[b.name]
        for layer in (range(num_layers) if b.stacked else [None]):
            for part, hf in b.hf_names(layer).items():
                if hf not in source:
                    missing.append(hf)
                    continue
                expected = decl.parts[part].hf_shape
                got = tuple(source.get(hf).shape)
                if got != tuple(expected):
                    raise WeightShapeError(f"tensor {hf!r} has shape {got}, expected {tuple(expected)} "
                                           f"(for param {b.path}); does the checkpoint match config.json?")
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise MissingWeightError(f"the checkpoint lacks {len(missing)} tensor(s) the model needs: "
                                 f"{missing[:5]}{more}")


def _tp_dim(spec) -> int | None:
    for i, axis in enumerate(spec):
        if axis == TP or (isinstance(axis, tuple) and TP in axis):
            return i
    return None


def place_param(b: Binding, abstract, spec, mesh: Mesh, source, dtype, layer_map: Sequence[int]) -> jax.Array:
    """The global array of one param, each device's block built by its layer from `source`.

    Stacked params follow `layer_map` (slot -> HF layer; -1 = an identity layer: zeros).
    """
    shape = tuple(abstract.shape)
    tp_dim, tp = _tp_dim(spec), mesh.shape[TP]

    def one(rank: int, layer: int | None) -> np.ndarray:
        names = b.hf_names(layer)
        tensors = {p: source.get(n) for p, n in names.items()}
        return np.asarray(b.module.load_block(b.name, rank, tensors, names), dtype=dtype)

    def block(index):
        rank = 0 if tp_dim is None else (index[tp_dim].start or 0) // (shape[tp_dim] // tp)
        if not b.stacked:
            return one(rank, None)
        local = tuple(len(range(*sl.indices(n))) for sl, n in zip(index, shape))
        layers = [layer_map[j] for j in range(*index[0].indices(shape[0]))]
        return np.stack([one(rank, layer) if layer >= 0 else np.zeros(local[1:], dtype) for layer in layers])

    sharding = NamedSharding(mesh, spec)
    if not sharding.addressable_devices:      # a process outside the mesh reads nothing (JAX would still
        return jax.make_array_from_single_device_arrays(shape, sharding, [], dtype=dtype)  # read replicated ones)
    return jax.make_array_from_callback(shape, sharding, block)


def load_state(model: nnx.Module, mesh: Mesh, source, table: Sequence[Entry], num_layers: int, dtype,
               progress: bool = True):
    """Real params for an abstract `model` (from `nnx.eval_shape`), placed per device.

    A model with pipeline padding exposes `layer_map` (stacked slot -> HF layer, -1 = identity).
    """
    layer_map = tuple(getattr(model, "layer_map", range(num_layers)))
    bindings = bind(model, table)
    check_source(bindings, source, num_layers)
    state = nnx.state(model, nnx.Param)
    specs = nnx.get_partition_spec(state)
    flat_specs = dict(nnx.to_flat_state(specs))
    loaded = {}
    from tqdm.auto import tqdm
    for b, (path, var) in zip(bindings, tqdm(nnx.to_flat_state(state), desc="loading weights", unit="param",
                                             disable=not progress)):
        loaded[path] = place_param(b, var.get_value(), flat_specs[path].get_value(), mesh, source, dtype,
                                   layer_map)
    return loaded


def fill(model: nnx.Module, loaded: dict) -> None:
    for path, value in loaded.items():
        module = model
        for p in path[:-1]:
            module = getattr(module, str(p))
        getattr(module, str(path[-1])).set_value(value)


__all__ = ["bind", "check_source", "load_state", "fill", "place_param", "MissingWeightError"]
