"""Paged decode attention as a Pallas kernel: each decode row's query heads over its own blocks, read through its
block table where they lie in the pool, with no gathered copy of the context.

One program per (decode row, KV head) reads the row's blocks PAGES_PER_STEP at a time, only those its window and
length reach (the loop's bounds come from the row itself), and keeps an online softmax (the running max, the sum
of exponentials and the unnormalized output; flash attention's recurrence), so a row's numbers depend on its own
blocks alone: batch-invariant by construction. It covers GQA groups, a per-layer sliding window (an int or a
traced per-layer value), Gemma 2's logit soft-capping and gpt-oss's sinks (the recurrence starts from the sink: m =
sink, l = 1, o = 0). MLA's latent pool and a float8 pool are left to the reference (`paged_pallas` falls back).

Two forms of one algorithm. `paged_decode`, Pallas on Triton (GPU): the query heads of a KV head are padded to a
multiple of 16 (Triton's smallest dot) and the pool's blocks are read by row (`layer * kv_heads + head`) and block
id. `paged_decode_tpu`, Pallas on Mosaic (TPU): the pool stays in HBM and each loop step copies the row's next pages
into VMEM by DMA, the block table scalar-prefetched into SMEM. On a CPU both run in Pallas' interpreters, which is
how tests/test_paged_kernel.py checks them against the reference; it lowers them for `cuda` and `tpu` too. JAX's own
`pallas.ops.gpu.paged_attention` takes one layer's pool, which would be a copy of the layer's whole pool out of
tp_jax's stacked one per step, and has no window or sinks: hence this kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pl_triton

PAGES_PER_STEP = 4      # blocks a program reads per loop step (one [PAGES_PER_STEP * block_size, hd] tile of keys)
HEAD_TILE = 16          # query heads of a KV head padded to a multiple of this (Triton's smallest dot dimension)
NO_WINDOW = 1 << 30


def _attend_row(q, sinks, length, window, load, *, scale: float, softcap: float | None, span: int, hv: int):
    """One row's query heads q[G, hd] (float32) over its keys, `span` at a time: `load(c)` gives step c's k, v
    [span, hd] in float32. The loop runs over the steps its window and length reach; returns [G, hv]."""
    g = q.shape[0]

    def step(c, carry):
        m, l, o = carry
        k, v = load(c)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        pos = c * span + jax.lax.broadcasted_iota(jnp.int32, (g, span), 1)
        s = jnp.where((pos < length) & (pos > length - 1 - window), s, -jnp.inf)
        top = jnp.maximum(m, s.max(axis=1))
        base = jnp.where(jnp.isfinite(top), top, 0.0)
        a, p = jnp.exp(m - base), jnp.exp(s - base[:, None])
        return top, l * a + p.sum(axis=1), o * a[:, None] + jnp.dot(p, v, preferred_element_type=jnp.float32)

    if sinks is None:
        start = (jnp.full((g,), -jnp.inf, jnp.float32), jnp.zeros((g,), jnp.float32))
    else:
        start = (sinks.reshape(g).astype(jnp.float32), jnp.ones((g,), jnp.float32))
    first = jnp.maximum(length - window, 0) // span                 # the first step whose keys the window reaches
    _, l, o = jax.lax.fori_loop(first, (length + span - 1) // span, step, (*start, jnp.zeros((g, hv), jnp.float32)))
    return o / jnp.where(l > 0, l, 1.0)[:, None]


def _decode_kernel(layer_ref, window_ref, lengths_ref, tables_ref, q_ref, k_ref, v_ref, sinks_ref, o_ref, *,
                   scale: float, softcap: float | None, kv_heads: int, block_size: int):
    row, head = pl.program_id(0), pl.program_id(1)
    pool_row = layer_ref[0] * kv_heads + head
    span = PAGES_PER_STEP * block_size

    def load(c):
        pages = tables_ref[pl.ds(c * PAGES_PER_STEP, PAGES_PER_STEP)]
        return (k_ref[pool_row, pages].reshape(span, -1).astype(jnp.float32),
                v_ref[pool_row, pages].reshape(span, -1).astype(jnp.float32))

    o_ref[...] = _attend_row(q_ref[...].astype(jnp.float32), None if sinks_ref is None else sinks_ref[...],
                             lengths_ref[row], window_ref[0], load, scale=scale, softcap=softcap, span=span,
                             hv=v_ref.shape[-1]).astype(o_ref.dtype)


def paged_decode(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array, lengths: jax.Array,
                 tables: jax.Array, scale: float, window=None, softcap: float | None = None,
                 sinks: jax.Array | None = None, interpret: bool | None = None) -> jax.Array:
    """q[D, Hq, hd] (one query per decode row) over k/v_pool[L, Hkv, NB, bs, hd] at stacked layer `layer`, each row
    the first lengths[D] positions of its block table tables[D, W] -> [D, Hq * hd] in q's dtype. `window`: None, an
    int or a traced int32; `sinks[Hq]`. `interpret`: None = on a CPU."""
    d, hq, hd = q.shape
    num_layers, hkv, nb, bs, _ = k_pool.shape
    g = hq // hkv
    gp = -(-g // HEAD_TILE) * HEAD_TILE
    w = tables.shape[1]
    tables = jnp.pad(tables, ((0, 0), (0, -w % PAGES_PER_STEP)))
    qg = jnp.pad(q.reshape(d, hkv, g, hd), ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    sink_arg = None if sinks is None else jnp.pad(sinks.reshape(hkv, g), ((0, 0), (0, gp - g)),
                                                  constant_values=-jnp.inf)
    window = jnp.full((1,), NO_WINDOW if window is None else window, jnp.int32)
    pools = [x.reshape(num_layers * hkv, nb, bs, x.shape[-1]) for x in (k_pool, v_pool)]
    whole = lambda x: pl.BlockSpec(x.shape, lambda i, j: (0,) * x.ndim)          # noqa: E731
    kernel = functools.partial(_decode_kernel, scale=scale, softcap=softcap, kv_heads=hkv, block_size=bs)
    if sink_arg is None:
        kernel = functools.partial(_no_sinks, kernel)
    args = [jnp.reshape(layer, (1,)).astype(jnp.int32), window, lengths.astype(jnp.int32), tables, qg, *pools]
    specs = [whole(args[0]), whole(window), whole(args[2]),
             pl.BlockSpec((None, tables.shape[1]), lambda i, j: (i, 0)),
             pl.BlockSpec((None, None, gp, hd), lambda i, j: (i, j, 0, 0)), whole(pools[0]), whole(pools[1])]
    if sink_arg is not None:
        args.append(sink_arg)
        specs.append(pl.BlockSpec((None, gp), lambda i, j: (j, 0)))
    hv = v_pool.shape[-1]
    out = pl.pallas_call(
        kernel, grid=(d, hkv), in_specs=specs,
        out_specs=pl.BlockSpec((None, None, gp, hv), lambda i, j: (i, j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((d, hkv, gp, hv), q.dtype),
        interpret=jax.default_backend() == "cpu" if interpret is None else interpret,
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),       # Pallas on Triton
        cost_estimate=cost(d, hkv, g, tables.shape[1], bs, hd, hv, q.dtype, k_pool.dtype),
        name="tp_jax_paged_decode")(*args)
    return out[:, :, :g].reshape(d, hq * hv)


def cost(d: int, hkv: int, g: int, width: int, bs: int, hd: int, hv: int, q_dtype, kv_dtype) -> pl.CostEstimate:
    """What a launch reads and writes at most: every row's whole table of K and V pages once (a row reads only the
    pages its length and window reach: an upper bound), its queries and its output; two dots per key and head."""
    import numpy as np
    keys = d * hkv * width * bs
    kv_bytes = keys * (hd + hv) * np.dtype(kv_dtype).itemsize
    qo_bytes = d * hkv * g * (hd + hv) * np.dtype(q_dtype).itemsize
    return pl.CostEstimate(flops=2 * keys * g * (hd + hv), transcendentals=keys * g,
                           bytes_accessed=int(kv_bytes + qo_bytes + d * width * 4))


def _no_sinks(kernel, layer_ref, window_ref, lengths_ref, tables_ref, q_ref, k_ref, v_ref, o_ref):
    kernel(layer_ref, window_ref, lengths_ref, tables_ref, q_ref, k_ref, v_ref, None, o_ref)


# --- the TPU (Mosaic) form: the pool stays in HBM, a row's pages are copied into VMEM by DMA ---------------------

def _tpu_decode_kernel(layer_ref, window_ref, lengths_ref, tables_ref, q_ref, k_hbm, v_hbm, sinks_ref, o_ref, k_buf,
                       v_buf, sems, *, scale: float, softcap: float | None, kv_heads: int, block_size: int,
                       width: int):
    row, head = pl.program_id(0), pl.program_id(1)
    pool_row = layer_ref[0] * kv_heads + head
    span = PAGES_PER_STEP * block_size

    def load(c):
        dmas = []
        for p in range(PAGES_PER_STEP):                              # one DMA per page, K and V
            page = tables_ref[row * width + c * PAGES_PER_STEP + p]
            dmas += [pltpu.make_async_copy(k_hbm.at[pool_row, page], k_buf.at[p], sems.at[0, p]),
                     pltpu.make_async_copy(v_hbm.at[pool_row, page], v_buf.at[p], sems.at[1, p])]
        for dma in dmas:
            dma.start()
        for dma in dmas:
            dma.wait()
        return k_buf[...].reshape(span, -1).astype(jnp.float32), v_buf[...].reshape(span, -1).astype(jnp.float32)

    o_ref[...] = _attend_row(q_ref[...].astype(jnp.float32), None if sinks_ref is None else sinks_ref[...],
                             lengths_ref[row], window_ref[0], load, scale=scale, softcap=softcap, span=span,
                             hv=v_buf.shape[-1]).astype(o_ref.dtype)


def paged_decode_tpu(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array, lengths: jax.Array,
                     tables: jax.Array, scale: float, window=None, softcap: float | None = None,
                     sinks: jax.Array | None = None, interpret: bool | None = None) -> jax.Array:
    """`paged_decode` for a TPU (Pallas on Mosaic): the pool stays in HBM (`pl.ANY`); each loop step copies the
    row's next PAGES_PER_STEP pages of its KV head into VMEM by DMA (by table entry, no gathered copy), then
    attends them. The block table, lengths, layer and window are scalar-prefetched into SMEM. `interpret`: None =
    on a CPU, in Pallas' TPU interpreter."""
    d, hq, hd = q.shape
    num_layers, hkv, nb, bs, _ = k_pool.shape
    g, hv = hq // hkv, v_pool.shape[-1]
    gp = -(-g // 8) * 8                                               # sublanes
    tables = jnp.pad(tables, ((0, 0), (0, -tables.shape[1] % PAGES_PER_STEP)))
    width = tables.shape[1]
    qg = jnp.pad(q.reshape(d, hkv, g, hd), ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    pools = [x.reshape(num_layers * hkv, nb, bs, x.shape[-1]) for x in (k_pool, v_pool)]
    scalars = [jnp.reshape(layer, (1,)).astype(jnp.int32), jnp.full((1,), NO_WINDOW if window is None else window,
               jnp.int32), lengths.astype(jnp.int32), tables.reshape(-1).astype(jnp.int32)]
    in_specs = [pl.BlockSpec((None, None, gp, hd), lambda i, j, *_: (i, j, 0, 0)),
                pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
    args = [qg, *pools]
    kernel = functools.partial(_tpu_decode_kernel, scale=scale, softcap=softcap, kv_heads=hkv, block_size=bs,
                               width=width)
    if sinks is None:
        kernel = functools.partial(_tpu_no_sinks, kernel)
    else:
        args.append(jnp.pad(sinks.reshape(hkv, 1, g), ((0, 0), (0, 0), (0, gp - g)), constant_values=-jnp.inf))
        in_specs.append(pl.BlockSpec((None, 1, gp), lambda i, j, *_: (j, 0, 0)))     # Mosaic: whole last two dims
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars), grid=(d, hkv), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, gp, hv), lambda i, j, *_: (i, j, 0, 0)),
        scratch_shapes=[pltpu.VMEM((PAGES_PER_STEP, bs, hd), k_pool.dtype),
                        pltpu.VMEM((PAGES_PER_STEP, bs, hv), v_pool.dtype),
                        pltpu.SemaphoreType.DMA((2, PAGES_PER_STEP))])
    interpret = jax.default_backend() == "cpu" if interpret is None else interpret
    out = pl.pallas_call(kernel, grid_spec=grid, out_shape=jax.ShapeDtypeStruct((d, hkv, gp, hv), q.dtype),
                         interpret=pltpu.InterpretParams() if interpret else False,
                         cost_estimate=cost(d, hkv, g, width, bs, hd, hv, q.dtype, k_pool.dtype),
                         name="tp_jax_paged_decode_tpu")(*scalars, *args)
    return out[:, :, :g].reshape(d, hq * hv)


def _tpu_no_sinks(kernel, layer_ref, window_ref, lengths_ref, tables_ref, q_ref, k_hbm, v_hbm, o_ref, *scratch):
    kernel(layer_ref, window_ref, lengths_ref, tables_ref, q_ref, k_hbm, v_hbm, None, o_ref, *scratch)
