"""Checking `LLM(...)`'s arguments up front: types and ranges, before any device work or load.

`validate_llm_args(**kwargs)` raises a TypeError (wrong type, e.g. `tensor_parallel_size=2.0`
or `"2"`) or a ValueError (out of range, e.g. `max_num_seqs=0`) whose message names the
argument, what it got and what to pass instead. Names it does not know are ignored, so the
caller may pass its whole argument list.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np


def _is_int(value: Any) -> bool:
    """A Python or numpy integer; a bool is not a count (True would silently mean 1)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _int(name: str, value: Any, minimum: int | None, meaning: str, optional: bool = False) -> None:
    if optional and value is None:
        return
    what = ("None or " if optional else "") + ("an int" if minimum is None else f"an int >= {minimum}")
    if not _is_int(value):
        raise TypeError(f"LLM: {name}={value!r} must be {what}{meaning}, got {type(value).__name__}"
                        f"{_suggest(name, value)}")
    if minimum is not None and int(value) < minimum:
        raise ValueError(f"LLM: {name}={value!r} must be >= {minimum}{meaning}")


def _suggest(name: str, value: Any) -> str:
    """`; pass name=2` for 2.0 or "2"; nothing when no integer is meant."""
    meant = (isinstance(value, float) and value.is_integer()) or \
        (isinstance(value, str) and value.strip().lstrip("-").isdigit())
    return f"; pass {name}={int(value)}" if meant else ""


def count(meaning: str, optional: bool = False) -> Callable[[str, Any], None]:
    return lambda name, value: _int(name, value, 1, meaning, optional)


def any_int(name: str, value: Any) -> None:
    _int(name, value, None, "")


def _model(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"LLM: {name}={value!r} must be a path (str or os.PathLike) to an HF directory or a "
                        f".gguf file, or None for the embedded default model; got {type(value).__name__}")


def _dtype(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(f"LLM: {name}={value!r} must be a string: 'auto', 'float32', 'bfloat16' or 'float16'")


def _quantization(name: str, value: Any) -> None:
    from tp_jax.parallel.layers.quantization import quantization_choices
    choices = quantization_choices()
    if value is not None and not isinstance(value, str):
        raise TypeError(f"LLM: {name}={value!r} must be one of {choices} or None, got {type(value).__name__}")
    if value is not None and value not in choices:
        raise ValueError(f"LLM: {name}={value!r} is not a known quantization method; choose one of {choices}, "
                         f"or None (every weight in float)")


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"LLM: {name}={value!r} must be True or False, got {type(value).__name__}")


def _layer_loop(name: str, value: Any) -> None:
    from tp_jax.parallel.layers.stack import LAYER_LOOPS
    choices = ", ".join(repr(c) for c in LAYER_LOOPS)
    if not isinstance(value, str):
        raise TypeError(f"LLM: {name}={value!r} must be one of {choices}, got {type(value).__name__}")
    if value not in LAYER_LOOPS:
        raise ValueError(f"LLM: {name}={value!r} is not a layer loop; choose one of {choices} "
                         f"(see docs/performance.md)")


RULES: dict[str, Callable[[str, Any], None]] = {
    "model": _model,
    "tensor_parallel_size": count(" (devices that split each layer)"),
    "pipeline_parallel_size": count(" (stages the layers are split into)"),
    "data_parallel_size": count(" (model replicas)"),
    "dtype": _dtype,
    "max_model_len": count(" (tokens per sequence, prompt included; None: the model's limit, at most 2048)",
                           optional=True),
    "max_num_seqs": count(" (the most sequences generated together)"),
    "num_microbatches": count(" (pipeline micro-batches; None: pipeline_parallel_size)", optional=True),
    "seed": any_int,
    "progress": _flag,
    "check_weights": _flag,
    "quantization": _quantization,
    "layer_loop": _layer_loop,
    "enable_expert_parallel": _flag,
}


def validate_llm_args(**kwargs: Any) -> None:
    """Raise TypeError / ValueError naming the first bad argument; unknown names are ignored."""
    for name, value in kwargs.items():
        rule = RULES.get(name)
        if rule is not None:
            rule(name, value)
