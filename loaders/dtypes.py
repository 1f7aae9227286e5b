"""The one dtype table: names users pass, numpy dtypes, safetensors codes and byte sizes.

`FLOATS` are the dtypes a model can run in and a checkpoint can be converted to; the
other entries are only known so that a safetensors header can be checked byte for byte.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class DType:
    name: str                 # what users pass: "float32", "bfloat16", ...
    numpy: np.dtype           # also what jax uses (jnp.bfloat16 is ml_dtypes.bfloat16)
    safetensors: str          # the code in a safetensors header: "F32", "BF16", ...

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize


_ALL = (
    DType("float32", np.dtype(np.float32), "F32"),
    DType("bfloat16", np.dtype(ml_dtypes.bfloat16), "BF16"),
    DType("float16", np.dtype(np.float16), "F16"),
    DType("float64", np.dtype(np.float64), "F64"),
    DType("int64", np.dtype(np.int64), "I64"),
    DType("int32", np.dtype(np.int32), "I32"),
    DType("int16", np.dtype(np.int16), "I16"),
    DType("int8", np.dtype(np.int8), "I8"),
    DType("uint8", np.dtype(np.uint8), "U8"),
    DType("bool", np.dtype(np.bool_), "BOOL"),
    DType("float8_e4m3fn", np.dtype(ml_dtypes.float8_e4m3fn), "F8_E4M3"),
    DType("float8_e5m2", np.dtype(ml_dtypes.float8_e5m2), "F8_E5M2"),
)
FLOATS = ("float32", "bfloat16", "float16")           # run dtypes and conversion targets
BY_NAME = {d.name: d for d in _ALL}
BY_SAFETENSORS = {d.safetensors: d for d in _ALL}
BY_NUMPY = {d.numpy: d for d in _ALL}


def float_dtype(name: str, what: str = "dtype") -> DType:
    """The float dtype called `name`, or ValueError listing the choices."""
    if name not in FLOATS:
        raise ValueError(f"{what}={name!r} is not supported; choose one of {list(FLOATS)}")
    return BY_NAME[name]
