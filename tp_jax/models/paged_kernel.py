"""Ragged paged attention as a Pallas kernel: one launch serves a step's decode rows and prefill chunks, each row's
queries over its own blocks, read through its block table where they lie in the pool, with no gathered copy.

A launch takes R rows of queries, q[R, QB, Hq, hd] at positions q_pos[R, QB] (-1: padding), each with its block
table. The first `decode_rows` rows are decode rows (one query, token 0); the others are prefill blocks of QB
queries of one prefill chunk (`paged_pallas` in tp_jax/models/attention.py cuts a step's chunks into blocks of
`query_block(G)` queries, so a row's tile never depends on the step). One program per (row, KV head) reads the
row's blocks PAGES_PER_STEP at a time, only those its queries' window and positions reach (the loop's bounds come
from the row itself), and keeps an online softmax per query (the running max, the sum of exponentials and the
unnormalized output; flash attention's recurrence). A decode row is attended with a tile of its G query heads, a
prefill block with QB x G: a row's numbers depend on its own blocks alone, bit for bit whatever else the launch
holds (a step of masked keys leaves a query's partials exactly as they were).

Long decode rows split over their context (flash-decoding): given `key_start` and `chunk_keys`, each decode row of a
launch is one chunk of a row's context (build_batch lays rows out in 512-position chunks) and the launch also
returns each chunk's log-sum-exp, which `paged_pallas` combines per row. It covers GQA groups, a per-layer sliding
window (an int or a traced per-layer value), Gemma 2's logit soft-capping, gpt-oss's sinks (the recurrence starts
from the sink: m = sink, l = 1, o = 0; a split row's sinks are added once, in the combine), MLA's latent pool (one KV
head whose values are the keys' first r channels; on Triton the scores are q_c . c + q_pe . k_pe, two dots of
power-of-two widths, as vLLM's MLA kernels split them) and float8 pools (`kv_format`: the bits bitcast, the scales
the caller's). An int8 pool (per-row scales) and, on Triton, widths that are not powers of two of at least 16
(`covers`) are left to the reference (`paged_pallas` falls back).

Two forms of one algorithm (`_attend_rows`). `form="triton"`, Pallas on Triton (GPU): the query heads of a KV head
are padded to a multiple of 16 (Triton's smallest dot) and the pool's blocks are read by row (`layer * kv_heads +
head`) and block id. `form="mosaic"`, Pallas on Mosaic (TPU): the pool stays in HBM and each loop step copies the
row's next pages into VMEM by DMA, the block tables scalar-prefetched into SMEM. On a CPU both run in Pallas'
interpreters, which is how tests/test_paged_kernel.py checks them against the reference; it lowers them for `cuda`
and `tpu` too. Why not a kept kernel: JAX's `pallas.ops.gpu.paged_attention` takes one layer's pool (a copy of the
layer's whole pool out of tp_jax's stacked one per step) and has no window, sinks or prefill rows; JAX's TPU
`ragged_paged_attention` reads one layer's combined [pages, page, heads x 2, hd] pool (per-layer pools and an
unrolled layer loop) and has no latent layout (docs/design.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pl_triton

PAGES_PER_STEP = 4      # blocks a program reads per loop step (one [PAGES_PER_STEP * block_size, hd] tile of keys)
HEAD_TILE = {"triton": 16, "mosaic": 8}   # query heads of a KV head padded to a multiple of this (Triton's smallest
#                                           dot dimension; a TPU's sublanes)
QUERY_TILE = 128        # rows (queries x padded heads) of a prefill block's tile, at most
NO_WINDOW = 1 << 30


def query_block(groups: int, form: str = "triton") -> int:
    """QB, the queries of one prefill block: QUERY_TILE rows of the tile over the padded query heads of a KV head
    (a power of two, at least 1). It depends on the model alone, never on the step."""
    gp = _padded(groups, form)
    return max(1, 1 << max(0, (QUERY_TILE // gp).bit_length() - 1))


def covers(form: str, head_dim: int, value_dim: int, v_dim: int | None = None) -> bool:
    """Whether the kernel's `form` takes these widths: Triton's loads and dots need power-of-two sizes of at least 16
    (a key part, the values; MLA's latent r and rotary width separately); Mosaic takes any."""
    if form != "triton":
        return True
    widths = (head_dim, value_dim) if v_dim is None else (v_dim, head_dim - v_dim)
    return all(w >= 16 and w & (w - 1) == 0 for w in widths)


def _padded(groups: int, form: str) -> int:
    tile = HEAD_TILE[form]
    return -(-groups // tile) * tile


def _attend_rows(q_parts, q_pos, lo, hi, start, steps: int, sinks, window, load, *, scale: float,
                 softcap: float | None, span: int, hv: int, key_limit: int | None = None):
    """M query rows over one row's keys, `span` at a time. q_parts: the queries [M, d_i] (float32), split as `load`
    splits the keys; q_pos[M, 1] each query's position (-1: none); lo, hi: the row's first and last valid query
    position + 1 bound the loop; start: the position of the row's first key (a decode chunk's), `steps` the most
    steps its table holds, `key_limit` (a chunk's) the positions its table covers before the padding to whole steps;
    `load(c)` gives step c's key parts [span, d_i] and values [span, hv] in float32; sinks[M] or None. Returns the
    output [M, hv] and the log-sum-exp [M] of each query's scores (-inf: none)."""
    m_rows = q_pos.shape[0]

    def step(c, carry):
        m, l, o = carry
        keys, v = load(c)
        s = None
        for qp, kp in zip(q_parts, keys):
            part = jax.lax.dot_general(qp, kp, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            s = part if s is None else s + part
        s = s * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        pos = start + c * span + jax.lax.broadcasted_iota(jnp.int32, (m_rows, span), 1)
        seen = (pos <= q_pos) & (pos > q_pos - window)
        if key_limit is not None:                                   # a chunk's padding pages belong to no key
            seen &= pos < start + key_limit
        s = jnp.where(seen, s, -jnp.inf)
        top = jnp.maximum(m, s.max(axis=1))
        base = jnp.where(jnp.isfinite(top), top, 0.0)
        a, p = jnp.exp(m - base), jnp.exp(s - base[:, None])
        return top, l * a + p.sum(axis=1), o * a[:, None] + jnp.dot(p, v, preferred_element_type=jnp.float32)

    if sinks is None:
        first_carry = (jnp.full((m_rows,), -jnp.inf, jnp.float32), jnp.zeros((m_rows,), jnp.float32))
    else:
        first_carry = (sinks.reshape(m_rows).astype(jnp.float32), jnp.ones((m_rows,), jnp.float32))
    first = jnp.maximum(lo + 1 - window - start, 0) // span         # the first step whose keys the window reaches
    end = jnp.minimum((hi - start + span - 1) // span, steps)
    m, l, o = jax.lax.fori_loop(first, end, step, (*first_carry, jnp.zeros((m_rows, hv), jnp.float32)))
    seen = l > 0
    return o / jnp.where(seen, l, 1.0)[:, None], jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def _rows(q_ref, pos_ref, sinks_ref, o_ref, lse_ref, lo, hi, start, steps, window, load, *, rows: int,
          decode_rows: int, parts, scale, softcap, span, hv, key_limit):
    """Run this program's row: a decode row (row < decode_rows) with a tile of its padded heads, a prefill block
    with QB of them; `parts` the (start, size) of each key part along hd. `lse_ref` (a launch of decode chunks,
    combined outside): the decode rows' log-sum-exps are written and their sinks left to the combine."""
    tokens, gp = q_ref.shape[0], q_ref.shape[1]

    def run(n, decode: bool):
        m = n * gp
        q = [(q_ref[0, :, pl.ds(a, b)] if n == 1 else q_ref[:, :, pl.ds(a, b)].reshape(m, b)).astype(jnp.float32)
             for a, b in parts]
        partial = lse_ref is not None and decode
        sinks = None if sinks_ref is None or partial else sinks_ref[0, pl.ds(0, m)]
        o, lse = _attend_rows(q, pos_ref[pl.ds(0, m), :], lo, hi, start, steps, sinks, window, load, scale=scale,
                              softcap=softcap, span=span, hv=hv, key_limit=key_limit if decode else None)
        if n == 1:
            o_ref[0] = o.astype(o_ref.dtype)
            if partial:
                lse_ref[0, pl.ds(0, m)] = lse
        else:
            o_ref[...] = o.reshape(n, gp, hv).astype(o_ref.dtype)

    if decode_rows == 0:
        run(tokens, False)
    elif tokens == 1 and decode_rows == rows:
        run(1, True)
    else:
        row = pl.program_id(0)
        pl.when(row < decode_rows)(lambda: run(1, True))
        pl.when(row >= decode_rows)(lambda: run(tokens, False))


def _values(x, kv_format):
    """A loaded tile of the pool in float32: a float8 cache's uint8 bits read as `kv_format` (its scale is applied
    outside the kernel: folded into the queries and the output)."""
    return (x if kv_format is None else jax.lax.bitcast_convert_type(x, kv_format)).astype(jnp.float32)


def _triton_kernel(layer_ref, window_ref, lo_ref, hi_ref, start_ref, tables_ref, q_ref, pos_ref, k_ref, v_ref,
                   sinks_ref, o_ref, lse_ref, *, kv_heads: int, block_size: int, v_dim: int | None, kv_format, **kw):
    row, head = pl.program_id(0), pl.program_id(1)
    pool_row = layer_ref[0] * kv_heads + head
    span = PAGES_PER_STEP * block_size
    hd = k_ref.shape[-1]

    def load(c):
        pages = tables_ref[pl.ds(c * PAGES_PER_STEP, PAGES_PER_STEP)]
        tile = lambda ref, a, b: _values(ref[pool_row, pages, :, pl.ds(a, b)].reshape(span, b), kv_format)  # noqa
        if v_dim is None:
            return [tile(k_ref, 0, hd)], tile(v_ref, 0, v_ref.shape[-1])
        latent = tile(k_ref, 0, v_dim)
        return [latent, tile(k_ref, v_dim, hd - v_dim)], latent

    steps = tables_ref.shape[0] // PAGES_PER_STEP
    _rows(q_ref, pos_ref, sinks_ref, o_ref, lse_ref, lo_ref[row], hi_ref[row], start_ref[row], steps, window_ref[0],
          load, span=span, **kw)


def _mosaic_kernel(layer_ref, window_ref, lo_ref, hi_ref, start_ref, tables_ref, q_ref, pos_ref, k_hbm, v_hbm,
                   sinks_ref, o_ref, lse_ref, k_buf, v_buf, sems, *, kv_heads: int, block_size: int,
                   v_dim: int | None, width: int, kv_format, **kw):
    row, head = pl.program_id(0), pl.program_id(1)
    pool_row = layer_ref[0] * kv_heads + head
    span = PAGES_PER_STEP * block_size

    def load(c):
        dmas = []
        for p in range(PAGES_PER_STEP):                              # one DMA per page, K and V
            page = tables_ref[row * width + c * PAGES_PER_STEP + p]
            dmas.append(pltpu.make_async_copy(k_hbm.at[pool_row, page], k_buf.at[p], sems.at[0, p]))
            if v_dim is None:
                dmas.append(pltpu.make_async_copy(v_hbm.at[pool_row, page], v_buf.at[p], sems.at[1, p]))
        for dma in dmas:
            dma.start()
        for dma in dmas:
            dma.wait()
        k = _values(k_buf[...].reshape(span, -1), kv_format)
        if v_dim is None:
            return [k], _values(v_buf[...].reshape(span, -1), kv_format)
        return [k], _values(k_buf[:, :, pl.ds(0, v_dim)].reshape(span, v_dim), kv_format)

    _rows(q_ref, pos_ref, sinks_ref, o_ref, lse_ref, lo_ref[row], hi_ref[row], start_ref[row],
          width // PAGES_PER_STEP, window_ref[0], load, span=span, **kw)


def paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array, q_pos: jax.Array,
                    tables: jax.Array, scale: float, window=None, softcap: float | None = None,
                    sinks: jax.Array | None = None, v_dim: int | None = None, decode_rows: int = 0,
                    key_start: jax.Array | None = None, chunk_keys: int | None = None, kv_format=None,
                    form: str = "triton", interpret: bool | None = None):
    """Rows of queries q[R, QB, Hq, hd] at positions q_pos[R, QB] (-1: padding) over k/v_pool[L, Hkv, NB, bs, hd] at
    stacked layer `layer`, each row its block table tables[R, W] -> [R, QB, Hq * hv] in q's dtype (padding queries:
    zeros or garbage, never read). The first `decode_rows` rows hold one query, at token 0 (a prefill block's QB is
    `query_block(G, form)`). `window`: None, an int or a traced int32; `sinks[Hq]`; `v_dim`: the values are the keys'
    first v_dim channels (MLA: v_pool unread). `key_start[R]`: the position of each row's first table entry (a decode
    row's split-K chunk; None: 0). `chunk_keys`: the decode rows are chunks of at most this many keys (their tables'
    first chunk_keys / block_size entries), combined by the caller: their sinks are left out and the launch returns
    (out, lse[R, Hq]), each decode query's log-sum-exp (-inf: no key seen). `kv_format`: a float8 dtype whose bits
    the uint8 pools hold (a float8 cache; its scales are the caller's: fold the key scale into q, the value scale
    into the output). `form`: "triton" (GPU) or "mosaic" (TPU). `interpret`: None = on a CPU, in Pallas' interpreter."""
    r, qb, hq, hd = q.shape
    num_layers, hkv, nb, bs, _ = k_pool.shape
    g = hq // hkv
    hv = v_pool.shape[-1] if v_dim is None else v_dim
    gp = _padded(g, form)
    partial = chunk_keys is not None
    tables = jnp.pad(tables, ((0, 0), (0, -tables.shape[1] % PAGES_PER_STEP))).astype(jnp.int32)
    width = tables.shape[1]
    q_pos = q_pos.astype(jnp.int32)
    valid = q_pos >= 0
    lo = jnp.where(valid, q_pos, NO_WINDOW).min(axis=1)
    hi = jnp.where(valid, q_pos + 1, 0).max(axis=1)
    key_start = jnp.zeros((r,), jnp.int32) if key_start is None else key_start.astype(jnp.int32)
    qg = jnp.pad(q.reshape(r, qb, hkv, g, hd), ((0, 0), (0, 0), (0, 0), (0, gp - g), (0, 0)))
    pos = jnp.broadcast_to(q_pos[:, :, None], (r, qb, gp)).reshape(r, qb * gp, 1)
    sink_arg = None if sinks is None else jnp.tile(
        jnp.pad(sinks.reshape(hkv, 1, g).astype(jnp.float32), ((0, 0), (0, 0), (0, gp - g)),
                constant_values=-jnp.inf), (1, 1, qb))                                       # [Hkv, 1, QB * gp]
    window = jnp.full((1,), NO_WINDOW if window is None else window, jnp.int32)
    pools = [x.reshape(num_layers * hkv, nb, bs, x.shape[-1]) for x in ((k_pool,) if v_dim else (k_pool, v_pool))]
    parts = ((0, hd),) if v_dim is None or form == "mosaic" else ((0, v_dim), (v_dim, hd - v_dim))
    kw = dict(kv_heads=hkv, block_size=bs, v_dim=v_dim, rows=r, decode_rows=decode_rows, parts=parts, scale=scale,
              softcap=softcap, hv=hv, key_limit=chunk_keys, kv_format=kv_format)
    out_shape = [jax.ShapeDtypeStruct((r, qb, hkv, gp, hv), q.dtype)]
    if partial:
        out_shape.append(jax.ShapeDtypeStruct((r, hkv, 1, gp), jnp.float32))
    estimate = cost(r, qb, hkv, g, width, bs, hd, 0 if v_dim else hv, q.dtype, k_pool.dtype)
    interpret = jax.default_backend() == "cpu" if interpret is None else interpret
    call = _triton_call if form == "triton" else functools.partial(_mosaic_call, pool_dtype=k_pool.dtype)
    outs = call(kw, [jnp.reshape(layer, (1,)).astype(jnp.int32), window, lo, hi, key_start, tables], qg, pos, pools,
                sink_arg, out_shape, estimate, interpret)
    out = outs[0][:, :, :, :g].reshape(r, qb, hq * hv)
    return (out, outs[1][:, :, 0, :g].reshape(r, hq)) if partial else out


def _triton_call(kw, scalars, qg, pos, pools, sink_arg, out_shape, estimate, interpret):
    r, qb, hkv, gp, hd = qg.shape
    whole = lambda x: pl.BlockSpec(x.shape, lambda i, j: (0,) * x.ndim)          # noqa: E731
    row_block = lambda shape: pl.BlockSpec((None, *shape), lambda i, j: (i,) + (0,) * len(shape))   # noqa: E731
    tables = scalars[-1]
    args = [*scalars, qg, pos, *pools]
    specs = [*[whole(x) for x in scalars[:-1]], row_block(tables.shape[1:]),
             pl.BlockSpec((None, qb, None, gp, hd), lambda i, j: (i, 0, j, 0, 0)), row_block(pos.shape[1:]),
             *[whole(x) for x in pools]]
    kernel = _bind(functools.partial(_triton_kernel, **kw), v_pool=len(pools) == 2, sinks=sink_arg is not None,
                   lse=len(out_shape) == 2)
    if sink_arg is not None:
        args.append(sink_arg)
        specs.append(pl.BlockSpec((None, 1, sink_arg.shape[-1]), lambda i, j: (j, 0, 0)))
    out_specs = [pl.BlockSpec((None, qb, None, gp, out_shape[0].shape[-1]), lambda i, j: (i, 0, j, 0, 0)),
                 pl.BlockSpec((None, None, 1, gp), lambda i, j: (i, j, 0, 0))][:len(out_shape)]
    return pl.pallas_call(
        kernel, grid=(r, hkv), in_specs=specs, out_specs=out_specs, out_shape=out_shape, interpret=interpret,
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),       # Pallas on Triton
        cost_estimate=estimate, name="tp_jax_paged_attention")(*args)


def _mosaic_call(kw, scalars, qg, pos, pools, sink_arg, out_shape, estimate, interpret, pool_dtype):
    r, qb, hkv, gp, hd = qg.shape
    width = scalars[-1].shape[1]
    bs = kw["block_size"]
    scalars = [*scalars[:-1], scalars[-1].reshape(-1)]
    in_specs = [pl.BlockSpec((None, qb, None, gp, hd), lambda i, j, *_: (i, 0, j, 0, 0)),
                pl.BlockSpec((None, *pos.shape[1:]), lambda i, j, *_: (i, 0, 0)),
                *[pl.BlockSpec(memory_space=pl.ANY) for _ in pools]]
    args = [qg, pos, *pools]
    kernel = _bind(functools.partial(_mosaic_kernel, width=width, **kw), v_pool=len(pools) == 2,
                   sinks=sink_arg is not None, lse=len(out_shape) == 2)
    if sink_arg is not None:
        args.append(sink_arg)
        in_specs.append(pl.BlockSpec((None, 1, sink_arg.shape[-1]), lambda i, j, *_: (j, 0, 0)))   # whole last dims
    hv_pool = pools[1].shape[-1] if len(pools) == 2 else 1
    out_specs = [pl.BlockSpec((None, qb, None, gp, out_shape[0].shape[-1]), lambda i, j, *_: (i, 0, j, 0, 0)),
                 pl.BlockSpec((None, None, 1, gp), lambda i, j, *_: (i, j, 0, 0))][:len(out_shape)]
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars), grid=(r, hkv), in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((PAGES_PER_STEP, bs, pools[0].shape[-1]), pool_dtype),
                        pltpu.VMEM((PAGES_PER_STEP, bs, hv_pool), pool_dtype),
                        pltpu.SemaphoreType.DMA((2, PAGES_PER_STEP))])
    return pl.pallas_call(kernel, grid_spec=grid, out_shape=out_shape,
                          interpret=pltpu.InterpretParams() if interpret else False, cost_estimate=estimate,
                          name="tp_jax_paged_attention_tpu")(*scalars, *args)


def _bind(kernel, *, v_pool: bool, sinks: bool, lse: bool):
    """The kernel with the refs a launch does not pass (the value pool of a latent cache, the sinks, the decode
    chunks' log-sum-exps) as None: the arguments are (6 scalars and tables, q, pos, k, [v], [sinks], out, [lse],
    *scratch)."""
    def call(*refs):
        head, k, rest = refs[:8], refs[8], list(refs[9:])
        v = rest.pop(0) if v_pool else None
        s = rest.pop(0) if sinks else None
        out = rest.pop(0)
        lse_ref = rest.pop(0) if lse else None
        return kernel(*head, k, v, s, out, lse_ref, *rest)
    return call


def cost(r: int, qb: int, hkv: int, g: int, width: int, bs: int, hd: int, hv: int, q_dtype,
         kv_dtype) -> pl.CostEstimate:
    """What a launch reads and writes at most: every row's whole table of K and V pages once (a row reads only the
    pages its positions and window reach: an upper bound; hv = 0 for a latent pool, whose values are its keys), its
    queries and its output; two dots per key and query head."""
    keys = r * hkv * width * bs
    kv_bytes = keys * (hd + hv) * np.dtype(kv_dtype).itemsize
    qo_bytes = r * qb * hkv * g * (hd + (hv or hd)) * np.dtype(q_dtype).itemsize
    return pl.CostEstimate(flops=2 * keys * qb * g * (hd + (hv or hd)), transcendentals=keys * qb * g,
                           bytes_accessed=int(kv_bytes + qo_bytes + r * width * 4))
