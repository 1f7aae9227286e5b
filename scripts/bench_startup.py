"""Start-up cost of `LLM()`: the first call in a fresh process against a second, one JSON line.

    python scripts/bench_startup.py [--model X.gguf|DIR] [--compile-cache] [--import-transformers]
                                    [--layer-loop auto scan switch] [--quantization auto]

`import_s` is importing jax (and starting its CPU client) and tp_jax; `cold_s` the first
`LLM(model)` in this process (it imports transformers for the config and tokenizer, which
imports torch when torch is installed: `torch_imported` says whether it did); `warm_s` a
second `LLM(model)` in the same process. The compile cache is off unless `--compile-cache`,
so both calls compile. `cold_over_warm` is the one-time cost as a ratio. With
`--import-transformers`, transformers' config and tokenizer modules are imported before the
clock for `cold_s` starts (counted in `import_s`); what remains of the ratio is the model's
config module, which transformers imports on first use (and torch with it, when installed).

Then each `--layer-loop` (`LLM(layer_loop=...)`, default auto) is loaded again in the same process
("layer_loops": one entry each, side by side): `load_s` is that `LLM(model)` (the per-layer split of
"switch" included), `decode_compile_s` / `prefill_compile_s` the compile seconds (JAX's
own compile events) of the engine's smallest decode step shape and of its prefill-chunk shape, at
`--quantization` (default auto: the embedded GGUF as w8a8x2_bf16 under the switched loop on one CPU device, w8a8x2
under the scan).
"""

import argparse
import json
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--compile-cache", action="store_true", help="use the persistent compile cache")
    ap.add_argument("--import-transformers", action="store_true",
                    help="import transformers' config and tokenizer modules before the first LLM()")
    ap.add_argument("--layer-loop", nargs="+", default=["auto"], choices=["auto", "scan", "switch"],
                    help="LLM(layer_loop=...): each loaded and its step shapes compiled, side by side")
    ap.add_argument("--quantization", default="auto", help="LLM(quantization=...) of the layer-loop loads")
    args = ap.parse_args()
    t = time.perf_counter()
    import jax
    import jax.numpy as jnp
    jax.block_until_ready(jnp.ones(2))
    from tp_jax import LLM
    from tp_jax.loaders.default import default_model_path
    if args.import_transformers:
        import transformers.configuration_utils  # noqa: F401
        import transformers.models.auto.tokenization_auto  # noqa: F401
    imported = time.perf_counter() - t
    path = args.model or default_model_path()
    times = []
    for _ in range(2):
        t = time.perf_counter()
        LLM(path, progress=False, compile_cache=args.compile_cache)
        times.append(time.perf_counter() - t)
    loops = [layer_loop_costs(LLM, path, loop, args) for loop in args.layer_loop]
    print(json.dumps({"model": path.rstrip("/").rsplit("/", 1)[-1], "import_s": round(imported, 2),
                      "cold_s": round(times[0], 2), "warm_s": round(times[1], 2),
                      "cold_over_warm": round(times[0] / times[1], 2),
                      "transformers_imported_first": args.import_transformers, "torch_imported": "torch" in sys.modules,
                      "layer_loops": loops}))


def layer_loop_costs(LLM, path: str, loop: str, args) -> dict:
    """Load time and per-shape compile time of `LLM(path, layer_loop=loop)`."""
    from tp_jax.serving.stats import CompileClock
    CompileClock.start()
    t = time.perf_counter()
    llm = LLM(path, progress=False, compile_cache=args.compile_cache, layer_loop=loop, quantization=args.quantization)
    out = {"layer_loop": loop, "runs": llm.layer_loop, "weights": llm.quantization,
           "load_s": round(time.perf_counter() - t, 2)}
    core = llm.engine.core
    shapes = core.warmup_shapes()
    for name, shape in (("decode", shapes[0]), ("prefill", shapes[-1])):
        before = CompileClock.total
        core.warmup([shape])
        out[f"{name}_compile_s"] = round(CompileClock.total - before, 2)
    return out


if __name__ == "__main__":
    main()
