"""The `tp-jax` command (installed with the package), vLLM's `vllm serve` shape.

    tp-jax serve [MODEL] --tp 8 [--host 0.0.0.0 --port 8000 --api-key KEY ...]   an OpenAI-compatible server
    tp-jax generate --model MODEL --tp 8 --prompt "Once upon a time"              text from prompts

Without MODEL, the embedded SmolLM2-135M-Instruct. `--simulate-devices N` runs on N CPU
devices (any machine). Many hosts: every process starts the same command with its
`--process-id` (or the JAX_* environment, or SLURM / Open MPI); process 0 serves HTTP and
drives, the others follow its steps (docs/multihost.md). `scripts/generate.py` is
`tp-jax generate`. Bad arguments end with one `error: ...` line and exit code 2, Ctrl-C
while loading with one line and 130.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from tp_jax.parallel.layers.quantization import quantization_choices

EXIT_INTERRUPTED = 130


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """Flags shared by `serve` and `generate`: parallel sizes, devices, many hosts, limits."""
    ap.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, dest="tp")
    ap.add_argument("--pipeline-parallel-size", "--pp", type=int, default=1, dest="pp")
    ap.add_argument("--data-parallel-size", "--dp", type=int, default=1, dest="dp")
    ap.add_argument("--simulate-devices", type=int, default=0,
                    help="N simulated CPU devices (per process; 0: real devices)")
    ap.add_argument("--coordinator-address", default=None,
                    help="many hosts: host:port of process 0 (or env JAX_COORDINATOR_ADDRESS); docs/multihost.md")
    ap.add_argument("--num-processes", type=int, default=None, help="many hosts: processes in the job "
                    "(or env JAX_NUM_PROCESSES)")
    ap.add_argument("--process-id", type=int, default=None, help="many hosts: this process, 0..N-1; 0 is the "
                    "driver (or env JAX_PROCESS_ID)")
    ap.add_argument("--max-model-len", type=int, default=None, help="context length (default min(2048, the model's))")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--quantization", "-q", default="auto", choices=quantization_choices(),
                    help="how weights are held: auto (a quantized .gguf stays quantized, on CPU with bf16 dots; "
                         "else as stored), none (float), bf16, int8 (weight-only, per output channel), w8a8 (int8 "
                         "weights and activations), gguf (keep GGUF blocks, float32 dots), gguf_bf16, gguf_int8; "
                         "docs/quantization.md")
    ap.add_argument("--unroll-layers", action="store_true",
                    help="one array per layer, layers unrolled: faster decode on CPU, ~10x compile time per shape")
    ap.add_argument("--enable-expert-parallel", action="store_true",
                    help="MoE models: whole experts on the dp x tp devices of each stage (default: each expert "
                         "split over tp)")
    ap.add_argument("--no-compile-cache", action="store_true",
                    help="do not read or write JAX's compilation cache (default ~/.cache/tp_jax/xla, "
                         "or env TP_JAX_COMPILE_CACHE)")


def build_parser() -> argparse.ArgumentParser:
    from tp_jax.server import generate, serve
    ap = argparse.ArgumentParser(prog="tp-jax", description="Tensor-parallel LLM inference in JAX.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="{serve,generate}")
    serve.add_args(sub.add_parser("serve", help="an OpenAI-compatible HTTP server",
                                  description=serve.__doc__.splitlines()[0]))
    generate.add_args(sub.add_parser("generate", help="generate text from prompts (as scripts/generate.py)",
                                     description=generate.__doc__.splitlines()[0]))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(args.run, args)


def run_command(fn, args) -> int:
    """fn(args) with the command line's exits (tp_jax/serving/cli.py): 0 done, 2 bad input (one `error:`
    line), 3 a dead peer; Ctrl-C before a server is up: one line and 130."""
    signal.signal(signal.SIGINT, stop_on_ctrl_c)
    from tp_jax.serving.cli import run_cli
    return run_cli(lambda: fn(args))


def stop_on_ctrl_c(signum, frame) -> None:
    """Ctrl-C: one line and exit 130 at once, wherever we are (loading, compiling, generating).

    Exits without unwinding: a KeyboardInterrupt can land inside JAX (a 46-line traceback) or
    in a gc callback (where Python ignores it), and in a multi-process run the other processes
    must see this one end rather than wait for it at JAX's exit barrier. A running server
    replaces it with its own graceful stop (tp_jax/server/serve.py).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sys.stdout.flush()
    except (OSError, RuntimeError, ValueError):
        pass
    os.write(2, b"\ninterrupted (SIGINT): stopped\n")          # after a progress bar or a ^C
    os._exit(EXIT_INTERRUPTED)


def env_default(name: str) -> str | None:
    return os.environ.get(name) or None


if __name__ == "__main__":
    sys.exit(main())
