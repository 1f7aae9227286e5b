"""Multi-head latent attention (MLA, DeepSeek-V2/V3), vLLM's MLA backend on one rank's heads.

    q   = q_b_proj(q_a_layernorm(q_a_proj(x)))  (or q_proj(x))      column over heads: [T, H_tp, nope + rope]
    c, k_pe = kv_a_proj_with_mqa(x)                                   replicated: [T, r] and [T, rope]
    c   = kv_a_layernorm(c)                                            the latent, one per token (no heads)
    q_pe, k_pe = rope(q_pe), rope(k_pe)                                interleaved pairs when `rope_interleave`
    W_UK, W_UV = kv_b_proj's [r, H_tp, nope] and [r, H_tp, v] parts    column over heads
    out = o_proj(attn)                                                 row over heads (the all-reduce)

Two equal ways to attend (the test checks them against each other and against transformers):

* expanded (no cache: the full forward behind `get_logits`, transformers' form): k = [c W_UK, k_pe] and
  v = c W_UV per head, standard attention with qk dim nope + rope and value dim v.
* absorbed (the paged cache: every engine step, prefill and decode): W_UK folds into the query,
  q_lat = q_nope W_UK^T [H_tp, r], so each head's scores are q_lat . c + q_pe . k_pe over the cached
  latent [c, k_pe] (r + rope per token); the output o_lat = softmax . c [H_tp, r] is lifted by W_UV.
  That is multi-query attention with one KV head of width r + rope whose values are its first r channels
  (`attend(..., v_dim=r)`), so the pool caches only [c, k_pe].

Under tp the heads split and the latent is computed and cached on every tp rank (vLLM's choice): the pool
has one latent "head" per tp rank (`kv_layout`: kv_heads = tp, head_dim = r + rope, no value pool).
A device holds, per token and layer, r + rope values instead of standard attention's 2 * H_kv_tp * head_dim.
With decode context parallelism (`decode_context_parallel_size` d) each tp rank holds 1/d of a sequence's tokens
instead: the paged step attends through tp_jax/models/dcp.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tp_jax.models.attention import attend
from tp_jax.models.dcp import attend_dcp
from tp_jax.models.rope import RopeConfig, inv_freq, rotate_together, yarn_softmax_scale
from tp_jax.parallel.invariant import row_tiled
from tp_jax.parallel.layers import ColumnParallelLinear, ReplicatedLinear, RMSNorm, RowParallelLinear

LATENT_NORM_EPS = 1e-6            # transformers builds q_a_layernorm / kv_a_layernorm with the default eps


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """The latent attention's sizes (DeepSeek's config names): q_lora_rank (None: a full-rank q_proj),
    kv_lora_rank r, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rope_interleave (rotary over
    interleaved pairs, DeepSeek's layout)."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True

    def __post_init__(self):
        for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MLAConfig: {f}={v!r} must be a positive integer")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLAConfig: qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotary pairs)")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 1):
            raise ValueError(f"MLAConfig: q_lora_rank={self.q_lora_rank!r} must be a positive integer or None")

    @property
    def latent_dim(self) -> int:
        """Cached values per token and layer: the latent and the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class KeepFloatColumn(ColumnParallelLinear):
    """kv_b_proj: quantization leaves it float, since the absorbed form reads its weight as W_UK and W_UV (vLLM
    dequantizes it for MLA too); a quantized checkpoint's copy is read dequantized. `switched = False`: the weight
    is read outside gemm, so a switched Stack indexes it per layer (as it does the MoE router)."""
    keep_float = True
    switched = False


class MLAttention(nnx.Module):
    """x[B, T, D] -> [B, T, D]: DeepSeek's latent attention (module docstring), heads split over tp.

    Args: `cfg` (a DecoderConfig with `mla`, `rope`, `num_heads`, `qkv_bias` for the a-projections and
    o_proj), `tp`, `dtype`, `rngs`, `parts` (unused: the latent norms are RMSNorms). tp must divide the heads.
    """

    def __init__(self, cfg, tp: int, dtype, rngs: nnx.Rngs, parts=None):
        m, d, h = cfg.mla, cfg.hidden_size, cfg.num_heads
        if h % tp:
            raise ValueError(f"{cfg.architecture}: num_attention_heads={h} is not divisible by tp={tp}; latent "
                             f"attention splits whole heads over tp: choose a tp that divides {h}")
        self.m, self.local_heads = m, h // tp
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        kw = dict(tp_size=tp, dtype=dtype, rngs=rngs)
        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(d, h * qk, bias=False, gather_output=False, **kw)
        else:
            self.q_a_proj = ReplicatedLinear(d, m.q_lora_rank, bias=cfg.qkv_bias, **kw)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, eps=LATENT_NORM_EPS, **kw)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, h * qk, bias=False, gather_output=False, **kw)
        self.kv_a_proj_with_mqa = ReplicatedLinear(d, m.latent_dim, bias=cfg.qkv_bias, **kw)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, eps=LATENT_NORM_EPS, **kw)
        self.kv_b_proj = KeepFloatColumn(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), bias=False,
                                         gather_output=False, **kw)
        self.o_proj = RowParallelLinear(h * m.v_head_dim, d, bias=cfg.o_bias, **kw)
        rope: RopeConfig = cfg.rope
        self.freq = tuple(inv_freq(rope, m.qk_rope_head_dim).tolist())
        self.rope_scale = rope.attention_factor
        self.scale = yarn_softmax_scale(rope, qk ** -0.5)

    def __call__(self, x, positions, cache, layer=None):
        """`layer` is unused (every MLA layer is alike); the signature is `Attention`'s."""
        m, hl = self.m, self.local_heads
        b, t = x.shape[:2]
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(b, t, hl, m.qk_nope_head_dim + m.qk_rope_head_dim)
        q_nope, q_pe = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
        kv = self.kv_a_proj_with_mqa(x)                                            # [B, T, r + rope]
        c = self.kv_a_layernorm(kv[..., :m.kv_lora_rank])
        q_pe, k_pe = rotate_together(q_pe, kv[..., None, m.kv_lora_rank:], positions, self.freq, self.rope_scale,
                                     interleaved=m.rope_interleave)                # k_pe [B, T, 1, rope]
        if cache is None:
            out = self._expanded(q_nope, q_pe, c, k_pe, positions)
        else:
            out, cache = self._absorbed(q_nope, q_pe, c, k_pe, positions, cache)
        return self.o_proj(out), cache

    def _up(self) -> tuple[jax.Array, jax.Array]:
        """kv_b_proj's local kernel [r, H_tp * (nope + v)] as W_UK [r, H_tp, nope] and W_UV [r, H_tp, v]."""
        m = self.m
        w = self.kv_b_proj.kernel[...].reshape(m.kv_lora_rank, self.local_heads, -1)
        return w[..., :m.qk_nope_head_dim], w[..., m.qk_nope_head_dim:]

    def _expanded(self, q_nope, q_pe, c, k_pe, positions):
        m, hl = self.m, self.local_heads
        kv = self.kv_b_proj(c).reshape(*c.shape[:2], hl, -1)                       # [B, T, H_tp, nope + v]
        k_nope, v = kv[..., :m.qk_nope_head_dim], kv[..., m.qk_nope_head_dim:]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, k_nope.shape[:3] + k_pe.shape[3:])], axis=-1)
        q = jnp.concatenate([q_nope, q_pe], axis=-1)
        return attend(q, k, v, positions, None, scale=self.scale)[0]              # [B, T, H_tp * v]

    def _absorbed(self, q_nope, q_pe, c, k_pe, positions, cache):
        w_uk, w_uv = self._up()
        dtype = q_nope.dtype
        q_lat = _per_token(lambda z: jnp.einsum("mhn,rhn->mhr", z, w_uk, preferred_element_type=jnp.float32),
                           q_nope).astype(dtype)
        q = jnp.concatenate([q_lat, q_pe], axis=-1)                                # [B, T, H_tp, r + rope]
        latent = jnp.concatenate([c[:, :, None, :], k_pe], axis=-1)                # [B, T, 1, r + rope]
        if cache.dcp > 1:                                                          # the latent split over tp ranks
            o_lat, cache = attend_dcp(q, latent, positions, cache, scale=self.scale, v_dim=self.m.kv_lora_rank)
        else:
            o_lat, cache = attend(q, latent, None, positions, cache, scale=self.scale, v_dim=self.m.kv_lora_rank)
        o_lat = o_lat.reshape(*o_lat.shape[:2], self.local_heads, self.m.kv_lora_rank)
        out = _per_token(lambda z: jnp.einsum("mhr,rhv->mhv", z, w_uv, preferred_element_type=jnp.float32),
                         o_lat).astype(dtype)
        return out.reshape(*out.shape[:2], -1), cache


def _per_token(dot, z: jax.Array) -> jax.Array:
    """dot(z[M, ...]) over the tokens of z[B, T, ...] in tiles of rows (`row_tiled`, batch-invariant): these per-head
    dots read kv_b_proj's kernel outside a linear layer, so they tile their rows themselves."""
    b, t = z.shape[:2]
    y = row_tiled(dot, z.reshape(b * t, *z.shape[2:]))
    return y.reshape(b, t, *y.shape[1:])
