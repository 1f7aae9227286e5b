"""Causal grouped-query attention on one rank's local heads: the one entry point model files call.

    out, cache = attend(q, k, v, positions, cache, scale=..., window=...)

* `cache is None`: dense causal attention over the given tokens (the full forward behind
  `LLM.get_logits` and the golden tests).
* `cache` a `LayerCache` (tp_jax/models/cache.py): the step's new k and v are written into the
  paged pool at their slots, then every row of the step attends to its own blocks,
  gathered through its block table (vLLM's `Attention` layer with a reference backend).

Shapes (local, under shard_map): q[B, T, Hq, hd], k/v[B, T, Hkv, hd], Hq = Hkv * G (the head
plan keeps G uniform per rank). A query at position p sees keys at positions <= p (and,
with a sliding window w, > p - w).

Paged step layout (see `PagedBatch`): the N tokens of a micro-batch are packed: D decode rows
of one token each, then the prefill rows' tokens back to back (then padding). For attention
the prefill tokens are gathered into P rows of T (`prefill_index`), so the dense layers never
compute padding beyond N. A row's context is its blocks, read as positions
0 .. W * block_size - 1; positions past the row's newest token are masked, so stale or padded
blocks are never seen. Memory per layer is bounded by (tokens of a row) x (context): a
prefill chunk never builds a [T, T] matrix over a whole prompt. The pool is head-major,
[L, Hkv, blocks, block_size, hd]: a row's gathered context is [Hkv, S, hd] per row, the
layout the two dots batch over, so neither K nor V is transposed after the gather.

Decode rows can instead attend split-K (`split_decode`, flash-decoding's shape): the batch then
lays each decode row's context out as chunks of a few blocks, each chunk a virtual row with its
own table, and each chunk's softmax partials (max, sum, unnormalized output) are combined per
row; only the blocks a row uses are read, not its bucketed table width. A row's chunks depend on
its own length alone, so its numbers never depend on the other rows of its step.

`PAGED_BACKENDS` maps a name to an implementation with `paged_reference`'s signature
(q, k_pool, v_pool, layer, positions, batch: one micro-batch's PagedBatch, scale, window); the
reference (gather + masked softmax in jax.numpy, float32) runs everywhere and is the oracle for
any other: "bf16" attends the decode rows split-K with both dots' operands rounded to bfloat16
(float32 accumulation; only when named: `LLM(attention_backend="bf16")`); "pallas" attends every row, decode and
prefill, in one launch of the ragged Pallas kernel of tp_jax/models/paged_kernel.py (each row's blocks read where
they lie; Triton on a GPU, Mosaic on a TPU, Pallas' interpreter on a CPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from tp_jax.parallel.invariant import row_sum


def soft_cap(scores: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(scores / cap) (Gemma 2's attention logit soft-capping); the scores as they are when cap is None."""
    return scores if cap is None else jnp.tanh(scores / cap) * cap


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
              scale: float, window=None, heads_first: bool = False, dot_dtype=None,
              softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """softmax(q k^T * scale + mask) v -> [B, T, Hq * hv]; q_pos[B, T], k_pos[S] or [B, S].

    k[B, S, Hkv, hd] and v[B, S, Hkv, hv] (hv may differ from hd: MLA), or with `heads_first` [B, Hkv, S, .]
    (the pool's rows): the layout both dots batch over, so XLA feeds them k and v as they are (no transpose
    of S rows, only of q, the scores and the T output rows). `dot_dtype` (e.g. bfloat16): both dots' operands
    rounded to it, float32 accumulation and output (the softmax stays float32). `sinks[Hq]`: gpt-oss's learned
    per-head logit, one more term exp(sink) in each softmax denominator (a key with no value).
    """
    cast = (lambda x: x) if dot_dtype is None else (lambda x: x.astype(dot_dtype))
    b, t, hq, hd = q.shape
    hkv = k.shape[1 if heads_first else 2]
    kv = "bksd" if heads_first else "bskd"
    qg = q.reshape(b, t, hkv, hq // hkv, hd)
    scores = soft_cap(jnp.einsum(f"btkgd,{kv}->bkgts", cast(qg), cast(k), preferred_element_type=jnp.float32)
                      * scale, softcap)
    k_pos = k_pos if k_pos.ndim == 2 else k_pos[None]
    allowed = k_pos[:, None, :] <= q_pos[:, :, None]                             # [B, T, S]
    if window is not None:
        allowed &= k_pos[:, None, :] > q_pos[:, :, None] - window
    scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    else:                                                # the sink: one more logit per head, then dropped
        sink = jnp.broadcast_to(_head_sinks(sinks, hkv)[None, :, :, None, None], scores.shape[:-1] + (1,))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1].astype(v.dtype)
    wide = {} if dot_dtype is None else {"preferred_element_type": jnp.float32}
    if heads_first:
        out = jnp.einsum("bkgts,bksd->bkgtd", cast(probs), cast(v), **wide).transpose(0, 3, 1, 2, 4)
    else:
        out = jnp.einsum("bkgts,bskd->btkgd", cast(probs), cast(v), **wide)
    return out.reshape(b, t, hq * v.shape[-1])


def _head_sinks(sinks: jax.Array, hkv: int) -> jax.Array:
    """sinks[Hq] (local query heads) -> [Hkv, G] float32, the grouping of the scores."""
    return sinks.astype(jnp.float32).reshape(hkv, -1)


def _kv_scales(scales):
    """(k scale, v scale) of a layer's f32[2] float8 scales, or (None, None): none (1.0)."""
    return (None, None) if scales is None else (scales[0], scales[1])


def write_pool(pool: jax.Array, layer: jax.Array, slots: jax.Array, new: jax.Array, stored=None, scale=None):
    """pool[L, H, NB, bs, hd] with new[N, H, hd] written at layer `layer`, flat slots[N] (< 0: skipped). `stored`: the
    `KVQuant` whose bits the uint8 pool holds (`quantize_rows`); `scale`: the layer's per-tensor float8 scale."""
    num_blocks, block_size = pool.shape[2], pool.shape[3]
    slots = jnp.where(slots < 0, num_blocks * block_size, slots)               # out of range: dropped
    new = new.astype(pool.dtype) if stored is None else quantize_rows(new, stored.dtype, scale)
    return pool.at[layer, :, slots // block_size, slots % block_size].set(new, mode="drop")


def quantize_rows(x: jax.Array, dtype, scale=None) -> jax.Array:
    """x[..., hd] as a quantized pool stores it (tp_jax/models/cache.py KVQuant), uint8[..., hd (+ 2)]:

    * float8: the bits of x / scale (1.0 when None) saturated to the format's range (vLLM's cast);
    * int8: q = round(x / s) in [-127, 127], s = max|x| / 127 over the row in float16, its two bytes after the row's
      values (a zero row: s = 0, read back as zeros)."""
    bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8)                # noqa: E731
    x = x.astype(jnp.float32)
    if jnp.dtype(dtype) == jnp.int8:
        s = (jnp.abs(x).max(-1, keepdims=True) / 127).astype(jnp.float16)
        q = jnp.clip(jnp.round(x / jnp.where(s > 0, s, 1).astype(jnp.float32)), -127, 127).astype(jnp.int8)
        return jnp.concatenate([bits(q), bits(s[..., 0])], axis=-1)
    big = float(jnp.finfo(dtype).max)
    return bits(jnp.clip(x if scale is None else x / scale, -big, big).astype(dtype))


def dequantize_rows(rows: jax.Array, dtype, out_dtype, scale=None) -> jax.Array:
    """`quantize_rows`' uint8 rows[..., hd (+ 2)] read back as x[..., hd] in `out_dtype`."""
    if jnp.dtype(dtype) == jnp.int8:
        q = jax.lax.bitcast_convert_type(rows[..., :-2], jnp.int8)
        s = jax.lax.bitcast_convert_type(rows[..., -2:], jnp.float16)
        return (q.astype(jnp.float32) * s.astype(jnp.float32)[..., None]).astype(out_dtype)
    x = jax.lax.bitcast_convert_type(rows, dtype)
    return x.astype(out_dtype) if scale is None else (x.astype(jnp.float32) * scale).astype(out_dtype)


def gather_rows(pool: jax.Array, layer: jax.Array, tables: jax.Array, dtype=None, stored=None, scale=None):
    """The context of each row, head-major: pool[layer, :, tables[R, W]] -> [R, H, W * bs, hd], in `dtype` (a
    quantized cache's uint8 pool (`stored`, the `KVQuant`; `scale` the layer's float8 scale) read back into the
    activations' dtype; a pool already in it: no conversion).

    One gather of whole blocks, each a contiguous [bs, hd] tile: rows of the pool seen as
    [L * H * NB, bs * hd] (a free reshape), which XLA's CPU gather copies about twice as fast as
    the same tiles indexed by (layer, head, block). No transpose follows: this is the layout the
    dots batch over."""
    num_layers, h, num_blocks, bs, hd = pool.shape
    tiles = pool.reshape(num_layers * h * num_blocks, bs * hd)
    index = (layer * h + jnp.arange(h)[None, :, None]) * num_blocks + tables[:, None, :]        # [R, H, W]
    rows = jnp.take(tiles, index, axis=0, mode="clip")                         # block ids are in range
    rows = rows.reshape(tables.shape[0], h, tables.shape[1] * bs, hd)
    if stored is not None:
        return dequantize_rows(rows, stored.dtype, dtype, scale)
    return rows if dtype is None or rows.dtype == dtype else rows.astype(dtype)


def split_decode(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array, positions: jax.Array,
                 batch, scale: float, window, dot_dtype=None, softcap: float | None = None, stored=None,
                 sinks: jax.Array | None = None, v_dim: int | None = None, scales=None) -> jax.Array:
    """The D decode rows' attention -> [D, Hq * hd], split-K over the batch's chunks (flash-decoding).

    Each chunk (a virtual row: `chunk_tables`, `chunk_row`, `chunk_start`) attends its row's query to
    its Cb blocks alone, keeping its softmax partials: the max m, the sum l of exp(s - m) and the
    unnormalized output o. A row combines its chunks with M = max m: out = sum(o e^(m-M)) / sum(l e^(m-M)).
    Only a row's used blocks are read, not its bucketed table width.
    A chunk with no visible key (padding, or wholly outside a sliding window) has m = -inf and weight 0.
    `dot_dtype`: both dots' operands rounded to it, float32 accumulation (as in `attention`). `sinks[Hq]`: one
    more exp(sink - M) in each row's denominator. `v_dim`: the values are the first v_dim channels of the keys
    (MLA's latent cache; `v_pool` is not read). `stored`, `scales`: a quantized pool's format and the layer's
    (k, v) float8 scales (`gather_rows`)."""
    cast = (lambda x: x) if dot_dtype is None else (lambda x: x.astype(dot_dtype))
    d, rv = batch.decode_tables.shape[0], batch.chunk_tables.shape[0]
    hq, hd = q.shape[1:]
    hkv = k_pool.shape[1]
    row = batch.chunk_row
    k_scale, v_scale = _kv_scales(scales)
    k = gather_rows(k_pool, layer, batch.chunk_tables, q.dtype, stored, k_scale)          # [Rv, Hkv, S, hd]
    v = k[..., :v_dim] if v_dim is not None else gather_rows(v_pool, layer, batch.chunk_tables, q.dtype, stored,
                                                             v_scale)
    q_rows = jnp.take(q[:d], row, axis=0, mode="fill", fill_value=0).reshape(rv, hkv, hq // hkv, hd)
    q_pos = jnp.take(positions[:d], row, axis=0, mode="fill", fill_value=-1)    # padding sees no key
    k_pos = batch.chunk_start[:, None] + jnp.arange(k.shape[2])                 # [Rv, S]
    allowed = k_pos <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos > q_pos[:, None] - window
    scores = soft_cap(jnp.einsum("rkgd,rksd->rkgs", cast(q_rows), cast(k), preferred_element_type=jnp.float32)
                      * scale, softcap)
    scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
    m = scores.max(-1)                                                           # [Rv, Hkv, G]
    seen = jnp.isfinite(m)
    p = jnp.exp(scores - jnp.where(seen, m, 0)[..., None])
    o = jnp.einsum("rkgs,rksd->rkgd", cast(p), cast(v), preferred_element_type=jnp.float32)
    top = jax.ops.segment_max(m, row, num_segments=d + 1, indices_are_sorted=True)
    if sinks is not None:
        top = jnp.maximum(top, _head_sinks(sinks, hkv))
    w = jnp.where(seen, jnp.exp(m - top[row]), 0.0)
    num = jax.ops.segment_sum(o * w[..., None], row, num_segments=d + 1, indices_are_sorted=True)[:d]
    den = jax.ops.segment_sum(p.sum(-1) * w, row, num_segments=d + 1, indices_are_sorted=True)[:d]
    if sinks is not None:
        den = den + jnp.exp(_head_sinks(sinks, hkv) - top[:d])
    return (num / den[..., None]).reshape(d, hq * v.shape[-1]).astype(q.dtype)


FULL_WINDOW = 1 << 30   # a per-layer window table's entry for a global layer: every earlier key is seen

KEY_CHUNK = 32          # keys per softmax partial in `chunked_attention` (a fixed size: see its docstring)


def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, scale: float,
                      window=None, dot_dtype=None, softcap: float | None = None,
                      sinks: jax.Array | None = None, k_pos: jax.Array | None = None, with_lse: bool = False):
    """Rows attending their own context, batch-invariantly: q[R, T, Hq, hd] at positions q_pos[R, T] over
    k/v[R, Hkv, S, hd] (the row's positions 0..S-1, heads-first as `gather_rows` gives them) -> [R, T, Hq * hd].

    The keys are taken KEY_CHUNK at a time: each chunk's scores, max m, sum l of exp(s - m) and unnormalized
    output o come from dots of one fixed shape, and the chunks are combined in position order (the online
    softmax of flash attention: M = max(m0, m1); l = l0 e^(m0-M) + l1 e^(m1-M); o likewise). A chunk a query
    cannot see (past its position, outside its window, the step's padding) has m = -inf and changes
    nothing, bit for bit, so a query's numbers depend on its own row's keys alone, never on the width the
    step's longest row gives S, nor on the other rows or queries of the step (XLA:CPU's batched dots of a
    fixed per-batch shape sum alike whatever the batch: tests/test_paged_attention.py).
    `dot_dtype`: both dots' operands rounded to it, float32 accumulation. v[R, Hkv, S, hv] may be narrower than
    k (MLA). `sinks[Hq]`: the combine starts from the sink, a partial with m = sink, l = 1 and o = 0.
    `k_pos[S]`: the keys' positions when they are not 0..S-1 (a decode context parallel rank's share of the
    context: tp_jax/models/dcp.py); `with_lse`: also return each query's log-sum-exp of its scores [R, T, Hq]
    (-inf: no key seen), for a combine with other partial outputs."""
    cast = (lambda x: x) if dot_dtype is None else (lambda x: x.astype(dot_dtype))
    r, t, hq, hd = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if s % KEY_CHUNK:                                         # pad to whole chunks: the padding is never seen
        pad = ((0, 0), (0, 0), (0, KEY_CHUNK - s % KEY_CHUNK), (0, 0))
        if k_pos is not None:
            k_pos = jnp.pad(k_pos, (0, KEY_CHUNK - s % KEY_CHUNK), constant_values=FULL_WINDOW)
        k, v, s = jnp.pad(k, pad), jnp.pad(v, pad), s + KEY_CHUNK - s % KEY_CHUNK
    k_pos = jnp.arange(s) if k_pos is None else k_pos
    c, g, hv = s // KEY_CHUNK, hq // hkv, v.shape[-1]
    kc, vc = k.reshape(r, hkv, c, KEY_CHUNK, hd), v.reshape(r, hkv, c, KEY_CHUNK, hv)
    qg = q.reshape(r, t, hkv, g, hd)
    qc = jnp.broadcast_to(qg.transpose(0, 2, 3, 1, 4)[:, :, None], (r, hkv, c, g, t, hd))   # c a batch dim of
    scores = soft_cap(jnp.einsum("rkcgtd,rkcsd->rkcgts", cast(qc), cast(kc),         # both dots: each chunk's
                                 preferred_element_type=jnp.float32) * scale, softcap)  # dot has one fixed shape
    k_pos = k_pos.reshape(c, KEY_CHUNK)
    allowed = k_pos[None, :, None, :] <= q_pos[:, None, :, None]                     # [R, C, T, chunk]
    if window is not None:
        allowed &= k_pos[None, :, None, :] > q_pos[:, None, :, None] - window
    scores = jnp.where(allowed[:, None, :, None], scores, -jnp.inf)                  # [R, Hkv, C, G, T, chunk]
    m = scores.max(-1)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0)[..., None])
    o = jnp.einsum("rkcgts,rkcsd->rkcgtd", cast(p), cast(vc), preferred_element_type=jnp.float32)

    def combine(acc, part):
        (m0, l0, o0), (m1, l1, o1) = acc, part
        top = jnp.maximum(m0, m1)
        base = jnp.where(jnp.isfinite(top), top, 0)
        a, b = jnp.exp(m0 - base), jnp.exp(m1 - base)
        return (top, l0 * a + l1 * b, o0 * a[..., None] + o1 * b[..., None]), None

    stats = m.shape[:2] + m.shape[3:]                                                # [R, Hkv, G, T]
    first = (jnp.full(stats, -jnp.inf), jnp.zeros(stats), jnp.zeros(o.shape[:2] + o.shape[3:]))
    if sinks is not None:
        first = (jnp.broadcast_to(_head_sinks(sinks, hkv)[None, :, :, None], stats), jnp.ones(stats), first[2])
    (top, l, o), _ = jax.lax.scan(combine, first, (jnp.moveaxis(m, 2, 0), jnp.moveaxis(row_sum(p), 2, 0),
                                                   jnp.moveaxis(o, 2, 0)))
    out = o / jnp.where(l > 0, l, 1)[..., None]                                     # [R, Hkv, G, T, hv]
    out = out.transpose(0, 3, 1, 2, 4).reshape(r, t, hq * hv).astype(q.dtype)
    if not with_lse:
        return out
    lse = jnp.where(l > 0, top + jnp.log(jnp.where(l > 0, l, 1)), -jnp.inf)         # [R, Hkv, G, T]
    return out, lse.transpose(0, 3, 1, 2).reshape(r, t, hq)


def paged_reference(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array, positions: jax.Array,
                    batch, scale: float, window, softcap: float | None = None, sinks: jax.Array | None = None,
                    v_dim: int | None = None, stored=None, scales=None) -> jax.Array:
    """q[N, Hq, hd] (decode rows first, then packed prefill tokens) over the pool -> [N, Hq * hd], float32.

    `batch`: one micro-batch's PagedBatch (tp_jax/models/cache.py); prefill_index[P, T] the flat token of each
    prefill row slot (N for padding). Every row reads its whole block table, attended in fixed-size key
    chunks (`chunked_attention`): a row's numbers never depend on the rest of the step. `sinks[Hq]`: gpt-oss's
    per-head sink logits; `v_dim`: the values are the keys' first v_dim channels (MLA's latent pool, v_pool unread);
    `stored`: the `KVQuant` whose bits a uint8 pool holds (`kv_cache_dtype`), `scales` f32[2] the layer's (k, v)
    float8 scales (checkpoint scales; None: 1.0).
    """
    return _paged(q, k_pool, v_pool, layer, positions, batch, scale, window,
                  functools.partial(_chunked, softcap=softcap, sinks=sinks), v_dim=v_dim, stored=stored,
                  scales=scales)


def _chunked(q, k, v, q_pos, k_pos, scale, window, softcap=None, sinks=None):
    """`chunked_attention` with `attention`'s signature (k_pos: the pool rows' positions 0..S-1)."""
    return chunked_attention(q, k, v, q_pos, scale, window, softcap=softcap, sinks=sinks)


def _paged(q, k_pool, v_pool, layer, positions, batch, scale, window, attend_fn, decode_fn=None, v_dim=None,
           stored=None, scales=None):
    d, p = batch.decode_tables.shape[0], batch.prefill_tables.shape[0]
    n, hq, hd = q.shape
    hv = hd if v_dim is None else v_dim
    k_scale, v_scale = _kv_scales(scales)

    def gather(tables):
        k = gather_rows(k_pool, layer, tables, q.dtype, stored, k_scale)
        return k, (k[..., :v_dim] if v_dim is not None else gather_rows(v_pool, layer, tables, q.dtype, stored,
                                                                        v_scale))

    out = jnp.zeros((n, hq * hv), q.dtype)
    if d and decode_fn is not None and batch.chunk_tables.shape[0]:          # no chunks: short tables, full width
        out = out.at[:d].set(decode_fn(q, k_pool, v_pool, layer, positions, batch, scale, window))
    elif d:
        k, v = gather(batch.decode_tables)
        dec = attend_fn(q[:d, None], k, v, positions[:d, None], jnp.arange(k.shape[2]), scale, window)[:, 0]
        out = out.at[:d].set(dec)
    if p:
        k, v = gather(batch.prefill_tables)
        q_rows = jnp.take(q, batch.prefill_index, axis=0, mode="fill", fill_value=0)          # [P, T, Hq, hd]
        pos_rows = jnp.take(positions, batch.prefill_index, axis=0, mode="fill", fill_value=0)
        pre = attend_fn(q_rows, k, v, pos_rows, jnp.arange(k.shape[2]), scale, window)  # [P, T, Hq * hd]
        out = out.at[batch.prefill_index].set(pre, mode="drop")
    return out


def paged_bf16(q, k_pool, v_pool, layer, positions, batch, scale, window, softcap=None, sinks=None, v_dim=None,
               stored=None, scales=None):
    """`paged_reference` with the decode rows split-K (`split_decode`) and both dots' operands in bfloat16,
    float32 accumulation: on a CPU with AMX XLA's batched bf16 dots run faster than its float32 ones
    (docs/performance.md)."""
    return _paged(q, k_pool, v_pool, layer, positions, batch, scale, window,
                  functools.partial(attention, heads_first=True, dot_dtype=jnp.bfloat16, softcap=softcap,
                                    sinks=sinks),
                  functools.partial(split_decode, dot_dtype=jnp.bfloat16, softcap=softcap, sinks=sinks,
                                    v_dim=v_dim, stored=stored, scales=scales), v_dim=v_dim, stored=stored,
                  scales=scales)


def paged_pallas(q, k_pool, v_pool, layer, positions, batch, scale, window, softcap=None, sinks=None, v_dim=None,
                 stored=None, scales=None, form: str | None = None):
    """`paged_reference` by the Pallas kernel (tp_jax/models/paged_kernel.py), one launch for the step's decode rows
    and prefill chunks: each row's blocks read where they lie, no gathered copy (Triton on a GPU, Mosaic on a TPU,
    Pallas' interpreter on a CPU). A prefill chunk's T queries go as T / QB blocks of QB queries (`query_block`, a
    property of the model), each with its chunk's table. A float8 pool's bits are read in the kernel, its per-layer
    scales folded into the queries (keys) and the output (values); an int8 pool (per-row scales), and on Triton head
    widths that are not powers of two (Phi-3's 96, tiny test models: `covers`), are left to the reference.
    `form`: the kernel's "triton" or "mosaic" form (None: the platform's; Triton's off a TPU)."""
    from tp_jax.models.paged_kernel import covers, paged_attention, query_block
    form = form or ("mosaic" if jax.default_backend() == "tpu" else "triton")
    int8 = stored is not None and jnp.dtype(stored.dtype) == jnp.int8
    if int8 or not covers(form, q.shape[-1], v_pool.shape[-1], v_dim):
        return paged_reference(q, k_pool, v_pool, layer, positions, batch, scale, window, softcap=softcap,
                               sinks=sinks, v_dim=v_dim, stored=stored, scales=scales)
    n, hq, _ = q.shape
    d, p, rv = batch.decode_tables.shape[0], batch.prefill_tables.shape[0], batch.chunk_tables.shape[0]
    split = bool(d and rv)                         # the decode rows as their split-K chunks (`SPLIT_K_BACKENDS`)
    qb = 1 if not p else query_block(hq // k_pool.shape[1], form)
    pad = lambda x: jnp.pad(x[:, None], ((0, 0), (0, qb - 1)), constant_values=n)           # noqa: E731
    if split:
        index, tables = [pad(jnp.where(batch.chunk_row < d, batch.chunk_row, n))], [batch.chunk_tables]
        starts = [batch.chunk_start]
    else:
        index, tables = [pad(jnp.arange(d, dtype=jnp.int32))], [batch.decode_tables]
        starts = [jnp.zeros((d,), jnp.int32)]
    if p:
        t = batch.prefill_index.shape[1]
        rows = jnp.pad(batch.prefill_index, ((0, 0), (0, -t % qb)), constant_values=n)
        index.append(rows.reshape(-1, qb))
        tables.append(jnp.repeat(batch.prefill_tables, rows.shape[1] // qb, axis=0))
        starts.append(jnp.zeros((index[-1].shape[0],), jnp.int32))
    width = max(x.shape[1] for x in tables)
    tables = jnp.concatenate([jnp.pad(x, ((0, 0), (0, width - x.shape[1]))) for x in tables])
    index = jnp.concatenate(index)                                                     # [R, QB]: N for padding
    q_rows = jnp.take(q, index, axis=0, mode="fill", fill_value=0)
    q_pos = jnp.take(positions, index, axis=0, mode="fill", fill_value=-1)
    k_scale, v_scale = _kv_scales(scales)
    if k_scale is not None:                       # a float8 cache's key scale: q . (k s) = (q s) . k
        q_rows = q_rows.astype(jnp.float32) * k_scale
    out = paged_attention(q_rows, k_pool, v_pool, layer, q_pos, tables, scale, window, softcap, sinks, v_dim,
                          decode_rows=starts[0].shape[0], key_start=jnp.concatenate(starts),
                          chunk_keys=batch.chunk_tables.shape[1] * k_pool.shape[3] if split else None,
                          kv_format=None if stored is None else stored.dtype, form=form)
    out, lse = out if split else (out, None)
    if v_scale is not None:                       # and its value scale: sum p (v s) = s sum p v
        out = out * (k_scale if v_dim is not None else v_scale)
    hv = out.shape[-1] // hq
    flat = out.reshape(-1, hq * hv)
    if split:                                     # the first Rv rows are chunks: not scattered, combined below
        index = index.at[:rv].set(n)
    result = jnp.zeros((n, hq * hv), q.dtype).at[index.reshape(-1)].set(flat.astype(q.dtype), mode="drop")
    if split:
        chunks = out[:rv, 0].reshape(rv, hq, hv).astype(jnp.float32)
        result = result.at[:d].set(_combine_chunks(chunks, lse[:rv], batch.chunk_row, d, sinks).astype(q.dtype))
    return result


def _combine_chunks(out: jax.Array, lse: jax.Array, row: jax.Array, d: int, sinks) -> jax.Array:
    """Each decode row's output from its chunks' normalized outputs out[Rv, Hq, hv] and log-sum-exps lse[Rv, Hq]
    (chunk_row `row`; d: padding): sum_c e^(lse_c - M) out_c / (sum_c e^(lse_c - M) (+ e^(sink - M))), M the row's
    largest -> [D, Hq * hv]."""
    top = jax.ops.segment_max(lse, row, num_segments=d + 1, indices_are_sorted=True)
    if sinks is not None:
        top = jnp.maximum(top, sinks.astype(jnp.float32)[None])
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lse - top[row])                                                  # -inf: a chunk that saw nothing
    num = jax.ops.segment_sum(out * w[..., None], row, num_segments=d + 1, indices_are_sorted=True)[:d]
    den = jax.ops.segment_sum(w, row, num_segments=d + 1, indices_are_sorted=True)[:d]
    if sinks is not None:
        den = den + jnp.exp(sinks.astype(jnp.float32)[None] - top[:d])
    return (num / jnp.where(den > 0, den, 1.0)[..., None]).reshape(d, -1)


PAGED_BACKENDS: dict[str, Callable] = {"reference": paged_reference, "bf16": paged_bf16, "pallas": paged_pallas}
SPLIT_K_BACKENDS = {"bf16": 32, "pallas": 512}   # positions of the decode rows' split-K chunks they read (build_batch)


def attend(q: jax.Array, k: jax.Array, v: jax.Array | None, positions: jax.Array, cache=None, *, scale: float,
           window=None, softcap: float | None = None, sinks: jax.Array | None = None, v_dim: int | None = None):
    """Attention of q[B, T, Hq, hd] over k/v[B, T, Hkv, hd] (cache None) or over the paged pool.

    Returns (out[B, T, Hq * hv], cache), the cache with this step's k and v written (at the layer's pool slot
    `cache.layer`; with KV cache groups through its group's slots and tables, so every backend reads one table
    per row). `window`: None, an int,
    or a traced int32 (a layer's own window in a stack whose layers differ; `FULL_WINDOW`: none).
    `softcap`: Gemma 2's attention logit soft-capping (`soft_cap`); `sinks[Hq]`: gpt-oss's per-head sink logits;
    `v_dim`: v is None and the values are k's first v_dim channels (MLA's latent: only k is cached). Each is
    passed to the backend only when set, so a backend without it still registers.
    """
    if v_dim is not None:
        v = k[..., :v_dim]
    if cache is not None and cache.dcp > 1:       # latent attention attends a split pool through models/dcp.py
        raise ValueError("decode_context_parallel_size > 1 splits only a latent (MLA) cache; use "
                         "decode_context_parallel_size=1 for this model")
    if cache is None:
        return attention(q, k, v, positions, positions, scale, window, softcap=softcap, sinks=sinks), None
    impl = PAGED_BACKENDS[cache.backend]
    batch = cache.batch if cache.group is None else cache.batch.kv_group(cache.group)     # its group's tables
    k_pool, v_pool, outs = cache.k, cache.v, []
    extra = {name: value for name, value in (("softcap", softcap), ("sinks", sinks), ("v_dim", v_dim),
                                             ("stored", cache.stored), ("scales", cache.scales)) if value is not None}
    k_scale, v_scale = _kv_scales(cache.scales)
    for b in range(q.shape[0]):                    # B is 1 inside the pipeline (one micro-batch)
        k_pool = write_pool(k_pool, cache.layer, batch.slots[b], k[b], cache.stored, k_scale)
        if v_dim is None:
            v_pool = write_pool(v_pool, cache.layer, batch.slots[b], v[b], cache.stored, v_scale)
        outs.append(impl(q[b], k_pool, v_pool, cache.layer, positions[b], batch.row(b), scale, window, **extra))
    return jnp.stack(outs), cache.replace(k=k_pool, v=v_pool)
