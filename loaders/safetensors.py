"""A lazy reader over one `model.safetensors` or an index-sharded checkpoint.

Headers are parsed up front (so a truncated or corrupt file fails before loading
starts, naming the file); tensor data is only read through `get(name)[slices]`, which
reads just that slice through safetensors' `get_slice`.
"""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np

SUPPORTED_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
ALL_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
              "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated, corrupt or holds something we cannot load."""


class SafetensorsTensor:
    """One tensor: `.shape`, `.dtype` (the file's), and `[slices]` reading only that slice."""

    def __init__(self, path: str, name: str, shape: tuple[int, ...], dtype: str):
        self.path, self.name, self.shape, self.file_dtype = path, name, shape, dtype

    def __getitem__(self, index) -> np.ndarray:
        from safetensors import safe_open
        with safe_open(self.path, framework="numpy") as f:
            return f.get_slice(self.name)[index]


def read_header(path: str) -> dict[str, dict]:
    """Tensor name -> {"dtype", "shape", "data_offsets"}, checked against the file size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path} is not a safetensors file: {size} bytes, too short for a header")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 100 * 2**20:
            raise CheckpointError(f"{path} is truncated or corrupt: header length {n} exceeds file size {size}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path} is corrupt: its header is not valid JSON ({e})") from e
    header.pop("__metadata__", None)
    for name, info in header.items():
        _check_entry(path, name, info, size - 8 - n)
    return header


def _check_entry(path: str, name: str, info: dict, data_size: int) -> None:
    dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
    if end > data_size:
        raise CheckpointError(f"{path} is truncated: tensor {name!r} needs bytes up to {end} of the data "
                              f"section but the file holds {data_size}; re-download or re-save it")
    if dtype in ALL_DTYPES and end - begin != math.prod(shape) * ALL_DTYPES[dtype]:
        raise CheckpointError(f"{path} is corrupt: tensor {name!r} ({dtype}{shape}) has {end - begin} bytes")


class SafetensorsSource:
    """All tensors of a Hugging Face checkpoint directory (single file or index-sharded)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._tensors: dict[str, SafetensorsTensor] = {}
        for path in self._files():
            for name, info in read_header(path).items():
                self._tensors[name] = SafetensorsTensor(path, name, tuple(info["shape"]), info["dtype"])

    def _files(self) -> list[str]:
        index = os.path.join(self.model_dir, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map", {})
            files = sorted(set(weight_map.values()))
            missing = [p for p in files if not os.path.isfile(os.path.join(self.model_dir, p))]
            if missing:
                raise CheckpointError(f"{index} lists files that are missing: {missing}")
            return [os.path.join(self.model_dir, p) for p in files]
        single = os.path.join(self.model_dir, SINGLE)
        if os.path.isfile(single):
            return [single]
        raise FileNotFoundError(f"no {SINGLE} or {INDEX} in {self.model_dir!r}")

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str) -> SafetensorsTensor:
        if name not in self._tensors:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint in {self.model_dir!r}")
        t = self._tensors[name]
        if t.file_dtype not in SUPPORTED_DTYPES:
            raise CheckpointError(f"tensor {name!r} in {t.path} has dtype {t.file_dtype}; supported on disk: "
                                  f"{', '.join(SUPPORTED_DTYPES)}")
        return t
