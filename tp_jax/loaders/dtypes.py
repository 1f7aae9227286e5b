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


# (name, numpy type, safetensors code)
_ALL = tuple(DType(name, np.dtype(t), code) for name, t, code in (
    ("float32", np.float32, "F32"), ("bfloat16", ml_dtypes.bfloat16, "BF16"), ("float16", np.float16, "F16"),
    ("float64", np.float64, "F64"), ("int64", np.int64, "I64"), ("int32", np.int32, "I32"),
    ("int16", np.int16, "I16"), ("int8", np.int8, "I8"), ("uint8", np.uint8, "U8"), ("bool", np.bool_, "BOOL"),
    ("float8_e4m3fn", ml_dtypes.float8_e4m3fn, "F8_E4M3"), ("float8_e5m2", ml_dtypes.float8_e5m2, "F8_E5M2")))
FLOATS = ("float32", "bfloat16", "float16")           # run dtypes and conversion targets
BY_NAME = {d.name: d for d in _ALL}
BY_SAFETENSORS = {d.safetensors: d for d in _ALL}
BY_NUMPY = {d.numpy: d for d in _ALL}


def float_dtype(name: str, what: str = "dtype") -> DType:
    """The float dtype called `name`, or ValueError listing the choices."""
    if name not in FLOATS:
        raise ValueError(f"{what}={name!r} is not supported; choose one of {list(FLOATS)}")
    return BY_NAME[name]
