"""Peak temporary memory of one MoE experts step per dispatch and expert method, from XLA's compiled program, one
JSON line per case (and, with --time N, the step's median seconds over N runs on zero weights).

    python scripts/bench_moe_memory.py [--sizes tiny gpt-oss-20b] [--tokens 8 512] [--methods ...]
                                       [--dispatches gather dense ragged] [--time 0] [--compare-whole]

`--compare-whole`: each quantized method also compiled with its kernels converted whole, as they were before
the expert GEMMs built them tile by tile, timed alternating with the tiles in the same process.
The routed experts of one layer (`Experts`, tp 1: every expert local) under each method: float32 and bf16 kernels
(what a dequantized MXFP4 checkpoint held), "mxfp4" (FP4 codes + E8M0 exponents; "mxfp4_bf16": its bf16 dots),
GPTQ 4-bit, FP8 and int8, with
each dispatch ("gather", "dense", "ragged"), for a decode-sized step (8 tokens) and a prefill-sized one (512).
`temp_bytes` is `compiled.memory_analysis().temp_size_in_bytes` (the program's scratch buffers at their peak,
compiled on the CPU; nothing is allocated), `float32_local_experts` the bytes of the local experts in float32:
a dispatch that converts the experts whole needs at least that much scratch. Sizes: "tiny" (tests/test_mxfp4.py's
gpt-oss: 4 experts, D 64, F 32) and "gpt-oss-20b" (one layer: 32 experts, D = F = 2880), top 4 of the experts.
"""

import argparse
import json

SIZES = {"tiny": (4, 64, 32, 2), "gpt-oss-20b": (32, 2880, 2880, 4)}     # E, D, F, top-k


def methods():
    """name -> (expert method or None: float, the kernels' dtype)."""
    import jax.numpy as jnp
    from tp_jax.parallel.layers.int8 import Int8
    from tp_jax.parallel.layers.packed import PackedExperts, PackedWeight

    def packed(*args, **kw):
        try:
            one = PackedWeight(*args, **kw)
        except Exception as e:                                   # a tree without the kind
            return e
        return PackedExperts((("gate_up", one), ("down", one)))
    return {"float32": (None, jnp.float32), "bf16": (None, jnp.bfloat16),
            "mxfp4": (packed("mxfp4", "fp4", 32, scale_dtype="uint8"), jnp.float32),
            "mxfp4_bf16": (packed("mxfp4", "fp4", 32, "bf16", scale_dtype="uint8"), jnp.float32),
            "gptq_int4": (packed("gptq", "int4", 32, scale_dtype="float16", zero=8), jnp.float32),
            "fp8": (packed("fp8", "fp8", 32), jnp.float32), "int8": (Int8(), jnp.float32)}


def compile_step(make, method, dispatch: str, args, whole: bool):
    """The experts step compiled from the abstract layer `make` builds; `whole`: `method`'s kernels converted
    whole, as every method did before the tiles (its class's `expert_tiles` read as 1 while tracing)."""
    import jax
    from flax import nnx
    graph, state = nnx.split(nnx.eval_shape(make))
    step = jax.jit(lambda s, x, ids, w: nnx.merge(graph, s)(x, ids, w, dispatch))
    if not whole:
        return state, step.lower(state, *args).compile()
    cls = type(method)
    saved, cls.expert_tiles = cls.expert_tiles, lambda self, layer, name, experts: 1
    try:
        return state, step.lower(state, *args).compile()
    finally:
        cls.expert_tiles = saved


def measure(size: str, method, dtype, dispatch: str, tokens: int, runs: int, compare_whole: bool) -> dict:
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from tp_jax.parallel.layers.moe import Experts
    from tp_jax.parallel.mesh import make_mesh
    e, d, f, k = SIZES[size]

    def make():
        layer = Experts(e, d, f, bias=True, activation="swigluoai", interleaved=True, dtype=dtype, rngs=nnx.Rngs(0))
        if method is not None:
            layer.use_method(method)
        return layer
    args = (jax.ShapeDtypeStruct((tokens, d), dtype), jax.ShapeDtypeStruct((tokens, k), jnp.int32),
            jax.ShapeDtypeStruct((tokens, k), jnp.float32))
    modes = ("tiles", "whole") if compare_whole and method is not None else ("tiles",)
    out, steps = {}, {}
    with jax.set_mesh(make_mesh(devices=jax.devices()[:1])):
        for mode in modes:
            state, steps[mode] = compile_step(make, method, dispatch, args, mode == "whole")
            key = "temp_bytes" if mode == "tiles" else "temp_bytes_whole"
            out[key] = steps[mode].memory_analysis().temp_size_in_bytes
        if runs:
            params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), state)
            x = jnp.ones((tokens, d), dtype)
            ids = jnp.asarray(np.arange(tokens * k).reshape(tokens, k) % e, jnp.int32)
            w = jnp.full((tokens, k), 1.0 / k, jnp.float32)
            times = {mode: [] for mode in modes}
            for step in steps.values():
                step(params, x, ids, w).block_until_ready()
            for _ in range(runs):                                  # the modes alternate, round by round
                for mode, step in steps.items():
                    t = time.perf_counter()
                    step(params, x, ids, w).block_until_ready()
                    times[mode].append(time.perf_counter() - t)
            for mode, t in times.items():
                out["median_s" if mode == "tiles" else "median_s_whole"] = round(float(np.median(t)), 5)
        return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 512])
    ap.add_argument("--methods", nargs="+", default=None)
    ap.add_argument("--dispatches", nargs="+", default=["gather", "dense", "ragged"])
    ap.add_argument("--time", type=int, default=0, help="runs to time each step (0: memory only)")
    ap.add_argument("--compare-whole", action="store_true", help="also each method's kernels converted whole (as "
                    "before the tiles): `temp_bytes_whole`, `median_s_whole`, timed alternating with the tiles")
    args = ap.parse_args()
    import tp_jax
    table = methods()
    for size in args.sizes:
        e, d, f, _ = SIZES[size]
        for name in args.methods or list(table):
            method, dtype = table[name]
            for dispatch in args.dispatches:
                for tokens in args.tokens:
                    line = {"tree": tp_jax.__file__.rsplit("/tp_jax/", 1)[0], "size": size, "method": name,
                            "dispatch": dispatch, "tokens": tokens, "float32_local_experts": 3 * e * d * f * 4}
                    if isinstance(method, Exception):
                        line["error"] = str(method)
                    else:
                        line.update(measure(size, method, dtype, dispatch, tokens, args.time, args.compare_whole))
                    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
