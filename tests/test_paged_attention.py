"""Attention over pages (tp_jax/models/attention.py) against numpy attention over each sequence's own keys.

Random pools and block tables: decode rows and prefill rows mixed in one flat batch, GQA,
sliding windows, padding tokens that must not be written, stale data in unused slots that
must never be read; and the compiled prefill chunk keeps per-layer memory at chunk x context.
scripts/bench_attention.py times this attention on the engine's own prefill layouts.
"""

import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tp_jax.models.attention import attend, write_pool
from tp_jax.models.cache import KVQuant, LayerCache, PagedBatch
from tp_jax.parallel.invariant import consistent_jit
from tp_jax.serving.batch import split_decode_rows

BS, NB, HKV, G, HD = 4, 24, 2, 3, 8


def np_attention(q, k, v, q_pos, scale, window=None, sinks=None):
    """q[T, Hq, hd] at positions q_pos over k/v[S, Hkv, hd] at positions 0..S-1, causal; `sinks[Hq]`: one more
    logit per head in the softmax (gpt-oss), a key without a value."""
    hq = q.shape[1]
    kk = np.repeat(k, hq // k.shape[1], axis=1)
    vv = np.repeat(v, hq // v.shape[1], axis=1)
    s = np.einsum("thd,shd->hts", q, kk) * scale
    kpos = np.arange(k.shape[0])
    allowed = kpos[None] <= q_pos[:, None]
    if window is not None:
        allowed &= kpos[None] > q_pos[:, None] - window
    s = np.where(allowed[None], s, -np.inf)
    sink = np.full((hq, 1, 1), -np.inf) if sinks is None else np.asarray(sinks, np.float64)[:, None, None]
    top = np.maximum(s.max(-1, keepdims=True), sink)
    p = np.exp(s - top)
    p /= p.sum(-1, keepdims=True) + np.exp(sink - top)
    return np.einsum("hts,shd->thd", p, vv).reshape(len(q), -1)


def make_case(rng, rows, width, window, chunk_blocks=2, chunk_padding=2):
    """rows: [(context_before, new_tokens)], decode rows (new = 1) first. A pool with random old
    keys, each row's own blocks, and the flat step; the decode rows split-K in chunks of `chunk_blocks`
    blocks (as the engine's build_batch lays them out), then `chunk_padding` padding chunks (0: no chunks,
    as build_batch leaves a step of short tables)."""
    k_pool = rng.standard_normal((1, HKV, NB, BS, HD)).astype(np.float32)       # head-major, like the engine's
    v_pool = rng.standard_normal((1, HKV, NB, BS, HD)).astype(np.float32)
    free = list(rng.permutation(NB))
    d = sum(1 for c, n in rows if n == 1)
    p = len(rows) - d
    n_tok = d + sum(n for c, n in rows if n > 1) + 3                     # 3 padding tokens at the end
    q = rng.standard_normal((n_tok, HKV * G, HD)).astype(np.float32)
    k_new = rng.standard_normal((n_tok, HKV, HD)).astype(np.float32)
    v_new = rng.standard_normal((n_tok, HKV, HD)).astype(np.float32)
    pos, slots = np.zeros(n_tok, np.int32), np.full(n_tok, -1, np.int32)
    tables = np.zeros((len(rows), 16), np.int32)
    index = np.full((p, width), n_tok, np.int32)
    spans, off = [], 0
    for i, (ctx, new) in enumerate(rows):
        blocks = [free.pop() for _ in range(-(-(ctx + new) // BS))]
        tables[i, :len(blocks)] = blocks
        if i >= d:
            index[i - d, :new] = np.arange(off, off + new)
        p_i = np.arange(ctx, ctx + new)
        pos[off:off + new] = p_i
        slots[off:off + new] = np.asarray(blocks)[p_i // BS] * BS + p_i % BS
        spans.append((off, new, blocks, ctx))
        off += new
    lengths = [c + 1 for c, n in rows[:d]]
    rv = sum(-(-n // (BS * chunk_blocks)) for n in lengths) + chunk_padding if chunk_blocks else 0
    chunks = np.zeros((rv, chunk_blocks), np.int32), np.full(rv, d, np.int32), np.zeros(rv, np.int32)
    if rv:
        split_decode_rows(lengths, tables[:d], BS, *chunks)
    batch = PagedBatch(*(jnp.asarray(a)[None] for a in (slots, tables[:d], *chunks, tables[d:], index)))
    return k_pool, v_pool, q, k_new, v_new, pos, batch, spans


TOLERANCE = {"reference": dict(atol=2e-5, rtol=1e-5), "split_f32": dict(atol=2e-5, rtol=1e-5),
             "pallas": dict(atol=2e-5, rtol=1e-5),         # tp_jax/models/paged_kernel.py, in Pallas' interpreter
             "bf16": dict(atol=3e-2, rtol=0)}      # bf16: operands rounded to 8 bits (|out| <~ 2 here)


def split_f32(q, k_pool, v_pool, layer, positions, batch, scale, window, sinks=None, v_dim=None, stored=None,
              scales=None):
    """The bf16 backend's split-K decode in float32: the combine's own check, exact within float32 rounding."""
    import functools
    from tp_jax.models.attention import _chunked, _paged, split_decode
    return _paged(q, k_pool, v_pool, layer, positions, batch, scale, window, functools.partial(_chunked, sinks=sinks),
                  functools.partial(split_decode, sinks=sinks, v_dim=v_dim, stored=stored, scales=scales),
                  v_dim=v_dim, stored=stored, scales=scales)


@pytest.fixture(autouse=True)
def _split_f32(monkeypatch):
    from tp_jax.models import attention
    monkeypatch.setitem(attention.PAGED_BACKENDS, "split_f32", split_f32)


@pytest.mark.parametrize("backend", ["reference", "split_f32", "bf16", "pallas"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("rows,width,chunk_blocks", [
    ([(3, 1), (9, 1), (0, 1), (40, 1)], 16, 1),     # decodes only: up to 11 chunks a row, some outside a window
    ([(3, 1), (9, 1), (0, 1), (40, 1)], 16, 3),     # ... a last chunk part-filled
    ([(3, 1), (9, 1), (0, 1), (40, 1)], 16, 0),     # ... no chunks: every backend's full-width path
    ([(0, 7), (5, 11)], 16, 2),                     # prefill chunks only (the second after 5 cached)
    ([(12, 1), (0, 16), (2, 9), (4, 1)], 16, 2),    # mixed, decode rows first
])
def test_paged_equals_per_sequence_attention(rows, width, chunk_blocks, window, backend):
    rows = sorted(rows, key=lambda r: r[1] != 1)
    rng = np.random.default_rng(len(rows) * 7 + width)
    k_pool, v_pool, q, k_new, v_new, pos, batch, spans = make_case(rng, rows, width, window, chunk_blocks)
    scale = HD ** -0.5
    cache = LayerCache(jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.int32(0), batch, backend)
    out, cache = jax.jit(lambda q, k, v, p, c: attend(q, k, v, p, c, scale=scale, window=window))(
        q[None], k_new[None], v_new[None], pos[None], cache)
    out, kp, vp = np.asarray(out[0]), np.asarray(cache.k), np.asarray(cache.v)
    written = np.zeros((NB, BS), bool)
    for off, new, blocks, ctx in spans:
        # the row's whole context: old keys from its blocks, then its new keys
        keys = np.concatenate([k_pool[0, :, b].swapaxes(0, 1) for b in blocks])[:ctx]     # [ctx, Hkv, hd]
        vals = np.concatenate([v_pool[0, :, b].swapaxes(0, 1) for b in blocks])[:ctx]
        keys = np.concatenate([keys, k_new[off:off + new]])
        vals = np.concatenate([vals, v_new[off:off + new]])
        ref = np_attention(q[off:off + new], keys, vals, pos[off:off + new], scale, window)
        np.testing.assert_allclose(out[off:off + new], ref, **TOLERANCE[backend])
        if backend == "bf16":                      # rounded, not float32: the bound above is not loose
            assert np.abs(out[off:off + new] - ref).max() > 1e-5
        for j in range(new):                       # written at its slots
            b, o = blocks[(ctx + j) // BS], (ctx + j) % BS
            np.testing.assert_array_equal(kp[0, :, b, o], k_new[off + j])
            np.testing.assert_array_equal(vp[0, :, b, o], v_new[off + j])
            written[b, o] = True
    np.testing.assert_array_equal(kp[0][:, ~written], k_pool[0][:, ~written])     # padding wrote nothing
    np.testing.assert_array_equal(vp[0][:, ~written], v_pool[0][:, ~written])


@pytest.mark.parametrize("backend", ["reference", "split_f32", "bf16", "pallas"])
@pytest.mark.parametrize("kind", ["sinks", "latent"])
def test_sinks_and_latent_values(backend, kind):
    """gpt-oss's sinks (with a window, as its sliding layers have) and MLA's latent pool (values = the keys' first
    v_dim channels, no value pool read or written) on a step mixing decode rows, split-K chunks and prefill rows."""
    rows = [(12, 1), (40, 1), (0, 16), (2, 9)]
    rng = np.random.default_rng(11)
    k_pool, v_pool, q, k_new, v_new, pos, batch, spans = make_case(rng, rows, 16, None, 2)
    sinks = rng.standard_normal(HKV * G).astype(np.float32) if kind == "sinks" else None
    window, v_dim = (5, None) if kind == "sinks" else (None, HD // 2)
    scale = HD ** -0.5
    cache = LayerCache(jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.int32(0), batch, backend)
    run = jax.jit(lambda q, k, v, p, c: attend(q, k, v, p, c, scale=scale, window=window,
                                               sinks=None if sinks is None else jnp.asarray(sinks), v_dim=v_dim))
    out, cache = run(q[None], k_new[None], None if v_dim else v_new[None], pos[None], cache)
    out = np.asarray(out[0])
    if v_dim:
        np.testing.assert_array_equal(np.asarray(cache.v), v_pool)                    # the value pool untouched
    for off, new, blocks, ctx in spans:
        keys = np.concatenate([k_pool[0, :, b].swapaxes(0, 1) for b in blocks])[:ctx]
        vals = np.concatenate([v_pool[0, :, b].swapaxes(0, 1) for b in blocks])[:ctx]
        keys = np.concatenate([keys, k_new[off:off + new]])
        vals = keys[..., :v_dim] if v_dim else np.concatenate([vals, v_new[off:off + new]])
        ref = np_attention(q[off:off + new], keys, vals, pos[off:off + new], scale, window, sinks)
        np.testing.assert_allclose(out[off:off + new], ref, **TOLERANCE[backend])
        if sinks is not None:                                                 # the sinks change every row's output
            assert np.abs(np_attention(q[off:off + new], keys, vals, pos[off:off + new], scale, window)
                          - ref).max() > 1e-2


def test_write_pool_drops_negative_slots():
    pool = jnp.zeros((2, 2, 3, BS, 2))                                       # [L, H, NB, bs, hd]
    new = jnp.arange(1, 13, dtype=jnp.float32).reshape(3, 2, 2)              # [N, H, hd]
    out = np.asarray(write_pool(pool, jnp.int32(1), jnp.asarray([5, -1, 0]), new))
    want = np.zeros(pool.shape, np.float32)
    want[1, :, 1, 1] = new[0]                                                # slot 5: block 1, offset 1
    want[1, :, 0, 0] = new[2]                                                # slot 0; slot -1 dropped
    np.testing.assert_array_equal(out, want)


def test_a_prefill_chunk_never_builds_a_whole_prompt_score_matrix():
    """Scores are [rows, heads, chunk, context]: a 64-token chunk over a 1024-token context."""
    nb, chunk, ctx = 72, 64, 1024
    k_pool = jnp.zeros((1, HKV, nb, BS, HD))
    z = lambda *shape: jnp.zeros((1, *shape), jnp.int32)
    batch = PagedBatch(z(chunk), z(0, ctx // BS), z(0, 2), z(0), z(0), z(1, ctx // BS),
                       jnp.arange(chunk, dtype=jnp.int32)[None, None])
    q = jnp.zeros((1, chunk, HKV * G, HD))
    kv = jnp.zeros((1, chunk, HKV, HD))
    f = jax.jit(lambda q, k, v, p, c: attend(q, k, v, p, c, scale=1.0)[0])
    hlo = f.lower(q, kv, kv, jnp.zeros((1, chunk), jnp.int32), LayerCache(k_pool, k_pool, jnp.int32(0), batch)
                  ).compile().as_text()
    sizes = [np.prod([int(d) for d in m.split(",") if d]) for m in re.findall(r"f32\[([\d,]*)\]", hlo)]
    assert max(sizes) <= HKV * G * chunk * ctx           # the scores of one chunk, nothing bigger
    assert max(sizes) >= HKV * G * chunk * ctx // 2


def test_bench_attention_measures_the_engines_layout_and_refuses_bad_widths():
    """scripts/bench_attention.py lays the step out with build_batch: 70 + 5 tokens in chunks of 64
    are 3 attention rows (64 + 6, 5), as whole rows 2 of 128; a width that is not a power of two
    and an empty prompt are one-line usage errors."""
    run = lambda *a: subprocess.run([sys.executable, "scripts/bench_attention.py", *a], capture_output=True,
                                    text=True, timeout=300)
    r = run("--prompts", "70", "5", "--chunks", "64", "0", "--repeat", "1", "--backends", "reference", "bf16",
            "--decode", "200", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads(r.stdout)["results"]
    rows = {x["chunk"]: (x["rows"], x["width"], x["context"]) for x in results}
    assert rows == {64: (3, 64, 128), "whole rows": (2, 128, 128)}
    assert all(x["ms"] > 0 and x["ms_bf16"] > 0 for x in results)
    dec = json.loads(r.stdout)["decode"]      # 201 + 4 positions (a 256-wide table): 7 + 1 chunks of 32
    assert (dec["rows"], dec["table_positions"], dec["chunks"], dec["chunk_positions"]) == (2, 256, 8, 32)
    assert dec["ms"] > 0 and dec["ms_bf16"] > 0
    for args, msg in [(("--chunks", "48"), "--chunks must be powers of two"),
                      (("--prompts", "0"), "--prompts must be at least 1 token"),
                      (("--backends", "flash"), "--backends ['flash'] not registered"),
                      (("--decode", "-1"), "--decode contexts must be >= 0")]:
        r = run(*args)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_chunked_attention_is_the_same_whatever_the_step():
    """A query's output from `chunked_attention` is bit for bit the same beside any number of other rows, at any
    table width (the step's longest row) and any query-tile width: the reference backend's batch invariance."""
    from tp_jax.models.attention import chunked_attention
    rng = np.random.default_rng(3)
    hkv, g, hd = 2, 3, 16
    q0 = rng.standard_normal((hkv * g, hd)).astype(np.float32)
    k0, v0 = (rng.standard_normal((hkv, 512, hd)).astype(np.float32) for _ in range(2))
    f = consistent_jit(lambda q, k, v, qp: chunked_attention(q, k, v, qp, 0.25, window=None))   # as the engine compiles it
    outs = []
    for rows, width, tile in [(1, 64, 1), (3, 128, 1), (12, 256, 1), (5, 512, 4), (2, 96, 16)]:
        q = rng.standard_normal((rows, tile, hkv * g, hd)).astype(np.float32)
        k, v = (rng.standard_normal((rows, hkv, width, hd)).astype(np.float32) for _ in range(2))
        qp = rng.integers(0, width, (rows, tile)).astype(np.int32)
        r, t = rows // 2, tile - 1
        q[r, t], k[r], v[r], qp[r, t] = q0, k0[:, :width], v0[:, :width], 50
        outs.append(np.asarray(f(q, k, v, qp))[r, t])
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


FP8 = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}


def np_quantize(x, fmt, scale=1.0):
    """x[..., hd] float32 as a `kv_cache_dtype` pool stores it (uint8): int8 with a float16 scale max|x| / 127 per
    row in its last two bytes, or float8 of x / scale saturated."""
    if fmt == "int8":
        s = (np.abs(x).max(-1, keepdims=True) / np.float32(127)).astype(np.float16)
        q = np.clip(np.round(x / np.where(s > 0, s, 1).astype(np.float32)), -127, 127).astype(np.int8)
        return np.concatenate([q.view(np.uint8), s.view(np.uint8)], -1)
    big = np.float32(ml_dtypes.finfo(FP8[fmt]).max)
    return np.clip(x / np.float32(scale), -big, big).astype(FP8[fmt]).view(np.uint8)


def np_dequantize(rows, fmt, scale=1.0):
    if fmt == "int8":
        return rows[..., :-2].view(np.int8).astype(np.float32) * \
            np.ascontiguousarray(rows[..., -2:]).view(np.float16).astype(np.float32)
    return rows.view(FP8[fmt]).astype(np.float32) * np.float32(scale)


@pytest.mark.parametrize("backend", ["reference", "split_f32", "bf16"])
@pytest.mark.parametrize("fmt,scales,kind", [
    ("int8", None, "plain"), ("int8", None, "latent"),
    ("fp8_e4m3", (0.02, 0.5), "plain"),            # checkpoint scales: k / 0.02 saturates e4m3's 448 for |k| > 8.96
    ("fp8_e4m3", (0.25, None), "latent"), ("fp8_e5m2", None, "plain")])
def test_quantized_pools_against_numpy(backend, fmt, scales, kind):
    """`kv_cache_dtype`'s pools (uint8 bits of int8 rows with their scales, or of float8 over per-tensor scales):
    each written row's bytes equal numpy's quantization, and every backend attends over numpy's dequantized keys
    and values (MLA's latent: the values are the keys' first channels), decode rows, split-K chunks and prefill
    rows mixed."""
    rows = [(12, 1), (40, 1), (0, 16), (2, 9)]
    rng = np.random.default_rng(5)
    k_pool, v_pool, q, k_new, v_new, pos, batch, spans = make_case(rng, rows, 16, None, 2)
    k_new = k_new * np.linspace(0.1, 10, HD, dtype=np.float32)            # channels of very different ranges
    ks, vs = (1.0, 1.0) if scales is None else (scales[0], scales[1] or 1.0)
    v_dim = HD // 2 if kind == "latent" else None
    kq, vq = np_quantize(k_pool, fmt, ks), np_quantize(v_pool, fmt, vs)
    stored = KVQuant(np.dtype(jnp.int8 if fmt == "int8" else FP8[fmt]))
    cache = LayerCache(jnp.asarray(kq), jnp.asarray(vq), jnp.int32(0), batch, backend, stored,
                       None if scales is None else jnp.asarray([ks, vs], jnp.float32))
    out, cache = jax.jit(lambda q, k, v, p, c: attend(q, k, v, p, c, scale=HD ** -0.5, v_dim=v_dim))(
        q[None], k_new[None], None if v_dim else v_new[None], pos[None], cache)
    out, kp, vp = np.asarray(out[0]), np.asarray(cache.k), np.asarray(cache.v)
    if v_dim:
        np.testing.assert_array_equal(vp, vq)                                # the value pool untouched
    k_deq, v_deq = np_dequantize(kp[0], fmt, ks), np_dequantize(vp[0], fmt, vs)     # [Hkv, NB, bs, hd]
    for off, new, blocks, ctx in spans:
        for j in range(new):                       # written at its slots, as numpy quantizes
            b, o = blocks[(ctx + j) // BS], (ctx + j) % BS
            np.testing.assert_array_equal(kp[0, :, b, o], np_quantize(k_new[off + j], fmt, ks))
            if not v_dim:
                np.testing.assert_array_equal(vp[0, :, b, o], np_quantize(v_new[off + j], fmt, vs))
        keys = np.concatenate([k_deq[:, b].swapaxes(0, 1) for b in blocks])[:ctx + new]     # [S, Hkv, hd]
        vals = keys[..., :v_dim] if v_dim else np.concatenate([v_deq[:, b].swapaxes(0, 1) for b in blocks])[:ctx + new]
        ref = np_attention(q[off:off + new], keys, vals, pos[off:off + new], HD ** -0.5)
        tol = TOLERANCE[backend] if backend != "bf16" else dict(atol=3e-2 * np.abs(ref).max(), rtol=0)
        np.testing.assert_allclose(out[off:off + new], ref, **tol)
    if scales is not None and scales[0] < 0.1:
        assert (np.abs(k_new) > 448 * ks).any()                             # saturation was exercised
