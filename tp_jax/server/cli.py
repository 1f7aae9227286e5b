"""The `tp-jax` command (installed with the package), vLLM's `vllm serve` shape.

    tp-jax serve [MODEL] --tp 8 [--host 0.0.0.0 --port 8000 --api-key KEY ...]   an OpenAI-compatible server
    tp-jax generate --model MODEL --tp 8 --prompt "Once upon a time"              text from prompts

Without MODEL, the embedded SmolLM2-135M-Instruct. `--simulate-devices N` runs on N CPU
devices (any machine). Many hosts: every process starts the same command with its
`--process-id` (or the JAX_* environment, or SLURM / Open MPI); process 0 serves HTTP and
drives, the others follow its steps (docs/multihost.md). `scripts/generate.py` is
`tp-jax generate`. Both subcommands take the same engine flags (tp_jax/server/command.py).
The user's own mistakes end with one `error: ...` line and exit code 2, a bug with its
traceback and 1, Ctrl-C while loading with one line and 130.
"""

from __future__ import annotations

import argparse
import sys

from tp_jax.server import generate, serve
from tp_jax.server.command import run_command


def build_parser() -> argparse.ArgumentParser:
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


if __name__ == "__main__":
    sys.exit(main())
