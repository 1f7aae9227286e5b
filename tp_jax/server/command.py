"""What every `tp-jax` subcommand shares: the engine flags, the one `LLM` they build, the exits.

* `add_engine_args(parser)`: the process's flags (simulated devices, many hosts) and one flag for
  each of EngineArgs' fields, the same for `serve` and `generate`; `llm_kwargs(args)` maps them onto
  `LLM`'s arguments and `build_llm(args, model)` builds it.
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
from tp_jax.serving.engine_args import add_cli_arguments, from_cli

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
# The project's user errors: every check of the user's input (arguments, files, checkpoints, configs,
# prompts) raises a ValueError subclass naming the problem and the fix (UnsupportedConfigError,
# CheckpointError, GGUFError, QuantizationError, ...), a missing file a FileNotFoundError, and a checkpoint
# that lacks tensors a MissingWeightError (a KeyError, as a mapping lookup raises). A bare KeyError,
# NotImplementedError, TypeError, ... is a bug: it prints its traceback and exits 1.
USER_ERRORS = (ValueError, FileNotFoundError, MissingWeightError)


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """Flags shared by `serve` and `generate`: the process's (simulated devices, many hosts), then one flag for
    each command-line field of EngineArgs (tp_jax/serving/engine_args.py), which `engine_args(args)` reads."""
    ap.add_argument("--simulate-devices", type=int, default=0,
                    help="N simulated CPU devices (per process; 0: real devices)")
    ap.add_argument("--coordinator-address", default=None,
                    help="many hosts: host:port of process 0 (or env JAX_COORDINATOR_ADDRESS); docs/multihost.md")
    ap.add_argument("--num-processes", type=int, default=None, help="many hosts: processes in the job "
                    "(or env JAX_NUM_PROCESSES)")
    ap.add_argument("--process-id", type=int, default=None, help="many hosts: this process, 0..N-1; 0 is the "
                    "driver (or env JAX_PROCESS_ID)")
    add_cli_arguments(ap)


def engine_args(args: argparse.Namespace, model: str | None = None):
    """The EngineArgs of a parsed command line (`model`: None for the embedded default)."""
    from tp_jax.multihost.distributed import is_driver
    return from_cli(args, model=model, progress=is_driver())


def llm_kwargs(args: argparse.Namespace) -> dict:
    """`LLM(**llm_kwargs(args))`: the command line's engine arguments as keywords (the model excluded)."""
    import dataclasses
    ea = engine_args(args)
    return {f.name: getattr(ea, f.name) for f in dataclasses.fields(ea) if f.name != "model"}


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
