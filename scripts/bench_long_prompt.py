"""A long prompt through chunked prefill: time and peak RSS, one JSON line.

    python scripts/bench_long_prompt.py [--prompt-tokens 8000 --max-model-len 8192 --tp 8 --simulate-devices 8]

The prompt (random token ids, seeded) is prefilled in chunks of --max-num-batched-tokens
tokens over the paged pool, so attention memory per layer is chunk x context, never a
[T, T] score matrix over the whole prompt. Reports load time, time to the first token,
time for the remaining tokens, the compiled step shapes, the KV pool, and the process's
peak RSS before and after generating. With --check, the first generated token is compared
with transformers' greedy next token on the same prompt (a full forward on torch CPU).
"""

import argparse
import json
import resource
import sys
import time

from tp_jax.serving import engine_args


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--simulate-devices", type=int, default=8)
    ap.add_argument("--check", action="store_true", help="compare the first token with transformers")
    engine_args.add_cli_arguments(ap)
    ap.set_defaults(tensor_parallel_size=8, max_model_len=8192, max_num_seqs=4)     # this benchmark's, said here
    return ap.parse_args(argv)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.simulate_devices:
        from tp_jax.multihost.devices import simulate_cpu_devices
        simulate_cpu_devices(args.simulate_devices)
    import numpy as np
    from tp_jax import LLM, SamplingParams
    t = time.perf_counter()
    llm = LLM(**vars(engine_args.from_cli(args, model=args.model, progress=False)))
    load_s = time.perf_counter() - t
    rss_loaded = peak_rss_mib()
    prompt = np.random.default_rng(0).integers(100, llm.config.vocab_size - 100, args.prompt_tokens).tolist()
    t = time.perf_counter()
    first = None
    for ev in llm.generate_stream([prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                                           ignore_eos=True)):
        if first is None:
            first = (time.perf_counter() - t, ev.token_id)
    total = time.perf_counter() - t
    core = llm.engine.core
    result = {"prompt_tokens": args.prompt_tokens, "max_model_len": args.max_model_len, "tp": args.tensor_parallel_size,
              "chunk_tokens": args.max_num_batched_tokens, "load_s": round(load_s, 2),
              "time_to_first_token_s": round(first[0], 2), "rest_s": round(total - first[0], 2),
              "steps": core.stats["steps"], "compiled_step_shapes": len(core.runner.compiled_shapes),
              "kv_pool": core.pool.describe(), "peak_rss_after_load_mib": round(rss_loaded),
              "peak_rss_mib": round(peak_rss_mib())}
    if args.check:
        import torch
        from hf_reference import load_hf_model
        model = load_hf_model(llm.model_path)
        with torch.no_grad():
            ref = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
        result["first_token_equals_transformers"] = ref == first[1]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
