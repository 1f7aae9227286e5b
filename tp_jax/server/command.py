"""What every `tp-jax` subcommand shares: the engine flags, the one `LLM` they build, the exits.

* `add_engine_args(parser)`: the flags of `LLM(...)` (parallel sizes, devices, many hosts,
  dtype, quantization, the engine's limits and KV pool, its seed), the same for `serve` and
  `generate`; `llm_kwargs(args)` maps them onto `LLM`'s arguments and `build_llm(args, model)`
  builds it.
* `run_command(fn, args)`: exit codes: 0 done; 2 the user's own mistake, one `error: ...` line
  (`USER_ERRORS`); 3 a dead peer (tp_jax.multihost); Ctrl-C while loading, one line and 130.
  Anything else is a bug: its traceback, exit 1.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable

from tp_jax.loaders.bind import MissingWeightError
from tp_jax.parallel.layers.quantization import quantization_choices
from tp_jax.parallel.layers.stack import LAYER_LOOPS

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
# The project's user errors: every check of the user's input (arguments, files, checkpoints, configs,
# prompts) raises a ValueError subclass naming the problem and the fix (UnsupportedConfigError,
# CheckpointError, GGUFError, QuantizationError, ...), a missing file a FileNotFoundError, and a checkpoint
# that lacks tensors a MissingWeightError (a KeyError, as a mapping lookup raises). A bare KeyError,
# NotImplementedError, TypeError, ... is a bug: it prints its traceback and exits 1.
USER_ERRORS = (ValueError, FileNotFoundError, MissingWeightError)


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """Flags shared by `serve` and `generate`: every `LLM(...)` argument but the model (`llm_kwargs`)."""
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
                    help="how weights are held: auto (a quantized .gguf: w8a8x2_bf16 on CPU, its blocks elsewhere; "
                         "else as stored), none (float), bf16, int8 (weight-only, per output channel), w8a8 (int8 "
                         "weights and activations), w8a8x2 (int8 weights, activations as two int8 digits), w8a8x2_bf16 "
                         "(int8 and bf16 weights: w8a8x2 up to 4 rows, 24 with AMX, bf16 above), gguf "
                         "(keep GGUF blocks, float32 dots), gguf_bf16, gguf_int8; docs/quantization.md")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="running sequences per dp replica")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step per dp replica "
                    "(the prefill chunk)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    ap.add_argument("--num-gpu-blocks", type=int, default=None, help="KV cache blocks per dp replica "
                    "(default: from the memory budget)")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV cache bytes per device "
                    "(instead of a fraction of device memory)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="accelerators: the fraction of each "
                    "device's memory in use once the KV pool is allocated")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="reuse the KV blocks of shared prompt prefixes")
    ap.add_argument("--num-microbatches", type=int, default=None, help="pipeline micro-batches per dp replica "
                    "(default: --pp)")
    ap.add_argument("--seed", type=int, default=0, help="the engine's randomness for unseeded requests")
    ap.add_argument("--attention-backend", default="auto",
                    help="paged attention: auto (bf16 on a CPU with AMX when the weights run bf16 dots, else "
                         "reference), reference, bf16 (bf16 dot operands, float32 accumulation), or jax_nn "
                         "(jax.nn.dot_product_attention, cuDNN on GPUs); "
                         "models/attention.py PAGED_BACKENDS")
    ap.add_argument("--layer-loop", choices=LAYER_LOOPS, default="auto",
                    help="how a step runs the decoder layers: scan (stacked weights), switch (per-layer weights "
                         "in a loop, read in place), unrolled (~10x compile time per shape); auto: switch on "
                         "one CPU device, scan elsewhere (docs/performance.md)")
    ap.add_argument("--enable-expert-parallel", action="store_true",
                    help="MoE models: whole experts on the dp x tp devices of each stage (default: each expert "
                         "split over tp)")
    ap.add_argument("--no-compile-cache", action="store_true",
                    help="do not read or write JAX's compilation cache (default ~/.cache/tp_jax/xla, "
                         "or env TP_JAX_COMPILE_CACHE)")


def llm_kwargs(args: argparse.Namespace) -> dict:
    """`LLM(model, **llm_kwargs(args))`: the engine flags as `LLM`'s keyword arguments."""
    from tp_jax.multihost.distributed import is_driver
    return dict(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, data_parallel_size=args.dp,
                dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                num_gpu_blocks=args.num_gpu_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=args.enable_prefix_caching,
                num_microbatches=args.num_microbatches, seed=args.seed, progress=is_driver(),
                compile_cache=not args.no_compile_cache, attention_backend=args.attention_backend,
                layer_loop=args.layer_loop, quantization=args.quantization,
                enable_expert_parallel=args.enable_expert_parallel)


def build_llm(args: argparse.Namespace, model: str | None):
    """The `LLM` a subcommand runs: `model` (None: the embedded default) with the engine flags."""
    from tp_jax.serving.llm import LLM
    return LLM(model, **llm_kwargs(args))


def initialize(args: argparse.Namespace) -> None:
    """jax.distributed for many hosts (the flags or the environment), simulated devices; before any device work."""
    from tp_jax.multihost.distributed import initialize as start
    start(args.coordinator_address, args.num_processes, args.process_id, simulate_devices=args.simulate_devices)


def run_command(fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """fn(args)'s exit code; a user error -> one `error:` line and 2; a dead peer -> see tp_jax.multihost;
    Ctrl-C before a server is up: one line and 130 (`stop_on_ctrl_c`); a bug -> its traceback and 1."""
    signal.signal(signal.SIGINT, stop_on_ctrl_c)
    try:
        return fn(args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except Exception as e:
        jax = sys.modules.get("jax")                     # asked without starting a backend
        if jax is not None and jax.distributed.is_initialized() and isinstance(e, jax.errors.JaxRuntimeError):
            from tp_jax.multihost.distributed import raise_unless_peer_died
            raise_unless_peer_died(e)            # a dead peer: the supervisor says so and exits 3
        raise


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
