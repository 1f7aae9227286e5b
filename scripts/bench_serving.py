"""Serving throughput and latency: tp_jax's engine vs transformers' continuous batching, one JSON line.

    python scripts/bench_serving.py [--num-requests 64 --prompt-len 8 512 --output-len 8 256 --rate inf]
                                    [--tp 1 --simulate-devices N] [--quantization auto]
                                    [--hf-dtypes float32 bfloat16] [--no-transformers] [--server URL]

A fixed synthetic workload (seeded): random prompt token ids and output lengths drawn
uniformly from the ranges, greedy, EOS ignored (every request makes exactly its output
length); arrivals all at once (--rate inf) or Poisson at --rate requests/s. The same
requests go to tp_jax's engine (in process, after a warm-up pass that compiles its step
shapes; the prefix cache is reset before the timed pass) and to transformers'
`generate_batch` machinery (its ContinuousBatchingManager on torch CPU, per-request output
lengths, per-token timestamps). With --server, the workload is sent to a running
OpenAI-compatible server instead (streaming completions; tp_jax or any other).

Reported per engine: output tokens/s, requests/s, time to first token and time per output
token (p50 / p99, seconds), and for tp_jax the KV blocks used at peak, preemptions, step
count and compiled step shapes. transformers runs in each of --hf-dtypes; `speedup` = tp_jax
output tokens/s / transformers' in its faster dtype (`transformers_best`).
"""

import argparse
import json
import os
import sys
import time

import numpy as np

from tp_jax.server.bench_client import summarize
from tp_jax.serving import engine_args


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[8, 512], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[8, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--rate", type=float, default=float("inf"), help="requests/s, Poisson (inf: all at once)")
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens of a system prompt every request starts with")
    ap.add_argument("--simulate-devices", type=int, default=0)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--hf-dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--server", default=None, help="base URL of a running OpenAI-compatible server")
    engine_args.add_cli_arguments(ap)                     # the engine's flags, as `tp-jax serve` has them (--seed: the
    return ap.parse_args(argv)                            # workload's too)


def make_workload(args, vocab: int) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    gaps = np.zeros(n) if np.isinf(args.rate) else rng.exponential(1 / args.rate, n)
    arrivals = np.cumsum(gaps) - gaps[0]
    out, shared = [], rng.integers(100, vocab - 100, args.shared_prefix).tolist()
    for i in range(n):
        plen = int(rng.integers(args.prompt_len[0], args.prompt_len[1] + 1))
        out.append({"id": f"b{i}", "prompt": shared + rng.integers(100, vocab - 100, plen).tolist(),
                    "max_tokens": int(rng.integers(args.output_len[0], args.output_len[1] + 1)),
                    "arrival": float(arrivals[i])})
    return out


def run_ours(llm, work: list[dict]) -> tuple[dict, dict]:
    from tp_jax.serving.sampling import SamplingParams
    engine = llm.engine
    pending = sorted(work, key=lambda w: w["arrival"])
    records, peak_blocks = {}, 0
    t0 = time.monotonic()
    while pending or engine.has_unfinished():
        now = time.monotonic() - t0
        while pending and pending[0]["arrival"] <= now:
            w = pending.pop(0)
            engine.add_request(w["id"], w["prompt"], SamplingParams(max_tokens=w["max_tokens"], temperature=0.0,
                                                                    ignore_eos=True), arrival_time=t0 + w["arrival"])
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0]["arrival"] - now))
            continue
        for out in engine.step():
            if out.finished:
                m = out.metrics
                records[out.request_id] = {"arrival": m.arrival_time, "first": m.first_token_time,
                                           "done": m.finished_time, "n": len(out.outputs[0].token_ids)}
        peak_blocks = max(peak_blocks, engine.core.kv_usage()[0])
    wall = time.monotonic() - t0
    return summarize(list(records.values()), wall), {"peak_kv_blocks": peak_blocks}


def bench_ours(args, work):
    from tp_jax import LLM
    from tp_jax.serving.stats import CompileClock
    CompileClock.start()
    llm = LLM(**vars(engine_args.from_cli(args, model=args.model, progress=False)))
    t = time.monotonic()
    run_ours(llm, work)                                   # warm-up: compiles the step shapes it needs
    warm = time.monotonic() - t
    core = llm.engine.core
    core.reset_prefix_cache()
    before = dict(core.stats)
    compile0 = CompileClock.total
    hits0 = core.prefix_cache_counts()[1]
    summary, extra = run_ours(llm, work)
    delta = lambda k: core.stats[k] - before[k]
    summary.update(extra, quantization=llm.quantization, attention_backend=llm.setup.attention_backend,
                   preemptions=delta("preemptions"), steps=delta("steps"),
                   scheduled_tokens=delta("scheduled_tokens"),
                   prefix_cache_hit_tokens=core.prefix_cache_counts()[1] - hits0,
                   kv_pool_blocks=core.pool.num_blocks, compiled_step_shapes=len(core.runner.compiled_shapes),
                   warmup_s=round(warm, 1), compile_s_in_timed_run=round(CompileClock.total - compile0, 2))
    return llm, summary


def bench_transformers(model_path: str, work: list[dict], dtype: str) -> dict:
    from transformers import GenerationConfig
    from hf_reference import load_hf_model
    model = load_hf_model(model_path, dtype, attn_implementation="sdpa")
    cfg = GenerationConfig(max_new_tokens=max(w["max_tokens"] for w in work), do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    return _run_transformers(model, cfg, work)


def _run_transformers(model, cfg, work) -> dict:
    pending = sorted(work, key=lambda w: w["arrival"])
    records = {}
    with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5) as manager:
        t0 = time.perf_counter()
        ids = {}
        while pending or len(records) < len(work):
            now = time.perf_counter() - t0
            while pending and pending[0]["arrival"] <= now:
                w = pending.pop(0)
                rid = manager.add_request(w["prompt"], request_id=w["id"], max_new_tokens=w["max_tokens"],
                                          record_timestamps=True)
                ids[rid] = w
            result = manager.get_result(timeout=0.05)
            if result is not None and result.is_finished():
                w = ids[result.request_id]
                stamps = result.timestamps or []
                first = stamps[0] - t0 if stamps else result.lifespan[1] - t0
                records[result.request_id] = {"arrival": w["arrival"], "first": first,
                                              "done": result.lifespan[1] - t0, "n": len(result.generated_tokens)}
        wall = time.perf_counter() - t0
    return summarize(list(records.values()), wall)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.simulate_devices:
        from tp_jax.multihost.devices import simulate_cpu_devices
        simulate_cpu_devices(args.simulate_devices)
    import jax
    if args.server:
        from tp_jax.server.bench_client import bench_server
        work = make_workload(args, vocab=int(os.environ.get("BENCH_VOCAB", "49152")))
        print(json.dumps({"server": args.server, **bench_server(args.server, work)}))
        return 0
    from tp_jax.loaders.sources import open_checkpoint
    from tp_jax.loaders.default import default_model_path
    model_path = default_model_path() if args.model is None else args.model
    _, cfg = open_checkpoint(model_path)
    work = make_workload(args, cfg.vocab_size)
    result = {"model": os.path.basename(model_path), "platform": jax.default_backend(), "tp": args.tensor_parallel_size,
              "pp": args.pipeline_parallel_size, "layer_loop": args.layer_loop, "dp": args.data_parallel_size, "num_requests": args.num_requests, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "shared_prefix": args.shared_prefix,
              "rate": "inf" if np.isinf(args.rate) else args.rate}
    llm, result["tp_jax"] = bench_ours(args, work)
    if not args.no_transformers:
        result["transformers"] = {dt: bench_transformers(llm.model_path, work, dt) for dt in args.hf_dtypes}
        best = max(result["transformers"], key=lambda dt: result["transformers"][dt]["output_tokens_per_s"])
        result["transformers_best"] = best
        result["speedup"] = round(result["tp_jax"]["output_tokens_per_s"]
                                  / result["transformers"][best]["output_tokens_per_s"], 2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
