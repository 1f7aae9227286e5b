"""One layer's paged attention for a prefill step, rows whole or in chunks, one JSON line.

    python scripts/bench_attention.py [--prompts 150 120 90 80 60 12] [--chunks 64 32 128 0] [--decode 0]
                                      [--context 0] [--heads 9 3] [--head-dim 64] [--repeat 20]

The step holds `--prompts` (their tokens back to back, first chunks: no cached context unless
`--context` tokens precede each) and `--decode` decode rows, laid out as serving/batch.py's
`build_batch` lays them out with `PREFILL_CHUNK` = each of `--chunks` (0: the layout before chunks, each prefill row one
attention row padded to its bucketed length, their count to a power of two). Times one jitted
`paged_reference` (models/attention.py; the write of the new keys is not included), best of
`--repeat`, per chunk width: `ms`, the attention rows P and width T, and the padded queries.
Default heads are SmolLM2's (9 query heads over 3 KV heads of 64).
"""

import argparse
import json
import time

import numpy as np


def layout(prompts, decode, context, chunk, block_size, num_blocks):
    """(positions, decode tables, prefill tables, prefill index, N) as build_batch builds them."""
    from tp_jax.serving.batch import MIN_BLOCKS, MIN_PREFILL_WIDTH, MIN_TOKENS, bucket, fine_bucket, prefill_layout
    if chunk:
        p, t = prefill_layout([list(prompts)], chunk)
    else:                                                          # the layout before chunks: P to 2^k
        p, t = bucket(len(prompts)), bucket(max(prompts), MIN_PREFILL_WIDTH)
    n = fine_bucket(decode + sum(prompts), MIN_TOKENS)
    wp = bucket(-(-(context + max(prompts)) // block_size), MIN_BLOCKS)
    wd = bucket(-(-(context + 1) // block_size), MIN_BLOCKS)
    rng = np.random.default_rng(0)
    pos = np.zeros(n, np.int32)
    pos[:decode] = context
    dec = rng.integers(0, num_blocks, (decode, wd)).astype(np.int32)
    pre = np.zeros((p, wp), np.int32)
    index = np.full((p, t), n, np.int32)
    off, j = decode, 0
    for k in prompts:
        table = rng.integers(0, num_blocks, wp)
        pos[off:off + k] = np.arange(context, context + k)
        for c in range(0, k, t):
            index[j, :min(t, k - c)] = np.arange(off + c, off + min(c + t, k))
            pre[j] = table
            j += 1
        off += k
    return pos, dec, pre, index, n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[150, 120, 90, 80, 60, 12])
    ap.add_argument("--chunks", type=int, nargs="+", default=[64, 32, 128, 0])
    ap.add_argument("--decode", type=int, default=0)
    ap.add_argument("--context", type=int, default=0)
    ap.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("HQ", "HKV"))
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    if any(c < 0 or (c and c & (c - 1)) for c in args.chunks):
        ap.error(f"--chunks must be powers of two (or 0 for whole rows), got {args.chunks}")
    if min(args.prompts) < 1 or args.decode < 0 or args.context < 0:
        ap.error("--prompts must be >= 1 token each; --decode and --context >= 0")
    import jax
    import jax.numpy as jnp
    from tp_jax.models.attention import paged_reference
    hq, hkv = args.heads
    hd, bs = args.head_dim, args.block_size
    num_blocks = len(args.prompts) * (-(-(args.context + max(args.prompts)) // bs)) * 2 + 64
    rng = np.random.default_rng(1)
    k_pool = jnp.asarray(rng.standard_normal((1, hkv, num_blocks, bs, hd), dtype=np.float32))
    v_pool = jnp.asarray(rng.standard_normal((1, hkv, num_blocks, bs, hd), dtype=np.float32))
    run = jax.jit(lambda q, k, v, pos, dec, pre, index: paged_reference(
        q, k, v, jnp.int32(0), pos, dec, pre, index, hd ** -0.5, None))
    results = []
    for chunk in args.chunks:
        pos, dec, pre, index, n = layout(args.prompts, args.decode, args.context, chunk, bs, num_blocks)
        q = jnp.asarray(rng.standard_normal((n, hq, hd), dtype=np.float32))
        inputs = [q, k_pool, v_pool] + [jnp.asarray(a) for a in (pos, dec, pre, index)]
        jax.block_until_ready(run(*inputs))
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            jax.block_until_ready(run(*inputs))
            times.append(time.perf_counter() - t)
        results.append({"chunk": chunk or "whole rows", "ms": round(min(times) * 1e3, 3), "rows": index.shape[0],
                        "width": index.shape[1], "padded_queries": int(index.size),
                        "context": pre.shape[1] * bs})
    print(json.dumps({"prompts": args.prompts, "decode": args.decode, "context": args.context,
                      "heads": args.heads, "head_dim": hd, "platform": jax.default_backend(), "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
