"""Load a model for a mesh: config -> abstract model -> per-device params from a weight source."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from tp_jax.loaders.names import table_for
from tp_jax.loaders.place import fill, load_state
from tp_jax.parallel.mesh import PP, TP
from tp_jax.models.config import ModelConfig
from tp_jax.models.registry import model_class


def abstract_model(cfg: ModelConfig, mesh: Mesh, dtype=jnp.float32) -> nnx.Module:
    """The model with shapes, dtypes and specs but no allocated params."""
    cls = model_class(cfg.architecture)
    with jax.set_mesh(mesh):
        return nnx.eval_shape(lambda: cls(cfg, tp_size=mesh.shape[TP], pp_size=mesh.shape[PP], dtype=dtype,
                                          rngs=nnx.Rngs(0)))


def load_from_source(cfg: ModelConfig, source, mesh: Mesh, dtype=jnp.float32, progress: bool = True) -> nnx.Module:
    model = abstract_model(cfg, mesh, dtype)
    loaded = load_state(model, mesh, source, table_for(cfg.architecture), cfg.num_layers, jnp.dtype(dtype),
                        progress)
    fill(model, loaded)
    return model


def open_checkpoint(path: str):
    """(source, config) for a Hugging Face directory (safetensors), an Orbax directory or a `.gguf` file."""
    import os
    from tp_jax.models.config import config_from_hf, load_config
    if os.path.isfile(path) and path.endswith(".gguf"):
        from tp_jax.loaders.gguf import GGUFSource
        source = GGUFSource(path)
        return source, config_from_hf(source.hf_config())
    from tp_jax.loaders.orbax import OrbaxSource, is_orbax_dir
    if is_orbax_dir(path):                   # config.json + orbax/ (scripts/convert.py --to orbax)
        cfg = load_config(path)
        return OrbaxSource(path), cfg
    if os.path.isdir(path):
        from tp_jax.loaders.safetensors import SafetensorsSource
        cfg = load_config(path)
        return SafetensorsSource(path), cfg
    raise FileNotFoundError(f"model {path!r} is neither a directory with config.json and *.safetensors "
                            f"nor a .gguf file")
