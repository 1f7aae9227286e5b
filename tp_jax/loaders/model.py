"""Load a model for a mesh: config -> abstract model -> linear methods -> per-device params from a source."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from tp_jax.loaders.bind import bind
from tp_jax.loaders.place import fill, load_state
from tp_jax.loaders.quantize import plan_methods, weight_facts
from tp_jax.models.config import ModelConfig
from tp_jax.models.registry import architecture, check_instance
from tp_jax.parallel.layers import LinearMethod, WeightTable, apply_methods
from tp_jax.parallel.mesh import DP, PP, TP, make_mesh


def abstract_model(cfg: ModelConfig, mesh: Mesh, dtype=jnp.float32,
                   methods: Mapping[str, LinearMethod] | None = None) -> nnx.Module:
    """The registered model for `cfg` with shapes, dtypes and specs but no allocated params.

    `methods`: {module path: LinearMethod} swapped in after construction (`plan_methods`);
    the model's own code never sees quantization.
    """
    cls = architecture(cfg.architecture).model
    cfg = for_mesh(cfg, mesh)

    def build():
        model = cls(cfg, tp_size=mesh.shape[TP], pp_size=mesh.shape[PP], dtype=dtype, rngs=nnx.Rngs(0))
        apply_methods(model, methods or {})
        return model

    with jax.set_mesh(mesh):
        model = nnx.eval_shape(build)
    check_instance(model, cfg)
    return model


def for_mesh(cfg: ModelConfig, mesh: Mesh) -> ModelConfig:
    """`cfg` with the mesh facts a model's layout needs: `data_parallel_size` (an MoE model's expert group
    under expert parallelism is the dp x tp devices of a stage), for configs that have that field."""
    if any(f.name == "data_parallel_size" for f in dataclasses.fields(cfg)) and \
            cfg.data_parallel_size != mesh.shape[DP]:
        return dataclasses.replace(cfg, data_parallel_size=mesh.shape[DP])
    return cfg


def load_from_source(cfg: ModelConfig, source, mesh: Mesh, dtype=jnp.float32, progress: bool = True, *,
                     check_weights: bool = True, quantization: str | None = None,
                     strict: bool = True) -> nnx.Module:
    """The model for `cfg` on `mesh`, each device's params read from `source` (see `load_state`).

    `quantization`: None (float) or a registered method name (tp_jax/loaders/quantize.py; "auto" is decided
    by the engine's resolve step before this); its problems are raised before any tensor data is read
    (`strict` False: such layers load as float, with a warning).
    """
    model, table = plan_model(cfg, source, mesh, dtype, quantization=quantization, strict=strict)
    fill(model, load_state(model, mesh, source, table, cfg.num_layers, jnp.dtype(dtype), progress,
                           check_weights=check_weights))
    return model


def plan_model(cfg: ModelConfig, source, mesh: Mesh, dtype=jnp.float32, *, quantization: str | None = None,
               strict: bool = True) -> tuple[nnx.Module, WeightTable]:
    """(the abstract model for `cfg` on `mesh` with the linear methods `quantization` gives it for `source`, the
    name table for `source`'s names): everything `load_state` needs, from headers only."""
    model = abstract_model(cfg, mesh, dtype)
    table = architecture(cfg.architecture).weights(cfg).for_names(source.keys())
    methods = plan_methods(model, table, source, cfg.num_layers, quantization, strict)
    return (abstract_model(cfg, mesh, dtype, methods) if methods else model), table


def checkpoint_weight_facts(cfg: ModelConfig, source, mesh: Mesh) -> tuple[frozenset, bool]:
    """`weight_facts` of `source` for `cfg` (headers only): the GGUF types of the weights, all bfloat16?"""
    model = abstract_model(cfg, mesh)
    table = architecture(cfg.architecture).weights(cfg).for_names(source.keys())
    return weight_facts(model, table, source, cfg.num_layers)


def param_bytes_per_device(model: nnx.Module, mesh: Mesh) -> int:
    """Bytes of params on the busiest device of `mesh` (abstract or loaded model), from each param's spec."""
    state = nnx.state(model, nnx.Param)
    specs = dict(nnx.to_flat_state(nnx.get_partition_spec(state)))
    total = 0
    for key, var in nnx.to_flat_state(state):
        x, spec = var.get_value(), specs[key].get_value()
        shards = math.prod(mesh.shape[a] for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,)))
        total += math.prod(x.shape) // shards * jnp.dtype(x.dtype).itemsize
    return total


def tensor_split_dims(cfg: ModelConfig) -> dict[str, int | None]:
    """Checkpoint tensor name -> the dimension (as stored) that tensor parallelism divides, None if
    none: read off the layers' declarations and the name table (the Orbax writer chunks along it)."""
    mesh = make_mesh(devices=jax.devices()[:1])
    model = abstract_model(cfg, mesh)
    out = {}
    for b in bind(model, architecture(cfg.architecture).weights(cfg)):
        for layer in b.layers(cfg.num_layers):
            for part, e in b.entries.items():
                dim = b.decl.split
                if dim is not None and e.layout == "in_out":
                    dim = 1 - dim
                out[e.name(layer)] = dim
    return out


__all__ = ["abstract_model", "plan_model", "load_from_source", "checkpoint_weight_facts", "tensor_split_dims", "param_bytes_per_device"]
