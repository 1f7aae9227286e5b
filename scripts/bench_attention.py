"""One layer's paged attention of a prefill step, its rows whole or in chunks (and of a decode step), one JSON line.

    python scripts/bench_attention.py [--prompts 150 120 90 80 60 12] [--chunks 64 32 128 0]
                                      [--decode 72 100 264 ...] [--heads 9 3] [--head-dim 64]
                                      [--block-size 16] [--repeat 20] [--backends reference split bf16]

The step holds the first chunks of `--prompts` (no cached context), laid out by the engine's
own `build_batch` (serving/batch.py) with each of `--chunks` as its `PREFILL_CHUNK`; 0 lays each
prompt out as one attention row padded to its bucketed length (whole rows, the layout before
chunks, except that their count was then padded to a power of two). Times each of `--backends`
(tp_jax/models/attention.py PAGED_BACKENDS, default the float32 `paged_reference`) jitted, the write of the
new keys not included, best of `--repeat`: per chunk width `ms` (the reference) or `ms_<backend>`,
the attention rows P, their width T, the padded queries and the context each row reads. Default heads are SmolLM2's (9 query heads over 3 KV heads of 64).
With `--decode`, also one decode step of a row per given context (its new token at that position):
"decode" holds its rows D, block-table width Wd, split-K chunks Rv and each backend's time.
"""

import argparse
import json
import time

import numpy as np

WHOLE_ROWS = 1 << 30                      # a chunk no prompt reaches


def step_batch(rows: list[tuple[int, int]], chunk: int, block_size: int):
    """build_batch's layout of one step of rows (start, new tokens) on one replica; the blocks it uses."""
    from tp_jax.serving.batch import DECODE_CHUNK, build_batch
    from tp_jax.serving.request import Request
    from tp_jax.serving.sampling import SamplingParams
    from tp_jax.serving.scheduler import ScheduledRow, SchedulerOutput
    scheduled, tables, used = [], {}, 0
    for i, (start, k) in enumerate(rows):
        req = Request(f"r{i}", start + k, [1] * (start + k), SamplingParams(max_tokens=1), 1, (0, 0, 0))
        scheduled.append(ScheduledRow(req, start, k))
        blocks = -(-(start + k) // block_size)
        tables[req.request_id] = list(range(used, used + blocks))
        used += blocks
    batch = build_batch(SchedulerOutput([scheduled], []), [tables], block_size, 1, chunk or WHOLE_ROWS,
                        split_k=DECODE_CHUNK)
    return batch, used


def time_backends(b, num_blocks, backends, heads, hd, bs, repeat, rng) -> dict[str, float]:
    """Best-of-`repeat` ms of each backend's attention over step `b` (the reference as "ms")."""
    import jax
    import jax.numpy as jnp
    from tp_jax.models.attention import PAGED_BACKENDS
    from tp_jax.models.cache import PagedBatch
    hq, hkv = heads
    pools = [jnp.asarray(rng.standard_normal((1, hkv, num_blocks, bs, hd), dtype=np.float32)) for _ in "kv"]
    q = jnp.asarray(rng.standard_normal((b.shape.tokens, hq, hd), dtype=np.float32))
    batch = PagedBatch(*(jnp.asarray(getattr(b, k)[0]) for k in PagedBatch.FIELDS))
    out = {}
    for name in backends:
        impl = PAGED_BACKENDS[name]
        run = jax.jit(lambda q, k, v, pos, batch, impl=impl: impl(q, k, v, jnp.int32(0), pos, batch, hd ** -0.5, None))
        args = (q, *pools, jnp.asarray(b.positions[0]), batch)
        jax.block_until_ready(run(*args))
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            jax.block_until_ready(run(*args))
            times.append(time.perf_counter() - t)
        out["ms" if name == "reference" else f"ms_{name}"] = round(min(times) * 1e3, 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[150, 120, 90, 80, 60, 12])
    ap.add_argument("--chunks", type=int, nargs="+", default=[64, 32, 128, 0])
    ap.add_argument("--decode", type=int, nargs="*", default=[], metavar="CONTEXT",
                    help="also time a decode step of one row per context")
    ap.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("HQ", "HKV"))
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--backends", nargs="+", default=["reference"], help="PAGED_BACKENDS names, each timed")
    args = ap.parse_args(argv)
    if any(c < 0 or (c and c & (c - 1)) for c in args.chunks):
        ap.error(f"--chunks must be powers of two (or 0 for whole rows), got {args.chunks}")
    if min(args.prompts) < 1:
        ap.error(f"--prompts must be at least 1 token each, got {args.prompts}")
    if min(args.decode, default=0) < 0:
        ap.error(f"--decode contexts must be >= 0, got {args.decode}")
    import jax
    from tp_jax.models.attention import PAGED_BACKENDS
    unknown = sorted(set(args.backends) - set(PAGED_BACKENDS))
    if unknown:
        ap.error(f"--backends {unknown} not registered; choose from {sorted(PAGED_BACKENDS)}")
    hd, bs = args.head_dim, args.block_size
    rng = np.random.default_rng(0)
    timed = lambda b, num_blocks: time_backends(b, num_blocks, args.backends, args.heads, hd, bs, args.repeat, rng)
    results = []
    for chunk in args.chunks:
        b, num_blocks = step_batch([(0, k) for k in args.prompts], chunk, bs)
        s = b.shape
        results.append({"chunk": chunk or "whole rows", "rows": s.prefill_rows, "width": s.prefill_width,
                        "padded_queries": s.prefill_rows * s.prefill_width, "context": s.prefill_blocks * bs,
                        **timed(b, num_blocks)})
    line = {"prompts": args.prompts, "heads": args.heads, "head_dim": hd, "block_size": bs,
            "platform": jax.default_backend(), "results": results}
    if args.decode:
        b, num_blocks = step_batch([(c, 1) for c in args.decode], 0, bs)
        s = b.shape
        line["decode"] = {"contexts": args.decode, "rows": s.decode_rows, "table_positions": s.decode_blocks * bs,
                          "chunks": s.decode_chunks, "chunk_positions": s.chunk_blocks * bs, **timed(b, num_blocks)}
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
