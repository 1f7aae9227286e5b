"""The matmul floor of a decode step: a llama model's weight matmuls alone, per dot kernel and batch, one JSON line.

    python scripts/bench_matmul.py [--model X.gguf|DIR] [--batch 1 8] [--repeat 20]
                                   [--dots float32 bf16 w8a8 w8a8x2 torch_bf16 torch_float32] [--transformers]

One function runs every layer's fused qkv, o, gate_up and down matmuls (the shapes of
`--model`, default the embedded SmolLM2, tp = 1, unrolled, one array per weight, so every
weight is read from memory as in a decode step) and the vocab-sized LM head, with residual
adds and a norm between so nothing is skipped: no attention, no cache, no engine. Each of
`--dots` is one way to compute those matmuls:

* `float32`, `bf16`, `w8a8`, `w8a8x2`: jitted XLA with tp_jax's own dots (layers/method.py
  `fast_dot`: bf16 weights, bf16 x bf16 -> float32; layers/int8.py `int8_dot`: int8 weights,
  activations as one or two int8 digits per token, int32 accumulation), as the linear
  methods of those names run them;
* `torch_bf16`, `torch_float32`: the same chain in eager torch (`F.linear`, oneDNN on CPU),
  the kernels transformers runs.

`step_ms` is the best of `--repeat` runs; `read_GBps` the weight bytes over the step time;
`floor_b8_over_b1` what batching costs the matmuls alone, the lower bound for
`step_batch8_over_batch1` in scripts/bench_decode.py. With `--transformers`, transformers'
own decode step (`generate`, float32 and bfloat16, as bench_decode measures it) is timed in
the same run, and each row's `over_transformers_best` is that step over the chain's: the most
any engine using these kernels could reach against transformers at that batch (attention,
norms and sampling only add to the chain).
"""

import argparse
import json
import os
import time

import numpy as np

DOTS = ("float32", "bf16", "w8a8", "w8a8x2", "torch_bf16", "torch_float32")


def shapes(cfg, source) -> tuple[list[tuple[int, int]], tuple[int, int], int, int]:
    """([out, in] of a layer's qkv, o, gate_up, down], the head's [vocab, D], q width, ff)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    ff = source.get("model.layers.0.mlp.gate_proj.weight").shape[0]
    qkv, q = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, cfg.num_heads * hd
    return [(qkv, d), (d, q), (2 * ff, d), (d, ff)], (cfg.vocab_size, d), q, ff


def jax_chain(kind: str, layer_shapes, head_shape, layers: int, q: int, ff: int, rng):
    """(run(x) -> logits, weight bytes) for one of the XLA kinds: weights [out, in] as the methods hold them."""
    import jax
    import jax.numpy as jnp
    from tp_jax.parallel.layers.int8 import int8_dot, int8_rows
    from tp_jax.parallel.layers.method import fast_dot

    def weight(o, i):
        w = rng.standard_normal((o, i), dtype=np.float32) * 0.02
        if kind in ("float32", "bf16"):
            return (jnp.asarray(w, jnp.float32 if kind == "float32" else jnp.bfloat16),)
        q, s = int8_rows(w)                                    # as the int8 methods quantize at load
        return jnp.asarray(q), jnp.asarray(s)

    def dot(x, w):
        if kind == "float32":
            return jnp.einsum("md,fd->mf", x, w[0])
        if kind == "bf16":
            return fast_dot(x, w[0], "md,fd->mf")
        return int8_dot(x, w[0], kind == "w8a8x2") * w[1]

    weights = [tuple(weight(*s) for s in layer_shapes) for _ in range(layers)]
    head = weight(*head_shape)

    @jax.jit
    def chain(x, weights, head):
        for wqkv, wo, wgu, wd in weights:
            x = x + dot(dot(x, wqkv)[:, :q], wo)
            g = dot(x, wgu)
            x = x + dot(jax.nn.silu(g[:, :ff]) * g[:, ff:], wd)
            x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5)
        return dot(x, head)

    nbytes = sum(a.nbytes for a in jax.tree.leaves((weights, head)))
    return (lambda x: chain(jnp.asarray(x), weights, head).block_until_ready()), nbytes


def torch_chain(kind: str, layer_shapes, head_shape, layers: int, q: int, ff: int, rng):
    """(run(x) -> logits, weight bytes) for the eager torch kinds."""
    import torch
    import torch.nn.functional as F
    dtype = torch.bfloat16 if kind == "torch_bf16" else torch.float32
    w = lambda o, i: torch.from_numpy(rng.standard_normal((o, i), dtype=np.float32) * 0.02).to(dtype)
    weights = [tuple(w(*s) for s in layer_shapes) for _ in range(layers)]
    head = w(*head_shape)

    @torch.no_grad()
    def run(x):
        x = torch.from_numpy(x).to(dtype)
        for wqkv, wo, wgu, wd in weights:
            x = x + F.linear(F.linear(x, wqkv)[:, :q], wo)
            g = F.linear(x, wgu)
            x = x + F.linear(F.silu(g[:, :ff]) * g[:, ff:], wd)
            x = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5)
        return F.linear(x, head)

    nbytes = sum(t.numel() * t.element_size() for t in [*sum(weights, ()), head])
    return run, nbytes


def best_ms(run, x, repeat: int) -> float:
    run(x)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        run(x)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def transformers_steps(path: str, batches: list[int], tokens: int = 32) -> dict:
    """{dtype: {batch: seconds per decode step}} of transformers' generate, as bench_decode measures it."""
    import torch
    from bench_decode import theirs
    from hf_reference import load_hf_model
    from tp_jax.serving.tokenizer import load_tokenizer
    ids = load_tokenizer(path).encode("Once upon a time")
    out = {}
    for dtype in ("float32", "bfloat16"):
        model = load_hf_model(path).to(getattr(torch, dtype))
        out[dtype] = {b: theirs(model, ids, b, tokens)[0] for b in batches}
        del model
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--dots", nargs="+", default=["float32"], choices=DOTS)
    ap.add_argument("--transformers", action="store_true", help="time transformers' decode step beside it")
    args = ap.parse_args()
    import jax
    from tp_jax.loaders.default import default_model_path
    from tp_jax.loaders.sources import open_checkpoint

    if args.transformers or any(k.startswith("torch") for k in args.dots):   # torch: only for its rows
        import torch
        torch.set_num_threads(os.cpu_count())
    path = args.model or default_model_path()
    cfg, source = open_checkpoint(path).config, open_checkpoint(path, config=False).source
    layer_shapes, head_shape, q, ff = shapes(cfg, source)
    out = {"model": path.rsplit("/", 1)[-1], "platform": jax.devices()[0].platform, "cpu_threads": os.cpu_count()}
    hf = transformers_steps(path, args.batch) if args.transformers else None
    if hf is not None:
        out["transformers_step_ms"] = {d: {f"batch{b}": round(s * 1e3, 2) for b, s in steps.items()}
                                       for d, steps in hf.items()}
    rng = np.random.default_rng(0)
    out["dots"] = []
    for kind in args.dots:
        make = torch_chain if kind.startswith("torch") else jax_chain
        run, nbytes = make(kind, layer_shapes, head_shape, cfg.num_layers, q, ff, rng)
        row = {"dots": kind, "weight_bytes": nbytes}
        for b in args.batch:
            ms = best_ms(run, rng.standard_normal((b, cfg.hidden_size), dtype=np.float32), args.repeat)
            row[f"batch{b}"] = {"step_ms": round(ms, 2), "read_GBps": round(nbytes / ms / 1e6, 2),
                                "tokens_per_s": round(b / ms * 1e3, 1)}
            if hf is not None:
                row[f"batch{b}"]["over_transformers_best"] = round(min(s[b] for s in hf.values()) * 1e3 / ms, 2)
        if 1 in args.batch and 8 in args.batch:
            row["floor_b8_over_b1"] = round(row["batch8"]["step_ms"] / row["batch1"]["step_ms"], 2)
        out["dots"].append(row)
        del run
    print(json.dumps(out))


if __name__ == "__main__":
    main()
