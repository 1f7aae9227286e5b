"""The matmul floor of a decode step: a llama model's weight matmuls alone, at batch 1 and batch 8, one JSON line.

    python scripts/bench_matmul.py [--model X.gguf|DIR] [--batch 1 8] [--repeat 20]

One jitted function runs every layer's fused qkv, o, gate_up and down matmuls (the
shapes of `--model`, default the embedded SmolLM2, float32, tp = 1, unrolled, one array
per weight) and the vocab-sized LM head, with residual adds and a norm between so nothing
is skipped: no attention, no cache, no engine. `step_ms` is the best of `--repeat` runs;
`floor_b8_over_b1` is what batching costs the matmuls alone, the lower bound for
`step_batch8_over_batch1` in scripts/bench_decode.py on the same machine;
`read_GBps` is the weight bytes over the step time, `gflops` the matmuls' rate.
"""

import argparse
import json
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    from tp_jax.loaders.default import default_model_path
    from tp_jax.loaders.sources import open_checkpoint

    path = args.model or default_model_path()
    cfg, source = open_checkpoint(path).config, open_checkpoint(path, config=False).source
    d, hd, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    ff = source.get("model.layers.0.mlp.gate_proj.weight").shape[0]
    qkv, q = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, cfg.num_heads * hd
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.02)
    weights = [(w(d, qkv), w(q, d), w(d, 2 * ff), w(ff, d)) for _ in range(layers)]
    head = w(cfg.vocab_size, d)

    @jax.jit
    def chain(x, weights, head):
        for wqkv, wo, wgu, wd in weights:
            x = x + (x @ wqkv)[:, :q] @ wo
            g = x @ wgu
            x = x + (jax.nn.silu(g[:, :ff]) * g[:, ff:]) @ wd
            x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5)
        return x @ head.T

    nbytes = sum(a.nbytes for a in jax.tree.leaves(weights)) + head.nbytes
    out = {"model": path.rsplit("/", 1)[-1], "platform": jax.devices()[0].platform, "weight_bytes": nbytes}
    for b in args.batch:
        x = jnp.asarray(rng.standard_normal((b, d), dtype=np.float32))
        chain(x, weights, head).block_until_ready()
        best = float("inf")
        for _ in range(args.repeat):
            t = time.perf_counter()
            chain(x, weights, head).block_until_ready()
            best = min(best, time.perf_counter() - t)
        out[f"batch{b}"] = {"step_ms": round(best * 1e3, 2), "read_GBps": round(nbytes / best / 1e9, 2),
                            "gflops": round(2 * b * nbytes / 4 / best / 1e9, 1)}
    if 1 in args.batch and 8 in args.batch:
        out["floor_b8_over_b1"] = round(out["batch8"]["step_ms"] / out["batch1"]["step_ms"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
