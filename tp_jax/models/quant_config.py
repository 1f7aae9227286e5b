"""Published quantized checkpoints: which `quantization_config` blocks tp_jax reads (vLLM's detection).

    checkpoint_quant(qc) -> CheckpointQuant | None     None: the weights are float

`quantization_config.quant_method` in config.json picks the method, as in vLLM ("gptq", "awq", "fp8",
"compressed-tensors", and gpt-oss's "mxfp4", whose experts are kept as stored: tp_jax/loaders/mxfp4.py);
everything else (bitsandbytes, AQLM, HQQ, a GPTQ `checkpoint_format` other than gptq / gptq_v2, AWQ GEMV,
compressed-tensors' sparse or 2-to-7-bit schemes, an MXFP4 block with a field transformers' `Mxfp4Config`
does not have, ...) is refused here, before any weight is read, with an `UnsupportedConfigError` naming the
method, the scheme and the field that decided it.

What a checkpoint's layers hold (bits, group size, zero points, act order, FP8 blocks) is read from the
tensors themselves by the loader (tp_jax/loaders/packed.py); this module checks only what the tensors
cannot say, and that the declared scheme is one the loader implements. Activation quantization
(W8A8's int8 tokens, FP8's dynamic or static input scales) is not emulated: the math is the
checkpoint's weights, exactly dequantized, times float activations (docs/quantization.md).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from tp_jax.parallel.layers.quantization import PACKED_METHODS     # read by tp_jax (vLLM's names)

# quantization_config's quant_method -> the name users know
QUANT_METHODS = {"gptq": "GPTQ", "awq": "AWQ", "bitsandbytes": "bitsandbytes", "fp8": "FP8",
                 "fbgemm_fp8": "FP8 (fbgemm)", "compressed-tensors": "compressed-tensors", "aqlm": "AQLM",
                 "hqq": "HQQ", "eetq": "EETQ", "quanto": "quanto", "torchao": "torchao", "mxfp4": "MXFP4",
                 "bitnet": "BitNet", "auto-round": "AutoRound", "exl2": "EXL2"}
# quant_method values whose weights transformers stores dequantized: its GGUF load writes
# {"quant_method": "gguf"} into the config.json of a save_pretrained copy whose tensors are float.
DEQUANTIZED_METHODS = frozenset({"gguf"})
CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
# transformers' Mxfp4Config: `dequantize` is a loading option (dequantize to bf16 on load), not a property of the bytes
MXFP4_FIELDS = ("quant_method", "modules_to_not_convert", "dequantize")
MXFP4_SCHEME = "e2m1 values, an e8m0 scale per 32 inputs"


class QuantConfigError(ValueError):
    """A quantization_config tp_jax does not read (models/config.py re-raises it as UnsupportedConfigError)."""


@dataclasses.dataclass(frozen=True)
class CheckpointQuant:
    """What config.json says about a quantized checkpoint, checked.

    `method`: vLLM's name; `bits`: 4 or 8 (FP8: 8); `zero_offset`: added to a stored zero point (GPTQ's
    v1 format stores zero - 1); `desc_act`: GPTQ's act order (its `g_idx` reorders the groups);
    `block`: FP8's `weight_block_size`; `scheme`: how messages name it; `keep_float`: MXFP4's
    `modules_to_not_convert`, the modules stored float (transformers' patterns: `keeps_float`).
    """
    method: str
    bits: int = 4
    zero_offset: int = 0
    desc_act: bool = False
    block: tuple[int, int] | None = None
    scheme: str = ""
    group_size: int | None = None          # GPTQ / AWQ: inputs per scale (-1 in config.json: None, a whole row)
    sym: bool = False                      # GPTQ: one zero point, 2^(bits - 1)
    keep_float: tuple[str, ...] = ()       # MXFP4: modules_to_not_convert

    def keeps_float(self, module: str) -> bool:
        """Whether `keep_float` names `module`, by transformers' rule (`should_convert_module`): a pattern
        matching from the start up to a module boundary, as a regex ("model.layers.*.self_attn"), or a suffix."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in self.keep_float)


def _refuse(method: str, scheme: str, field: str, value: Any, supported: str) -> QuantConfigError:
    return QuantConfigError(
        f"{QUANT_METHODS.get(method, method)} checkpoint with {scheme}: quantization_config.{field}={value!r} is "
        f"not supported by tp_jax (supported: {supported}); use the model's float or GGUF release, with "
        f"`--quantization int8` to quantize it on load")


def as_dict(qc) -> dict:
    if hasattr(qc, "to_dict"):
        return qc.to_dict()
    return dict(qc) if isinstance(qc, Mapping) else {"quant_method": qc}


def checkpoint_quant(qc) -> CheckpointQuant | None:
    """The checked scheme of a `quantization_config` (a dict or transformers' object), None for float
    weights, or QuantConfigError naming the method, the scheme and the deciding field."""
    if qc is None:
        return None
    qc = as_dict(qc)
    method = qc.get("quant_method") or ("bitsandbytes" if qc.get("load_in_4bit") or qc.get("load_in_8bit")
                                        else "unknown")
    method = str(getattr(method, "value", method)).lower()        # transformers' QuantizationMethod enum: its value
    if method in DEQUANTIZED_METHODS:
        return None
    read = {"gptq": _gptq, "awq": _awq, "fp8": _fp8, "compressed-tensors": _compressed_tensors,
            "mxfp4": _mxfp4}.get(method)
    if read is None:
        name = QUANT_METHODS.get(method, method)
        if method == "bitsandbytes":
            name += " 4-bit" if qc.get("load_in_4bit") else " 8-bit" if qc.get("load_in_8bit") else ""
        raise QuantConfigError(
            f"{name} checkpoints are not supported (config.json has quantization_config with quant_method="
            f"{method!r}; tp_jax reads {', '.join(PACKED_METHODS)}); use the model's float or GGUF "
            f"release, with `--quantization int8` (LLM(..., quantization='int8')) to quantize it on load")
    return read(qc)


def _gptq(qc: dict) -> CheckpointQuant:
    bits, fmt = qc.get("bits", 4), qc.get("checkpoint_format") or "gptq"
    scheme = f"{bits}-bit, group_size {qc.get('group_size', 128)}"
    if bits not in (4, 8):
        raise _refuse("gptq", scheme, "bits", bits, "4 and 8")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("gptq", scheme, "checkpoint_format", fmt, "'gptq' (v1 zero points) and 'gptq_v2'")
    if qc.get("dynamic"):
        raise _refuse("gptq", scheme, "dynamic", qc["dynamic"], "one scheme for every layer (no per-module overrides)")
    return CheckpointQuant("gptq", bits, 1 if fmt == "gptq" else 0, bool(qc.get("desc_act")), None,
                           scheme + (", act order" if qc.get("desc_act") else ""),
                           _group_size("gptq", scheme, qc.get("group_size", 128)), bool(qc.get("sym", True)))


def _awq(qc: dict) -> CheckpointQuant:
    bits, version = qc.get("bits", qc.get("w_bit", 4)), str(qc.get("version", "gemm")).lower()
    scheme = f"{bits}-bit {version.upper()}, group_size {qc.get('group_size', qc.get('q_group_size', 128))}"
    if bits != 4:
        raise _refuse("awq", scheme, "bits", bits, "4")
    if version != "gemm":
        raise _refuse("awq", scheme, "version", qc.get("version"), "'gemm'")
    if qc.get("zero_point", True) is False:
        raise _refuse("awq", scheme, "zero_point", False, "true")
    return CheckpointQuant("awq", 4, 0, False, None, scheme,
                           _group_size("awq", scheme, qc.get("group_size", qc.get("q_group_size", 128))))


def _group_size(method: str, scheme: str, size) -> int | None:
    if size == -1:
        return None
    if not isinstance(size, int) or size <= 0:
        raise _refuse(method, scheme, "group_size", size, "a positive int, or -1 (one group per row)")
    return size


def _fp8(qc: dict) -> CheckpointQuant:
    block = qc.get("weight_block_size")
    scheme = "FP8 e4m3 " + (f"{block[0]}x{block[1]} blocks" if block else "per tensor")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse("fp8", scheme, "fmt", fmt, "'e4m3'")
    if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise _refuse("fp8", scheme, "activation_scheme", qc.get("activation_scheme"), "'dynamic', 'static'")
    if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse("fp8", scheme, "weight_block_size", block, "[rows, columns] of positive ints")
    return CheckpointQuant("fp8", 8, 0, False, tuple(block) if block else None, scheme)


def _compressed_tensors(qc: dict) -> CheckpointQuant:
    top = qc.get("format", "pack-quantized")
    for field in ("sparsity_config", "transform_config"):
        if qc.get(field):
            raise _refuse("compressed-tensors", top, field, "{...}", f"no {field} (dense weights)")
    groups = qc.get("config_groups") or {}
    if not groups and qc.get("kv_cache_scheme"):        # a KV-cache-only scheme: float weights, scales beside them
        return None
    if not groups:
        raise _refuse("compressed-tensors", top, "config_groups", groups, "at least one group of quantized weights")
    bits = set()
    for name, group in groups.items():
        w, fmt = group.get("weights") or {}, group.get("format") or top
        scheme = f"format {fmt}, group {name!r} ({w.get('type', 'int')} {w.get('num_bits')}-bit, " \
                 f"{w.get('strategy')})"
        if fmt not in CT_FORMATS:
            raise _refuse("compressed-tensors", scheme, "format", fmt, ", ".join(CT_FORMATS))
        kind, nbits, strategy = w.get("type", "int"), w.get("num_bits"), w.get("strategy")
        if kind == "float":
            if nbits != 8:
                raise _refuse("compressed-tensors", scheme, f"config_groups.{name}.weights.num_bits", nbits,
                              "8 for float (FP8 e4m3)")
            if strategy not in ("tensor", "channel", "block"):
                raise _refuse("compressed-tensors", scheme, f"config_groups.{name}.weights.strategy", strategy,
                              "tensor, channel, block for FP8")
        elif kind == "int":
            if nbits not in (4, 8):
                raise _refuse("compressed-tensors", scheme, f"config_groups.{name}.weights.num_bits", nbits,
                              "4 and 8 for int")
            if strategy not in ("channel", "group", "tensor"):
                raise _refuse("compressed-tensors", scheme, f"config_groups.{name}.weights.strategy", strategy,
                              "channel, group, tensor for int")
        else:
            raise _refuse("compressed-tensors", scheme, f"config_groups.{name}.weights.type", kind, "int, float")
        if w.get("dynamic") not in (None, False):
            raise _refuse("compressed-tensors", scheme, f"config_groups.{name}.weights.dynamic", w.get("dynamic"),
                          "false (weights quantized when saved)")
        bits.add(nbits)
    return CheckpointQuant("compressed-tensors", max(bits), 0, False, None, f"format {top}")


def kv_cache_scheme_problem(qc) -> str | None:
    """What keeps a float8 KV cache from reading compressed-tensors' `kv_cache_scheme` (None: nothing, or no
    scheme): only static per-tensor scales (`k_scale` / `v_scale` tensors) are read, as vLLM's fp8 cache."""
    scheme = (as_dict(qc) if qc is not None else {}).get("kv_cache_scheme")
    if not scheme:
        return None
    want = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}
    bad = [f"{k}={scheme.get(k)!r}" for k, v in want.items() if scheme.get(k, v if k == "dynamic" else None) != v]
    return None if not bad else (f"quantization_config.kv_cache_scheme has {', '.join(bad)}; an fp8 KV cache reads "
                                 f"only static per-tensor float8 scales (type 'float', num_bits 8, strategy 'tensor', "
                                 f"dynamic false)")


def _mxfp4(qc: dict) -> CheckpointQuant:
    """gpt-oss's MXFP4 experts (`*_blocks`, `*_scales`); `modules_to_not_convert` lists the modules stored float."""
    for field, value in qc.items():
        if field not in MXFP4_FIELDS:
            raise _refuse("mxfp4", MXFP4_SCHEME, field, value, f"no fields but {', '.join(MXFP4_FIELDS)}")
    keep = qc.get("modules_to_not_convert") or []
    if not isinstance(keep, (list, tuple)) or not all(isinstance(m, str) and m for m in keep):
        raise _refuse("mxfp4", MXFP4_SCHEME, "modules_to_not_convert", keep, "a list of module names or patterns")
    for pattern in keep:
        try:
            re.compile(pattern)
        except re.error as e:
            raise _refuse("mxfp4", MXFP4_SCHEME, "modules_to_not_convert", pattern,
                          f"patterns transformers reads as regular expressions ({e})") from None
    if not isinstance(qc.get("dequantize", False), bool):
        raise _refuse("mxfp4", MXFP4_SCHEME, "dequantize", qc["dequantize"], "true or false")
    return CheckpointQuant("mxfp4", 4, scheme=f"MXFP4 ({MXFP4_SCHEME})", group_size=32, keep_float=tuple(keep))
