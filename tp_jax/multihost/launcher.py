"""Start N processes of one program on this machine, as `jax.distributed` peers (tests, laptops).

Each rank gets `JAX_COORDINATOR_ADDRESS` (a free loopback port), `JAX_NUM_PROCESSES`,
`JAX_PROCESS_ID` and, with `devices_per_process=M`, M simulated CPU devices (XLA_FLAGS,
NPROC >= 2M, a collective timeout). Output lines are prefixed `[rank i]`. When a rank fails
the others are stopped (SIGTERM, then SIGKILL after `grace_s`: JAX traps SIGTERM) and the
launch fails naming that rank, with its exit code (3, a dead peer, when a signal killed it);
`timeout_s` bounds the whole job.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from tp_jax.multihost.supervisor import EXIT_PEER_LOST

EXIT_TIMEOUT = 124


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, num_processes: int, port: int, devices_per_process: int, base=os.environ) -> dict:
    """The environment of one rank."""
    env = dict(base, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(num_processes),
               JAX_PROCESS_ID=str(rank), PYTHONUNBUFFERED="1")
    if devices_per_process:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
        if not any("collective_call_terminate_timeout" in f for f in flags):
            timeout = env.get("TP_JAX_COLLECTIVE_TIMEOUT", "120")
            flags.append(f"--xla_cpu_collective_call_terminate_timeout_seconds={timeout}")
        env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu",
                   NPROC=str(max(int(env.get("NPROC") or 0), 2 * devices_per_process, 16)))
    return env


# Linux: a rank gets SIGKILL if the launcher itself dies (PR_SET_PDEATHSIG survives exec), so no
# orphans. A tiny exec wrapper rather than `preexec_fn`, which forks a possibly multithreaded parent.
_DIE_WITH_PARENT = ("import ctypes, os, sys\n"
                    "try: ctypes.CDLL(None).prctl(1, 9)\n"
                    "except (OSError, AttributeError): pass\n"
                    "os.execvp(sys.argv[1], sys.argv[1:])")


def _pump(rank: int, stream, out, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        with lock:
            out.write(f"[rank {rank}] {raw.decode(errors='replace').rstrip()}\n")
            out.flush()


def _command(argv: Sequence[str]) -> list[str]:
    argv = list(argv)
    argv = [sys.executable, *argv] if argv[0].endswith(".py") else argv
    return [sys.executable, "-c", _DIE_WITH_PARENT, *argv] if sys.platform == "linux" else argv


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def stop(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every running rank's process group, then SIGKILL what is left after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        while sig == signal.SIGTERM and time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
    for p in procs:
        p.wait()


def launch(argv: Sequence[str], num_processes: int, devices_per_process: int = 0, *, timeout_s: float = 0,
           grace_s: float = 3.0, port: int | None = None, out=None) -> int:
    """Run `argv` (a `.py` file runs under this Python) as ranks 0..N-1; 0 when all succeed."""
    if num_processes < 1 or devices_per_process < 0:
        raise ValueError(f"launch: num_processes={num_processes} must be >= 1 and devices_per_process="
                         f"{devices_per_process} >= 0")
    if not argv:
        raise ValueError("launch: no program given; pass it after `--`, e.g. -- scripts/generate.py --tp 4")
    out = out or sys.stdout
    port = port or free_port()
    lock = threading.Lock()
    procs, pumps = [], []
    for rank in range(num_processes):
        p = subprocess.Popen(_command(argv), env=rank_env(rank, num_processes, port, devices_per_process),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        pumps.append(threading.Thread(target=_pump, args=(rank, p.stdout, out, lock), daemon=True))
        pumps[-1].start()
    try:
        code = _watch(procs, timeout_s, grace_s, lock)
    finally:
        stop(procs, grace_s)                      # also on KeyboardInterrupt
        for t, p in zip(pumps, procs):
            t.join(timeout=5)
            p.stdout.close()
    return code


def _watch(procs: list[subprocess.Popen], timeout_s: float, grace_s: float, lock: threading.Lock) -> int:
    start = time.monotonic()
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0], codes[failed[0]]
            running = [r for r, c in enumerate(codes) if c is None]
            stop(procs, grace_s)
            _say(lock, f"rank {rank} failed ({_describe(code)}); stopped ranks {running}. See the "
                       f"[rank {rank}] lines above for its error.")
            return code if code > 0 else EXIT_PEER_LOST
        if all(c == 0 for c in codes):
            return 0
        if timeout_s and time.monotonic() - start > timeout_s:
            running = [r for r, c in enumerate(codes) if c is None]
            stop(procs, grace_s)
            _say(lock, f"timed out after {timeout_s:.0f}s with ranks {running} still running (a hung or "
                       f"waiting peer?); all ranks stopped. Raise --timeout if the job is just slow.")
            return EXIT_TIMEOUT
        time.sleep(0.1)


def _say(lock: threading.Lock, msg: str) -> None:
    with lock:
        print(f"launch: {msg}", file=sys.stderr, flush=True)
