"""The one checkpoint-source dispatcher: a path -> (tensor source, model config).

    a `.gguf` file (any case: `M.GGUF` too)       -> GGUFSource, config from its metadata
    a directory with `orbax/` and config.json      -> OrbaxSource (scripts/convert.py --to orbax; PackedSource
                                                      over it for a converted quantized checkpoint)
    a directory with *.safetensors and config.json -> SafetensorsSource (PackedSource over it for a
                                                      GPTQ / AWQ / FP8 / compressed-tensors / MXFP4 checkpoint)

Every source has `keys()`, `in` and `get(name) -> lazy tensor`, under Hugging Face tensor
names and layouts (docs/adding_a_loader_source.md). A directory that an interrupted
Orbax conversion left behind is named as such, with the command that redoes it.
"""

from __future__ import annotations

import dataclasses
import json
import os

from tp_jax.loaders.gguf import GGUFSource
from tp_jax.loaders.orbax_source import OrbaxCheckpointError, OrbaxSource, interrupted_orbax, is_orbax_dir
from tp_jax.loaders.packed import PackedSource
from tp_jax.loaders.safetensors import SafetensorsSource
from tp_jax.models.config import ModelConfig, config_from_hf, load_config
from tp_jax.models.quant_config import checkpoint_quant


@dataclasses.dataclass
class Checkpoint:
    """An opened checkpoint: `source` (name -> lazy tensor) and the model `config` it is for."""
    path: str
    source: object
    config: ModelConfig

    def __iter__(self):
        """`source, config = open_checkpoint(path)` also works."""
        return iter((self.source, self.config))


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and str(path).lower().endswith(".gguf")


def open_checkpoint(path: str, *, config: bool = True) -> Checkpoint:
    """The source and model config of a `.gguf` file, an Orbax directory or a safetensors directory."""
    path = str(path)
    if is_gguf(path):
        source = GGUFSource(path)
        return Checkpoint(path, source, config_from_hf(source.hf_config()) if config else None)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model {path!r} is neither a directory with config.json and *.safetensors "
                                f"(or orbax/) nor a .gguf file")
    if is_orbax_dir(path):
        cfg = load_config(path) if config else None
        return Checkpoint(path, packed_source(OrbaxSource(path), path), cfg)
    left = interrupted_orbax(path)
    if left:
        raise OrbaxCheckpointError(f"{path} holds no finished Orbax checkpoint, only {left}, left by an interrupted "
                                   f"conversion; delete it and re-run `python scripts/convert.py SRC {path} "
                                   f"--to orbax --overwrite`")
    cfg = load_config(path) if config else None
    return Checkpoint(path, packed_source(SafetensorsSource(path), path), cfg)


def quantization_config_of(path: str) -> dict | None:
    """config.json's `quantization_config` in checkpoint directory `path` (None: none, or no config.json)."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        return None
    with open(config_file) as f:
        return json.load(f).get("quantization_config")


def packed_source(source, path: str):
    """`source`, or a `PackedSource` over it when config.json declares GPTQ / AWQ / FP8 / compressed-tensors /
    MXFP4."""
    qc = quantization_config_of(path)
    quant = checkpoint_quant(qc) if qc else None
    return source if quant is None else PackedSource(source, quant)
