"""A lazy reader over one `model.safetensors` or an index-sharded checkpoint.

Headers (and the index) are parsed and checked up front, so a truncated or corrupt file
fails before loading starts with a `CheckpointError` naming the file: every entry must
have a known dtype, a shape of non-negative ints and byte offsets that match that shape
and lie inside the file without overlapping. Tensor data is only read through
`get(name)[slices]`, which reads just that slice through safetensors' `get_slice`.
"""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np

from tp_jax.loaders.dtypes import BY_NAME, BY_SAFETENSORS, FLOATS

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER = 100 * 2**20
LOADABLE = tuple(BY_NAME[n].safetensors for n in FLOATS)      # dtypes a float weight may have on disk
NUMPY_UNREADABLE = ("F8_E4M3", "F8_E5M2")                     # read through a memory map instead


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated, corrupt or holds something we cannot load."""


class SafetensorsTensor:
    """One tensor: `.shape`, `.file_dtype` (the file's code, "BF16"), `.dtype` (its numpy dtype), and `[slices]`
    reading only that slice."""

    def __init__(self, path: str, name: str, shape: tuple[int, ...], dtype: str):
        self.path, self.name, self.shape, self.file_dtype = path, name, shape, dtype
        self.dtype = BY_SAFETENSORS[dtype].numpy

    def __repr__(self) -> str:
        return f"SafetensorsTensor({self.name!r}, shape={self.shape}, {self.file_dtype}, {self.path})"

    def __getitem__(self, index) -> np.ndarray:
        if self.file_dtype in NUMPY_UNREADABLE:
            return self._mapped()[index]
        from safetensors import safe_open
        with safe_open(self.path, framework="numpy") as f:
            return f.get_slice(self.name)[index]

    def _mapped(self) -> np.ndarray:
        """The tensor as a read-only memory map (FP8: safetensors' numpy reader has no float8 types)."""
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            begin = json.loads(f.read(n))[self.name]["data_offsets"][0]
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=8 + n + begin, shape=self.shape)


def read_header(path: str) -> dict[str, dict]:
    """Tensor name -> {"dtype", "shape", "data_offsets"}, checked against the file size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path} is not a safetensors file: {size} bytes, too short for a header")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > MAX_HEADER:
            raise CheckpointError(f"{path} is truncated or corrupt: header length {n} exceeds file size {size}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise CheckpointError(f"{path} is corrupt: its header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is corrupt: its header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    spans = []
    for name, info in header.items():
        spans.append((*_check_entry(path, name, info, size - 8 - n), name))
    _check_covered(path, sorted(spans), size - 8 - n)
    return header


def _check_covered(path: str, spans: list[tuple[int, int, str]], data_size: int) -> None:
    """The tensors tile the data section exactly, as the format requires (no overlap, hole or tail).

    A header whose length or offsets were damaged would otherwise read other bytes as a tensor."""
    end, prev = 0, None
    for begin, stop, name in spans:
        if begin != end:
            what = f"overlaps {prev!r}" if begin < end else f"leaves bytes {end}..{begin} unused"
            raise CheckpointError(f"{path} is corrupt: tensor {name!r} at bytes {begin}..{stop} of the data "
                                  f"section {what}")
        end, prev = stop, name
    if end != data_size:
        raise CheckpointError(f"{path} is corrupt: its tensors cover {end} bytes of a {data_size}-byte data "
                              f"section (damaged header length or offsets); re-download or re-save it")


def _check_entry(path: str, name: str, info, data_size: int) -> tuple[int, int]:
    """(begin, end) of a header entry, or CheckpointError saying what is wrong with it."""
    bad = f"{path} is corrupt: header entry {name!r}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise CheckpointError(f"{bad} is not {{dtype, shape, data_offsets}}: {str(info)[:100]}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in BY_SAFETENSORS:
        raise CheckpointError(f"{bad} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise CheckpointError(f"{bad} has shape {shape!r}, not a list of non-negative ints")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{bad} has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end")
    begin, end = offsets
    if end > data_size:
        raise CheckpointError(f"{path} is truncated: tensor {name!r} needs bytes up to {end} of the data "
                              f"section but the file holds {data_size}; re-download or re-save it")
    if end - begin != math.prod(shape) * BY_SAFETENSORS[dtype].itemsize:
        raise CheckpointError(f"{bad} ({dtype}{shape}) spans {end - begin} bytes, which does not fit its shape")
    return begin, end


def read_index(path: str) -> dict[str, str]:
    """`model.safetensors.index.json`'s weight map (tensor name -> file name), checked."""
    try:
        with open(path, "rb") as f:
            index = json.loads(f.read())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); re-download it") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{path} has no \"weight_map\" object (tensor name -> file name); re-download it")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or os.path.basename(file) != file:
            raise CheckpointError(f"{path}: tensor {name!r} maps to {file!r}, not a file name in the directory")
    return weight_map


class SafetensorsSource:
    """All tensors of a Hugging Face checkpoint directory (single file or index-sharded)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._tensors: dict[str, SafetensorsTensor] = {}
        weight_map, index = self._weight_map()
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
        for file in files:
            path = os.path.join(model_dir, file)
            for name, info in read_header(path).items():
                if name in self._tensors:
                    raise CheckpointError(f"tensor {name!r} is in both {self._tensors[name].path} and {path}")
                self._tensors[name] = SafetensorsTensor(path, name, tuple(info["shape"]), info["dtype"])
        if weight_map:
            self._check_index(index, weight_map)

    def _weight_map(self) -> tuple[dict[str, str] | None, str]:
        index = os.path.join(self.model_dir, INDEX)
        if os.path.isfile(index):
            weight_map = read_index(index)
            missing = sorted({p for p in weight_map.values() if not os.path.isfile(os.path.join(self.model_dir, p))})
            if missing:
                raise CheckpointError(f"{index} lists files that are missing: {missing}")
            return weight_map, index
        if os.path.isfile(os.path.join(self.model_dir, SINGLE)):
            return None, ""
        raise FileNotFoundError(f"no {SINGLE} or {INDEX} in {self.model_dir!r}")

    def _check_index(self, index: str, weight_map: dict[str, str]) -> None:
        """The index and the files' headers must agree on every tensor and where it lives."""
        for name, file in weight_map.items():
            t = self._tensors.get(name)
            if t is None or os.path.basename(t.path) != file:
                raise CheckpointError(f"{index} puts tensor {name!r} in {file}, which does not hold it"
                                      + (f" (it is in {os.path.basename(t.path)})" if t else ""))
        unlisted = sorted(set(self._tensors) - set(weight_map))
        if unlisted:
            raise CheckpointError(f"{index} does not list tensor(s) {unlisted[:5]} held by "
                                  f"{sorted({os.path.basename(self._tensors[n].path) for n in unlisted})}")

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def raw(self, name: str) -> SafetensorsTensor:
        """The tensor whatever its dtype (a quantized checkpoint's int32 words, FP8 values, ...)."""
        if name not in self._tensors:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint in {self.model_dir!r}")
        return self._tensors[name]

    def get(self, name: str) -> SafetensorsTensor:
        t = self.raw(name)
        if t.file_dtype not in LOADABLE:
            raise CheckpointError(f"tensor {name!r} in {t.path} has dtype {t.file_dtype}; supported on disk: "
                                  f"{', '.join(LOADABLE)}")
        return t
