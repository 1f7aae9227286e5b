"""GGUF -> Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer files).

The safetensors file is written one tensor at a time (header first, then each tensor's
bytes), so memory stays near one dequantized tensor whatever the model size.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

from tp_jax.loaders.gguf import GGUFSource, load_gguf_tokenizer

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
_SAFETENSORS_DTYPE = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16"}


def convert_gguf(in_path: str, out_dir: str, dtype: str = "float32") -> None:
    """Write `in_path` (a llama GGUF) to `out_dir` as a HF checkpoint in `dtype`.

    `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` and
    `AutoTokenizer.from_pretrained(out_dir)` load the result.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    source = GGUFSource(in_path)
    os.makedirs(out_dir, exist_ok=True)
    config = source.hf_config()
    config.dtype = dtype
    config.save_pretrained(out_dir)
    _save_generation_config(config, out_dir)
    write_safetensors(source, os.path.join(out_dir, "model.safetensors"), DTYPES[dtype])
    load_gguf_tokenizer(in_path).save_pretrained(out_dir)


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
        header[name] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)   # the format wants the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name in names:
            f.write(np.ascontiguousarray(source.get(name)[...], dtype=dtype).tobytes())
