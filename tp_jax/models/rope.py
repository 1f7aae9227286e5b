"""Rotary position embeddings (HF "rotate_half" layout, or DeepSeek's interleaved pairs) with default / linear /
dynamic / llama3 / longrope / yarn scaling.

`rope_from_hf` reads the rope fields of an HF config (`rope_parameters`, or the older
`rope_scaling` / `rope_theta`) and refuses scaling types and keys it does not implement.
`dynamic` (NTK) equals `default` for positions below max_position_embeddings, the only
range the engine allows (max_model_len <= max_position_embeddings).

`longrope` (Phi-3): frequencies divided per dimension by `short_factor`, or by `long_factor` for sequences past
`original_max_position_embeddings`, and cos / sin scaled by `attention_factor`. transformers picks the set by
the length of each forward (recomputing the cache when a sequence crosses); an engine holds one set for its
whole cache, chosen once by its max_model_len (`for_context`): short factors when max_model_len <= the original
length, which is transformers' choice for every sequence the engine can hold; long ones otherwise.
A `partial_rotary_factor` below 1 rotates only the first dims of each head (Phi-4-mini), read where the
architecture asks for it (`rope_from_hf(..., partial=True)`).

`yarn` (DeepSeek-V2/V3, gpt-oss): transformers' `_compute_yarn_parameters`. Each frequency blends its
extrapolated value theta^(-2i/d) with the interpolated one (divided by `factor`) along a linear ramp over the dims
between the correction range that `beta_fast` / `beta_slow` rotations give at `original_max_position_embeddings`
(floored / ceiled unless `truncate` is false); cos / sin are scaled by `attention_factor`, which is given, or
mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, or else mscale(factor), where
mscale(s, m) = 0.1 * m * ln(s) + 1. DeepSeek's MLA also scales its softmax by mscale(factor, mscale_all_dim)^2
(`yarn_softmax_scale`). `inv_freq` repeats transformers' float32 arithmetic op by op; the one op not pinned down is
theta^x, where torch's vectorised powf and numpy's may differ by 1 ulp (the other rope types share that).

`apply_rope(..., interleaved=True)` reads the rotary dims as pairs (x0, x1), (x2, x3), ... (DeepSeek's checkpoint
layout) and returns them as transformers' `apply_rotary_pos_emb_interleave` does: the evens rotated, then the
odds, i.e. rotate_half applied to concat(x[0::2], x[1::2]). q and k permuted alike leave q . k unchanged, so this
equals DeepSeek-V2's complex-number rotation of the pairs in place.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from tp_jax.models.config import UnsupportedConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope", "yarn")
ROPE_FIELDS = ("rope_parameters", "rope_scaling", "rope_theta")      # the HF config fields rope_from_hf reads
YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate", "attention_factor")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (transformers' names): theta and the scaling type with its factors."""
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    attention_factor: float = 1.0       # longrope / yarn: cos and sin are scaled by it (rope_from_hf derives it)
    use_long: bool = False
    beta_fast: float = 32.0             # yarn: the correction range, in rotations at the original length
    beta_slow: float = 1.0
    mscale: float | None = None         # yarn: only for attention_factor (rope_from_hf)
    mscale_all_dim: float | None = None     # yarn: also folded into DeepSeek's softmax scale (yarn_softmax_scale)
    truncate: bool = True               # yarn: floor / ceil the correction range

    def __post_init__(self):
        if self.type not in ROPE_TYPES:
            raise UnsupportedConfigError(f"rope_scaling type {self.type!r} is not supported; supported: {ROPE_TYPES}")
        if self.type == "longrope" and (self.short_factor is None or self.long_factor is None):
            raise UnsupportedConfigError("rope_parameters of type 'longrope' need short_factor and long_factor")


def for_context(rope: RopeConfig | None, max_model_len: int) -> RopeConfig | None:
    """`rope` for an engine whose sequences reach `max_model_len` tokens: LongRoPE's long factors when that
    passes the original context, its short ones otherwise (see the module docstring); other types as they are."""
    if rope is None or rope.type != "longrope":
        return rope
    return dataclasses.replace(rope, use_long=max_model_len > rope.original_max_position_embeddings)


def rope_from_hf(hf, params=None, *, partial: bool = False) -> RopeConfig:
    """The rotary embedding of an HF config; `params`: one entry of a per-layer-type `rope_parameters`
    (Gemma 3: {"sliding_attention": {...}, "full_attention": {...}}) instead of the config's own.
    `partial`: the architecture rotates `partial_rotary_factor` of each head (Phi-3); elsewhere a factor
    below 1 is refused."""
    if params is None:
        params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None)
    params = dict(params or {})
    theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UnsupportedConfigError(f"config field rope_scaling/rope_parameters: rope_type {kind!r} is not "
                                     f"supported; supported: {', '.join(ROPE_TYPES)}")
    known = {"rope_theta", "rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings"}
    if kind == "longrope":
        known |= {"short_factor", "long_factor", "attention_factor"}
    if kind == "yarn":
        known |= set(YARN_KEYS)
    if partial:
        known.add("partial_rotary_factor")
    extra = sorted(k for k, v in params.items() if k not in known and v not in (None, 1.0))
    if extra:
        raise UnsupportedConfigError(f"config field rope_parameters has unsupported keys {extra} "
                                     f"(rope_type {kind!r})")
    original = int(params.get("original_max_position_embeddings")
                   or getattr(hf, "original_max_position_embeddings", None)
                   or getattr(hf, "max_position_embeddings", 8192))
    more = dict(factor=float(params.get("factor") or 1.0))
    if kind == "longrope":
        factor = params.get("factor") or getattr(hf, "max_position_embeddings", original) / original
        attention = params.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        if params.get("short_factor") is None or params.get("long_factor") is None:
            raise UnsupportedConfigError("config field rope_parameters of type 'longrope' need short_factor and "
                                         f"long_factor; it has {sorted(params)}")
        more.update(short_factor=tuple(float(x) for x in params["short_factor"]),
                    long_factor=tuple(float(x) for x in params["long_factor"]), attention_factor=float(attention))
    if kind == "yarn":
        more.update(_yarn_fields(hf, params, original))
    fraction = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None)) if partial else None
    return RopeConfig(theta=float(theta), type=kind,
                      low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                      high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                      original_max_position_embeddings=original,
                      partial_rotary_factor=float(fraction or 1.0), **more)


def _yarn_fields(hf, params: dict, original: int) -> dict:
    """RopeConfig's yarn fields from `params`, with transformers' defaults and its derived factor and attention."""
    factor = params.get("factor")
    if factor is None:          # transformers: the ratio of the extended context to the pretrained one
        factor = getattr(hf, "max_position_embeddings", original) / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention = params.get("attention_factor")
    if attention is None:
        attention = (_mscale(factor, mscale) / _mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                     else _mscale(factor))
    return dict(factor=float(factor), attention_factor=float(attention),
                beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                mscale=None if mscale is None else float(mscale),
                mscale_all_dim=None if mscale_all_dim is None else float(mscale_all_dim),
                truncate=bool(params.get("truncate", True)))


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (transformers' `yarn_get_mscale`)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_softmax_scale(rope: RopeConfig | None, scale: float) -> float:
    """The softmax scale `scale` (e.g. qk_head_dim ** -0.5) times mscale(factor, mscale_all_dim)^2 when the rope scales
    and sets `mscale_all_dim`: DeepSeek's MLA tempers q . k over all its dims (transformers' `yarn_apply_mscale`)."""
    if rope is None or rope.type == "default" or not rope.mscale_all_dim:
        return scale
    mscale = _mscale(rope.factor, rope.mscale_all_dim)
    return scale * mscale * mscale


def inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """[rotary_dim/2] float32 inverse frequencies, as transformers computes them (rotary_dim = head_dim times
    `partial_rotary_factor`)."""
    dim = int(head_dim * rope.partial_rotary_factor)
    shape = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    # theta^(2i/dim) correctly rounded to float32 (a float64 power, rounded once), the same on every machine:
    # numpy's float32 power is vectorised differently per CPU (1-2 ulp apart on AVX-512 and AVX2 hosts), as is
    # torch's, which transformers uses: ours is within 1 ulp of its value
    powers = (np.float64(rope.theta) ** shape.astype(np.float64)).astype(np.float32)
    if rope.type == "longrope":
        ext = np.asarray(rope.long_factor if rope.use_long else rope.short_factor, np.float32)
        if ext.shape != shape.shape:
            raise UnsupportedConfigError(f"rope_parameters: {'long' if rope.use_long else 'short'}_factor has "
                                         f"{ext.size} entries; the rotary dims need {shape.size}")
        return (1.0 / (ext * powers)).astype(np.float32)
    if rope.type == "yarn":
        return _yarn(powers, rope, dim)
    freq = (1.0 / powers).astype(np.float32)
    if rope.type == "linear":
        return (freq / rope.factor).astype(np.float32)
    if rope.type == "llama3":
        return _llama3(freq, rope)
    return freq


def _llama3(freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    old = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = np.where(wavelen > low_wavelen, freq / rope.factor, freq)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(pos: np.ndarray, rope: RopeConfig, dim: int) -> np.ndarray:
    """transformers' yarn frequencies from pos[dim/2] = theta^(2i/dim), op by op in its float32 order."""
    low, high = (_yarn_dim(rotations, rope, dim) for rotations in (rope.beta_fast, rope.beta_slow))
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001               # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolated = np.float32(1) - ramp         # 1: the dim keeps theta^(-2i/dim); 0: divided by factor
    interpolation, extrapolation = 1.0 / (np.float32(rope.factor) * pos), 1.0 / pos
    return (interpolation * (np.float32(1) - extrapolated) + extrapolation * extrapolated).astype(np.float32)


def _yarn_dim(rotations: float, rope: RopeConfig, dim: int) -> float:
    """The (fractional) rotary dim whose frequency turns `rotations` times over the original context."""
    original = rope.original_max_position_embeddings
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))


def rotate_together(q: jax.Array, k: jax.Array, positions: jax.Array, freq, scale: float = 1.0,
                    interleaved: bool = False) -> tuple[jax.Array, jax.Array]:
    """(apply_rope(q), apply_rope(k)) for q[B, T, Hq, hd], k[B, T, Hk, hd], rotated as one array of Hq + Hk heads:
    rotated apart, XLA:CPU fused a key's rotation into the KV pool's write, where a token's cached key got other
    bits beside other tokens when a rank held few key values per token (one head of 4 or 8 dims; the numeric
    contract, tests/test_batch_invariance_models.py)."""
    hq = q.shape[2]
    both = apply_rope(jnp.concatenate([q, k.astype(q.dtype)], axis=2), positions, freq, scale, interleaved)
    return both[:, :, :hq], both[:, :, hq:].astype(k.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, freq, scale: float = 1.0, interleaved: bool = False) -> jax.Array:
    """x[B, T, H, hd] rotated by positions[B, T]: the first 2 * len(freq) dims of each head (all of them unless the
    rotary is partial), cos and sin scaled by `scale` (LongRoPE's / YaRN's attention factor). `interleaved`: those
    dims are pairs (x0, x1), (x2, x3), ..., returned rotated as evens then odds (see the module docstring)."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(freq)     # [B, T, rd/2]
    emb = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]          # [B, T, 1, rd]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x32 = x.astype(jnp.float32)
    rd = emb.shape[-1]
    head, rest = x32[..., :rd], x32[..., rd:]
    if interleaved:
        head = jnp.concatenate([head[..., 0::2], head[..., 1::2]], axis=-1)
    x1, x2 = jnp.split(head, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = head * cos + rotated * sin
    if rest.shape[-1]:
        out = jnp.concatenate([out, rest], axis=-1)
    return out.astype(x.dtype)
