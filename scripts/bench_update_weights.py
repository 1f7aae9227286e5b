"""`LLM.update_weights` against a fresh `LLM(...)` of the same weights, side by side in one run: one JSON line.

    python scripts/bench_update_weights.py [--model X.gguf|DIR] [--quantization none] [--tp 1]

The weights are the checkpoint's own tensors as device arrays (what a trainer holds: the embedded SmolLM2 GGUF's
dequantized to float32, by default). `update_s` is `llm.update_weights(arrays)` (checks, on-device placement,
the swap), `fresh_s` is `LLM(model)` loading the same weights from disk, each the best of `--repeat`
(`first_update_s`: the first update, which also compiles each param's placement program); `device_bytes`
and `host_bytes` are what the update moved device to device and through the host (int8's per-device quantization).
`equal` says whether the updated engine's greedy tokens and logprobs equal the fresh engine's. GGUF blocks cannot
be refilled from arrays, so the engine holds float (`--quantization none`, default) or bf16 / int8 weights.
"""

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--quantization", default="none", help="LLM(quantization=...): none, bf16 or int8")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tp_jax import LLM, SamplingParams
    from tp_jax.loaders.default import default_model_path
    from tp_jax.loaders.sources import open_checkpoint
    path = args.model or default_model_path()
    kw = dict(quantization=args.quantization, tensor_parallel_size=args.tp, progress=False, compile_cache=False)
    source = open_checkpoint(path).source
    arrays = {k: jnp.asarray(np.asarray(source.get(k)[...], np.float32)) for k in source.keys()}
    jax.block_until_ready(list(arrays.values()))
    fresh_s, update_s, moved = [], [], {}
    for _ in range(args.repeat):
        t = time.perf_counter()
        fresh = LLM(path, **kw)
        fresh_s.append(time.perf_counter() - t)
    llm = fresh
    for _ in range(args.repeat):
        t = time.perf_counter()
        moved = llm.update_weights(arrays)
        update_s.append(time.perf_counter() - t)
    sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    prompts = [[1, 2, 3, 4, 5, 6], [42, 43, 44]]
    got = [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in llm.generate(prompts, sp)]
    want = [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in LLM(path, **kw).generate(prompts, sp)]
    print(json.dumps({"model": path.rstrip("/").rsplit("/", 1)[-1], "quantization": args.quantization, "tp": args.tp,
                      "method_held": llm.quantization, "update_s": round(min(update_s), 3),
                      "first_update_s": round(update_s[0], 3),
                      "fresh_s": round(min(fresh_s), 3), "update_over_fresh": round(min(update_s) / min(fresh_s), 3),
                      "device_bytes": moved["device_bytes"], "host_bytes": moved["host_bytes"],
                      "params": moved["params"], "equal": got == want, "device": jax.devices()[0].device_kind}))


if __name__ == "__main__":
    main()
