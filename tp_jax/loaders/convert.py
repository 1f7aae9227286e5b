"""GGUF -> Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer files);
the config and tokenizer files of any source (used by the Orbax converter too).

The safetensors file is written one tensor at a time (header first, then each tensor's
bytes), so memory stays near one dequantized tensor whatever the model size.
"""

from __future__ import annotations

import json
import os

import numpy as np

from tp_jax.loaders.dtypes import BY_NUMPY, float_dtype
from tp_jax.loaders.gguf import GGUFSource, load_gguf_tokenizer
from tp_jax.loaders.sources import is_gguf


def convert_gguf(in_path: str, out_dir: str, dtype: str = "float32") -> None:
    """Write `in_path` (a llama GGUF) to `out_dir` as a HF checkpoint in `dtype`.

    `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` and
    `AutoTokenizer.from_pretrained(out_dir)` load the result.
    """
    target = float_dtype(dtype).numpy
    source = GGUFSource(in_path)
    os.makedirs(out_dir, exist_ok=True)
    write_config_and_tokenizer(in_path, out_dir, dtype)
    write_safetensors(source, os.path.join(out_dir, "model.safetensors"), target)


def write_config_and_tokenizer(src: str, out_dir: str, dtype: str | None = None) -> None:
    """config.json, generation_config.json and tokenizer files of `src` into `out_dir`.

    A `.gguf` file's are built from its metadata; a model directory's are copied (every file
    but the weights). `dtype`, when given, is recorded in config.json.
    """
    if is_gguf(src):
        config = GGUFSource(src).hf_config()
        config.dtype = dtype or "float32"
        config.save_pretrained(out_dir)
        _save_generation_config(config, out_dir)
        tok = load_gguf_tokenizer(src)
        if tok is not None:                            # a file without a tokenizer converts without one
            tok.save_pretrained(out_dir)
        return
    _copy_metadata_files(src, out_dir)
    if dtype is not None:
        path = os.path.join(out_dir, "config.json")
        with open(path) as f:
            config = json.load(f)
        config["dtype"] = dtype
        config.pop("torch_dtype", None)
        with open(path, "w") as f:
            json.dump(config, f, indent=2)


WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".gguf")


def _copy_metadata_files(src_dir: str, out_dir: str) -> None:
    import shutil
    if not os.path.isfile(os.path.join(src_dir, "config.json")):
        raise FileNotFoundError(f"no config.json in {src_dir!r}; a model directory needs one")
    for name in os.listdir(src_dir):
        path = os.path.join(src_dir, name)
        if os.path.isfile(path) and not name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, os.path.join(out_dir, name))


def _save_generation_config(config, out_dir: str) -> None:
    from transformers import GenerationConfig
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out_dir)


def write_safetensors(source, path: str, dtype: np.dtype) -> None:
    """Every tensor of `source` (a name -> lazy tensor table) to one safetensors file in `dtype`."""
    names = sorted(source.keys())
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        shape = source.get(name).shape
        size = int(np.prod(shape)) * dtype.itemsize
        header[name] = {"dtype": BY_NUMPY[np.dtype(dtype)].safetensors, "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)   # the format wants the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name in names:
            f.write(np.ascontiguousarray(source.get(name)[...], dtype=dtype).tobytes())
