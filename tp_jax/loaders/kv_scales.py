"""A checkpoint's KV cache scales: vLLM's FP8 checkpoints, compressed-tensors' `kv_cache_scheme`.

    model.layers.{i}.self_attn.k_scale, .v_scale        layer i's per-tensor key and value scales
    model.layers.{i}.self_attn.kv_scale                 one scale for both (older checkpoints)
    model.layers.{i}.self_attn.k_proj.output_scale,
                              .v_proj.output_scale      compressed-tensors' older names

A float8 cache (`kv_cache_dtype="fp8"`) stores x / s and reads q * s back, as vLLM's `BaseKVCacheMethod`: a layer
with no positive scale reads 1.0, a layer with one (kv_scale, or only k or v) uses it for both. Scales are per
tensor (a scalar, or one element); another shape is refused when the cache would read it. `q_scale` /
`prob_scale` (vLLM's fp8 attention quantizes the queries and the probabilities) are not read: both stay float here.
The weight loader leaves every such tensor to this module (`is_kv_scale`).
"""

from __future__ import annotations

import re

import numpy as np

from tp_jax.models.cache import KVScales

KV_SCALE = re.compile(r"(?:.*\.)?layers\.(?P<i>\d+)\.(?:self_attn|attn)\."
                      r"(?P<kind>k_scale|v_scale|kv_scale|k_proj\.output_scale|v_proj\.output_scale|q_scale|"
                      r"prob_scale)")
KIND = {"k_scale": "k", "k_proj.output_scale": "k", "v_scale": "v", "v_proj.output_scale": "v", "kv_scale": "kv"}


def is_kv_scale(name: str) -> bool:
    """Whether `name` is a KV cache (or fp8 attention) scale of some layer: no weight takes it."""
    return KV_SCALE.fullmatch(name) is not None


def has_kv_scales(source) -> bool:
    """Whether the checkpoint holds a k / v scale (its names only)."""
    return any((m := KV_SCALE.fullmatch(n)) and m.group("kind") in KIND for n in source.keys())


def read_kv_scales(source, num_layers: int) -> KVScales | None:
    """The checkpoint's (k, v) scale of each of its `num_layers` layers, None if it holds none."""
    found: dict[int, dict[str, float]] = {}
    for name in source.keys():
        m = KV_SCALE.fullmatch(name)
        if m is None or m.group("kind") not in KIND:
            continue
        value = np.asarray(source.get(name)[...], np.float32)
        if value.size != 1:
            raise ValueError(f"KV cache scale {name!r} has shape {tuple(value.shape)}: only per-tensor scales (one "
                             f"value) are read; use kv_cache_dtype='auto' (or 'int8', which computes its own scales) "
                             f"with this checkpoint")
        i = int(m.group("i"))
        if i >= num_layers:
            raise ValueError(f"KV cache scale {name!r} names layer {i}, but the model has {num_layers} layers; does "
                             f"the checkpoint match config.json?")
        found.setdefault(i, {})[KIND[m.group("kind")]] = float(value.reshape(()))
    if not found:
        return None
    pairs = [_pair(found.get(i, {})) for i in range(num_layers)]
    return KVScales(tuple(k for k, _ in pairs), tuple(v for _, v in pairs))


def _pair(scales: dict[str, float]) -> tuple[float, float]:
    """A layer's (k, v) scale by vLLM's rule: both when positive, else the one there is for both, else 1.0."""
    k, v = scales.get("k", scales.get("kv", -1.0)), scales.get("v", scales.get("kv", -1.0))
    if k > 0 and v > 0:
        return k, v
    one = max(k, v)
    return (one, one) if one > 0 else (1.0, 1.0)
