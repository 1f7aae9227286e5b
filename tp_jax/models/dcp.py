"""Decode context parallelism (DCP) for latent attention: a sequence's latent cache spread over the ranks of the tp
group (vLLM's `decode_context_parallel_size`), instead of replicated on every tp rank (tp_jax/models/mla.py).

With d dcp ranks (d divides tp; tp rank t is dcp rank r = t % d of the group of the d ranks t // d * d + 0..d-1),
a sequence's tokens are interleaved over its group: position p lives on dcp rank p % d (vLLM's interleave 1: a
growing sequence stays balanced). A block of the engine's `block_size` B positions (one block-table entry, what the
scheduler, the prefix cache and the batch count) is split: each rank's physical block holds B / d of them, so the
pool's bytes per token per device are divided by d.

    slot  = table[p // B] * B + p % B                         the batch's, as without DCP
    local = table[p // B] * (B / d) + (p % B) // d            on rank p % d; -1 (not written) elsewhere
    a rank's gathered context row j holds position j * d + r  (the masks read these positions)

A layer's paged attention (`attend_dcp`), its collectives over the dcp groups (`dcp_groups`):
1. all-gather q over the group: its ranks' heads, [N, d * H_tp, r + rope] (one collective);
2. each rank attends every head of its group over its share of each row's context, the absorbed form in fixed
   key chunks (`chunked_attention` with the share's positions: batch-invariant), keeping each query's log-sum-exp;
3. all-to-all of [o, lse] (rank j receives the partials of its own heads from every rank), then each rank combines
   its heads' partials in rank order: out = sum_i o_i exp(lse_i - L), L = log sum_i exp(lse_i) (one collective).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tp_jax.models.attention import _kv_scales, chunked_attention, gather_rows, write_pool
from tp_jax.parallel import collectives
from tp_jax.parallel.mesh import TP


def dcp_groups(d: int, tp: int) -> list[list[int]] | None:
    """The dcp groups as tp axis indices (d consecutive ranks each); None: the whole tp axis (d = tp)."""
    return None if d == tp else [list(range(s, s + d)) for s in range(0, tp, d)]


def local_slots(slots: jax.Array, block_size: int, d: int, r) -> jax.Array:
    """The batch's slots[N] (blocks of `block_size` positions) as dcp rank r's pool slots (blocks of block_size / d);
    -1 for a token another rank holds, or none."""
    block, offset = slots // block_size, slots % block_size
    return jnp.where((slots >= 0) & (offset % d == r), block * (block_size // d) + offset // d, -1)


def attend_dcp(q: jax.Array, k: jax.Array, positions: jax.Array, cache, *, scale: float, v_dim: int):
    """q[B, T, H_tp, hd] (this rank's heads) and the step's latent k[B, T, 1, hd] over the dcp-split pool ->
    (out[B, T, H_tp * v_dim], cache with k written): `attend`'s contract for latent attention (v = k[..., :v_dim])."""
    d, groups = cache.dcp, dcp_groups(cache.dcp, collectives.axis_size(TP))
    r = collectives.axis_index(TP) % d
    q_group = jax.lax.all_gather(q, TP, axis=2, tiled=True, axis_index_groups=groups)    # [B, T, d * H_tp, hd]
    k_scale = _kv_scales(cache.scales)[0]
    outs, lses = [], []
    for b in range(q.shape[0]):                        # B is 1 inside the pipeline (one micro-batch)
        batch = cache.batch.row(b)
        slots = local_slots(batch.slots, cache.k.shape[3] * d, d, r)
        cache = cache.replace(k=write_pool(cache.k, cache.layer, slots, k[b], cache.stored, k_scale))
        o, lse = _partials(q_group[b], positions[b], batch, cache, scale, v_dim, r)
        outs.append(o)
        lses.append(lse)
    out = _combine(jnp.stack(outs), jnp.stack(lses), d, groups)                    # [B, T, H_tp, v_dim]
    return out.reshape(*out.shape[:2], -1).astype(q.dtype), cache


def _partials(q, positions, batch, cache, scale, v_dim, r):
    """q[N, Hg, hd] (the group's heads) over dcp rank r's share of each row's context (cache.k, this rank's pool)
    -> the normalized partial outputs o[N, Hg, v_dim] (float32) and log-sum-exps lse[N, Hg] (-inf: no key seen)."""
    n, hg, _ = q.shape
    nd, np_ = batch.decode_tables.shape[0], batch.prefill_tables.shape[0]
    out, lse = jnp.zeros((n, hg, v_dim), jnp.float32), jnp.full((n, hg), -jnp.inf)
    dot = jnp.bfloat16 if cache.backend == "bf16" else None

    def rows(q_rows, pos_rows, tables):
        k = gather_rows(cache.k, cache.layer, tables, q.dtype, cache.stored, _kv_scales(cache.scales)[0])
        o, l = chunked_attention(q_rows, k, k[..., :v_dim], pos_rows, scale, dot_dtype=dot,       # k [R, 1, S, hd]
                                 k_pos=jnp.arange(k.shape[2]) * cache.dcp + r, with_lse=True)
        return o.reshape(*o.shape[:2], hg, v_dim).astype(jnp.float32), l         # [R, T, Hg, v], [R, T, Hg]

    if nd:
        o, l = rows(q[:nd, None], positions[:nd, None], batch.decode_tables)
        out, lse = out.at[:nd].set(o[:, 0]), lse.at[:nd].set(l[:, 0])
    if np_:
        index = batch.prefill_index                                                # [P, T] (N: padding)
        o, l = rows(jnp.take(q, index, axis=0, mode="fill", fill_value=0),
                    jnp.take(positions, index, axis=0, mode="fill", fill_value=0), batch.prefill_tables)
        out, lse = out.at[index].set(o, mode="drop"), lse.at[index].set(l, mode="drop")
    return out, lse


def _combine(out: jax.Array, lse: jax.Array, d: int, groups) -> jax.Array:
    """Every rank's partials of its group's heads, out[B, N, d * H_tp, v] and lse[B, N, d * H_tp] -> this rank's
    heads combined [B, N, H_tp, v]: one all-to-all of [o, lse] in the group, then the log-sum-exp weights, in rank
    order."""
    b, n, hg, v = out.shape
    part = jnp.concatenate([out, lse[..., None]], axis=-1).reshape(b, n, d, hg // d, v + 1)
    part = jnp.moveaxis(part, 2, 0)                                                # [d, B, N, H_tp, v + 1]: to rank j
    got = jax.lax.all_to_all(part, TP, 0, 0, tiled=True, axis_index_groups=groups)  # [d, B, N, H_tp, v + 1]: from i
    o, l = got[..., :v], got[..., v]
    top = l.max(0)
    w = jnp.exp(l - jnp.where(jnp.isfinite(top), top, 0))                          # 0 where a rank saw no key
    den = w.sum(0)
    return (o * w[..., None]).sum(0) / jnp.where(den > 0, den, 1)[..., None]
