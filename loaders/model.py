"""Load a model for a mesh: config -> abstract model -> per-device params from a weight source."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from tp_jax.loaders.bind import bind
from tp_jax.loaders.place import fill, load_state
from tp_jax.loaders.sources import open_checkpoint
from tp_jax.models.config import ModelConfig
from tp_jax.models.registry import architecture, check_instance
from tp_jax.parallel.mesh import PP, TP, make_mesh


def abstract_model(cfg: ModelConfig, mesh: Mesh, dtype=jnp.float32) -> nnx.Module:
    """The registered model for `cfg` with shapes, dtypes and specs but no allocated params."""
    cls = architecture(cfg.architecture).model
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(lambda: cls(cfg, tp_size=mesh.shape[TP], pp_size=mesh.shape[PP], dtype=dtype,
                                           rngs=nnx.Rngs(0)))
    check_instance(model, cfg)
    return model


def load_from_source(cfg: ModelConfig, source, mesh: Mesh, dtype=jnp.float32, progress: bool = True, *,
                     check_weights: bool = True) -> nnx.Module:
    """The model for `cfg` on `mesh`, each device's params read from `source` (see `load_state`)."""
    model = abstract_model(cfg, mesh, dtype)
    table = architecture(cfg.architecture).weights(cfg)
    fill(model, load_state(model, mesh, source, table, cfg.num_layers, jnp.dtype(dtype), progress,
                           check_weights=check_weights))
    return model


def tensor_split_dims(cfg: ModelConfig) -> dict[str, int | None]:
    """Checkpoint tensor name -> the dimension (as stored) that tensor parallelism divides, None if
    none: read off the layers' declarations and the name table (the Orbax writer chunks along it)."""
    mesh = make_mesh(devices=jax.devices()[:1])
    model = abstract_model(cfg, mesh)
    out = {}
    for b in bind(model, architecture(cfg.architecture).weights(cfg)):
        for layer in (range(cfg.num_layers) if b.stacked else [None]):
            for part, e in b.entries.items():
                dim = b.decl.split
                if dim is not None and e.layout == "in_out":
                    dim = 1 - dim
                out[e.name(layer)] = dim
    return out


def load_model(path: str, mesh: Mesh, dtype=jnp.float32, progress: bool = True, *, check_weights: bool = True):
    """(model, config) for a checkpoint path (`.gguf`, Orbax or safetensors directory) on `mesh`."""
    ckpt = open_checkpoint(path)
    return load_from_source(ckpt.config, ckpt.source, mesh, dtype, progress, check_weights=check_weights), ckpt.config


__all__ = ["abstract_model", "load_from_source", "load_model", "open_checkpoint", "tensor_split_dims"]
