"""Named quantizations (vLLM's `QuantizationConfig`): which `LinearMethod` each layer of a model gets.

    quantization_config(name)            -> a config ("bf16", "int8", "w8a8", "w8a8x2", "w8a8x2_bf16",
                                            "gguf", "gguf_bf16", "gptq", "awq", "fp8", "compressed-tensors"
                                            and their "_bf16" forms); QuantizationError listing the names
    quantization_choices()               -> what `LLM(quantization=...)` and `--quantization` accept
    config.method_for(layer, tensors)    -> the layer's method, or None (the layer stays float)
    apply_methods(model, plan)           -> swap methods on a built (abstract) model by module path
    register_quantization(name, cls)     -> add a named configuration

`tensors` are the checkpoint tensors that fill the layer's weight (every layer of a
stacked param, every part of a fused one), as lazy tensors: a configuration may read their
metadata (a GGUF tensor's `quant_type`), never their data. Layers that hold no
`LinearMethod` (norms, position tables) are never asked and stay float.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from flax import nnx

from tp_jax.parallel.layers import packed
from tp_jax.parallel.layers.by_rows import ByRows
from tp_jax.parallel.layers.ggml import KEPT, GGUFBlocks
from tp_jax.parallel.layers.int8 import Int8
from tp_jax.parallel.layers.loading import LazyTensor
from tp_jax.parallel.layers.method import EMBEDDING, EXPERTS, LINEAR, Bfloat16, Stored16, LinearMethod, QuantizationError

FLOAT_TYPES = ("F32", "F16", "BF16")          # GGUF tensor types that load as float
PACKED_METHODS = ("gptq", "awq", "fp8", "compressed-tensors", "mxfp4")   # published formats (models/quant_config.py)
AUTO, NONE = "auto", "none"                   # the names that are no configuration: pick by checkpoint; float


class QuantizationConfig:
    """Picks each layer's method. Subclasses set `name` and implement `method_for`."""
    name: ClassVar[str] = "?"

    def method_for(self, layer, tensors: Mapping[str, LazyTensor]) -> LinearMethod | None:
        """The method for `layer`, whose weight is filled by `tensors` (name -> lazy tensor); None: float."""
        raise NotImplementedError


class Bfloat16Config(QuantizationConfig):
    """`Bfloat16` (bf16 weights, bf16 x bf16 -> float32 dots) for every linear layer and vocab table."""
    name: ClassVar[str] = "bf16"

    def method_for(self, layer, tensors):
        return Bfloat16() if layer.weight_kind in Bfloat16.kinds else None


class Int8Config(QuantizationConfig):
    """`Int8` (weight-only) for every layer kind it serves (linear layers, vocab tables), from any float checkpoint."""
    name: ClassVar[str] = "int8"
    activations: ClassVar[str] = "float"

    def method_for(self, layer, tensors):
        return Int8(self.activations) if layer.weight_kind in Int8.kinds else None


class W8A8Config(Int8Config):
    """`Int8(activations="int8")`: int8 weights and per-token int8 activations, int8 x int8 -> int32 dots."""
    name: ClassVar[str] = "w8a8"
    activations: ClassVar[str] = "int8"


class W8A8x2Config(W8A8Config):
    """`Int8(activations="int8x2")`: int8 weights, activations as two int8 digits per token (~15 bits), one int8 dot."""
    name: ClassVar[str] = "w8a8x2"
    activations: ClassVar[str] = "int8x2"


INT8_MAX_ROWS = {"amx_int8": 24}   # a CPU flag -> the most rows w8a8x2_bf16 runs as int8 there (measured:
DEFAULT_INT8_MAX_ROWS = 4         # docs/performance.md, "The by-rows threshold"); without one: 4


@functools.cache
def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """This host's CPU feature flags (Linux's /proc/cpuinfo); empty where that cannot be read."""
    try:
        with open(path) as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def int8_max_rows(flags: frozenset[str] | None = None) -> int:
    """The most rows of a GEMM that `w8a8x2_bf16` runs with the int8 dot on a CPU with `flags` (default: this
    host's): where XLA:CPU's int8 dot stops being the faster of the two, measured per CPU (`INT8_MAX_ROWS`)."""
    flags = cpu_flags() if flags is None else flags
    return max((rows for flag, rows in INT8_MAX_ROWS.items() if flag in flags), default=DEFAULT_INT8_MAX_ROWS)


class W8A8x2Bf16Config(QuantizationConfig):
    """`ByRows(Int8("int8x2"), Bfloat16())` (layers/by_rows.py): each weight int8 and bf16, a GEMM of at most
    `max_rows` rows (decode of a few requests) with `w8a8x2`'s int8 dot, larger ones (batches, prefill) with
    bf16's; stacked experts `Int8("int8x2")` alone. On XLA:CPU the faster of the two at every size, for the
    bytes of both (docs/performance.md). `max_rows` (default `int8_max_rows()`: 4, or 24 on a CPU with AMX)."""
    name: ClassVar[str] = "w8a8x2_bf16"

    def __init__(self, max_rows: int | None = None):
        self.max_rows = int8_max_rows() if max_rows is None else max_rows

    def method_for(self, layer, tensors):
        if layer.weight_kind not in Int8.kinds:
            return None
        if layer.weight_kind not in Bfloat16.kinds:
            return Int8("int8x2")
        return ByRows(Int8("int8x2"), Bfloat16(), self.max_rows, many_suffix="_bf16")


class GGUFConfig(QuantizationConfig):
    """`GGUFBlocks(type, dot)` where a GGUF file stores the weight as Q8_0 / Q4_0 / Q4_1; float tensors stay float.

    "gguf" multiplies in float32 (bit for bit the file's dequantized weights), "gguf_bf16" with bf16 dots
    (layers/ggml.py).
    """
    name: ClassVar[str] = "gguf"
    dot: ClassVar[str] = "float32"

    def method_for(self, layer, tensors):
        types = {n: getattr(t, "quant_type", None) for n, t in tensors.items()}
        plain = sorted(n for n, q in types.items() if q is None)
        if plain:
            raise QuantizationError(f"quantization={self.name!r} keeps the blocks of a .gguf file's tensors; "
                                    f"{plain[0]!r} "
                                    f"is not a GGUF tensor (use quantization='int8', or None)")
        if set(types.values()) <= set(FLOAT_TYPES):
            return None
        for n, q in sorted(types.items()):
            if q not in KEPT and q not in FLOAT_TYPES:
                raise QuantizationError(
                    f"tensor {n!r} has GGUF quant type {q}, which tp_jax does not keep quantized (kept: "
                    f"{', '.join(KEPT)}); load with quantization=None to dequantize it to float")
        kinds = sorted(set(types.values()))
        if len(kinds) > 1:
            first = {q: next(n for n, t in sorted(types.items()) if t == q) for q in kinds}
            raise QuantizationError(
                f"the tensors of one param mix GGUF types {first} (a param stacks every layer and fuses "
                f"q/k/v or gate/up, so it holds one type); load with quantization=None to dequantize them")
        stored_in_out = sorted(n for n, t in tensors.items() if getattr(t, "transposed", False))
        if stored_in_out:
            raise QuantizationError(f"tensor {stored_in_out[0]!r} is stored [in, out]; GGUF blocks run along "
                                    f"the input of an [out, in] weight; load with quantization=None")
        return GGUFBlocks(kinds[0], self.dot)


class GGUFBf16Config(GGUFConfig):
    name: ClassVar[str] = "gguf_bf16"
    dot: ClassVar[str] = "bf16"


class PackedConfig(QuantizationConfig):
    """`PackedWeight` (layers/packed.py) for the linear layers of a GPTQ / AWQ / FP8 / compressed-tensors
    checkpoint (the loader's `PackedTensor`s) and `PackedExperts` for its stacked MoE experts (gpt-oss's MXFP4
    experts: their FP4 codes and E8M0 exponents as stored, loaders/mxfp4.py); its float
    tensors stay float: the vocab tables in the 16 bits they are stored in (`Stored16`), the router and norms
    in the run's dtype. `name` is vLLM's method name, which must be the
    checkpoint's; "<method>_bf16" dots in bf16."""
    name: ClassVar[str] = "?"
    method: ClassVar[str] = "?"
    dot: ClassVar[str] = "float32"

    def method_for(self, layer, tensors):
        if layer.weight_kind == EMBEDDING:                         # float tables: kept in their stored 16 bits
            stored = {getattr(t, "stored_dtype", None) for t in tensors.values()}
            half = stored.pop() if len(stored) == 1 else None
            return Stored16(np.dtype(half).name) if half in (np.float16, jnp.bfloat16) else None
        if layer.weight_kind not in (LINEAR, EXPERTS):
            return None
        types = {n: getattr(t, "quant_type", None) for n, t in tensors.items()}
        if all(q is None for q in types.values()):
            return None
        plain = sorted(n for n, q in types.items() if q is None)
        if plain:
            raise QuantizationError(f"the tensors of one param mix quantized and float weights ({plain[0]!r} is "
                                    f"float); load with quantization=None to dequantize them")
        other = sorted({q for q in types.values()} - {self.method})
        if other:
            raise QuantizationError(f"quantization={self.name!r} reads {self.method} checkpoints; this one is "
                                    f"{other[0]} (leave quantization='auto', or name {other[0]!r})")
        if layer.weight_kind == EXPERTS:
            return packed.for_experts(self.method, layer.statements(), tensors, self.dot)
        return packed.for_layer(self.method, layer.statements()[layer.weight_name], tensors, self.dot,
                                label=next(iter(tensors)))


def _packed_configs() -> dict[str, type[QuantizationConfig]]:
    out = {}
    for method in PACKED_METHODS:
        for dot, suffix in (("float32", ""), ("bf16", "_bf16")):
            out[method + suffix] = type(f"PackedConfig_{method}{suffix}", (PackedConfig,),
                                        {"name": method + suffix, "method": method, "dot": dot})
    return out


QUANTIZATIONS: dict[str, type[QuantizationConfig]] = {
    "bf16": Bfloat16Config, "int8": Int8Config, "w8a8": W8A8Config, "w8a8x2": W8A8x2Config,
    "w8a8x2_bf16": W8A8x2Bf16Config,
    "gguf": GGUFConfig, "gguf_bf16": GGUFBf16Config, **_packed_configs()}


def register_quantization(name: str, config: type[QuantizationConfig]) -> None:
    """Make `LLM(..., quantization=name)` use `config` (a QuantizationConfig subclass)."""
    if name in (AUTO, NONE):
        raise ValueError(f"register_quantization: {name!r} is reserved ('auto': picked by the checkpoint, "
                         f"'none': float); choose another name")
    if not (isinstance(config, type) and issubclass(config, QuantizationConfig)):
        raise TypeError(f"register_quantization({name!r}, ...): expected a QuantizationConfig subclass, got {config!r}")
    QUANTIZATIONS[name] = config


def quantization_choices() -> list[str]:
    """"auto", "none" and every registered name, as `LLM(quantization=...)` and `--quantization` accept them."""
    return [AUTO, NONE, *sorted(QUANTIZATIONS)]


def quantization_config(name: str) -> QuantizationConfig:
    """The configuration registered as `name`, or QuantizationError naming the choices."""
    if name not in QUANTIZATIONS:
        raise QuantizationError(f"unknown quantization method {name!r}; choose one of {quantization_choices()} "
                                f"(or None: every weight in float)")
    return QUANTIZATIONS[name]()


def apply_methods(model: nnx.Module, plan: Mapping[str, LinearMethod]) -> None:
    """`layer.use_method(method)` for each dotted module path of `plan` (e.g. "model.layers.layers.mlp.down_proj")."""
    found = {".".join(map(str, path)): node for path, node in nnx.iter_graph(model)
             if ".".join(map(str, path)) in plan}
    missing = sorted(set(plan) - set(found))
    if missing:
        raise KeyError(f"apply_methods: no module at {missing[:3]} in {type(model).__name__}")
    for path, node in found.items():
        node.use_method(plan[path])
