"""What prompt logprobs cost, side by side in one run; prints one JSON line.

    .venv/bin/python scripts/bench_prompt_logprobs.py [--model PATH] [--prompt-len 512] [--k 1] [--rows 64] [--repeats 5]

* `prefill_s` / `prefill_scored_s`: one prompt (max_tokens=1), without and with
  `prompt_logprobs=k` (the scored run computes [T, V] logits for its T prompt positions);
  min of `--repeats` after a warm-up of each.
* `plan_us_per_step`: the host-side cost every step pays for the feature when no row asks
  (`prompt_logprobs.plan` on a batch of `--rows` decode rows), next to `decode_step_s`,
  one such step's time (the device program itself is unchanged).
Default model: the embedded SmolLM2-135M (vocab 49,152), tp = 1.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--k", type=int, default=1, help="prompt_logprobs (top-k per prompt token)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from tp_jax.serving import prompt_logprobs
    from tp_jax.serving.batch import build_batch
    from tp_jax.serving.llm import LLM
    from tp_jax.serving.sampling import SamplingParams

    llm = LLM(args.model, max_num_batched_tokens=args.prompt_len, enable_prefix_caching=False, progress=False)
    prompt = np.random.default_rng(0).integers(100, llm.config.vocab_size - 100, args.prompt_len).tolist()

    def best(params) -> float:
        llm.generate(prompt, params)
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            llm.generate(prompt, params)
            times.append(time.perf_counter() - t)
        return min(times)

    plain = best(SamplingParams(max_tokens=1, temperature=0.0))
    scored = best(SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=args.k))
    core = llm.engine.core
    for i in range(args.rows):                                   # a decode-only step of `rows` rows
        llm.engine.add_request(f"d{i}", prompt[:8], SamplingParams(max_tokens=3, temperature=0.0))
    core.step()
    out = core.scheduler.schedule()
    batch = build_batch(out, [b.tables for b in core.scheduler.blocks], core.config.block_size, core.microbatches,
                        split_k=core.split_k)
    n = 2000
    t = time.perf_counter()
    for _ in range(n):
        prompt_logprobs.plan(batch, core.vocab_size)
    plan_us = (time.perf_counter() - t) / n * 1e6
    step_plan = core._plan(batch)
    core.runner.execute(step_plan)                               # compile; the timed run writes the same slots
    t = time.perf_counter()
    core.runner.execute(step_plan)
    step = time.perf_counter() - t
    core.scheduler.update(out)
    print(json.dumps({"model": llm.model_path, "prompt_len": args.prompt_len, "k": args.k, "prefill_s": round(plain, 4),
                      "prefill_scored_s": round(scored, 4), "scored_ratio": round(scored / plain, 3),
                      "rows": args.rows, "plan_us_per_step": round(plan_us, 2), "decode_step_s": round(step, 5)}))


if __name__ == "__main__":
    main()
