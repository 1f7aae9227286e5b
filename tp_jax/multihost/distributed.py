"""Many hosts: one program on every process, process 0 the driver (vLLM's multi-node executor).

* `initialize(...)`: `jax.distributed.initialize` from flags, the environment
  (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`) or, on a SLURM / Open MPI
  cluster, JAX's auto-detection; with bounded waits and errors that name the fix.
* `share_from_driver`: a JSON-able value computed on process 0, broadcast to every process
  (the front door sends its request this way), so all build the same batch.
* `agree(what, values)`: every process must hold the same settings (model, sizes, seed).
* `to_global(x, sharding)`: a host array onto a sharding that may span processes (each
  process fills only its own devices); `to_host(tree)`: sharded results back as numpy on
  every process, even when they live on other processes' devices.
* A dead peer ends every other process within the heartbeat timeout (default 10 s) with one
  line naming it and exit code 3 (`supervisor.py`); `raise_unless_peer_died(e)` keeps a
  collective's error (Gloo: "Connection closed by peer") quiet while that verdict comes.

With one process every function is the plain single-controller operation.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

ENV_ADDRESS, ENV_NUM, ENV_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
ENV_INIT_TIMEOUT, ENV_HEARTBEAT = "TP_JAX_INIT_TIMEOUT", "TP_JAX_HEARTBEAT_TIMEOUT"
ENV_COLLECTIVE_TIMEOUT, ENV_SUPERVISE = "TP_JAX_COLLECTIVE_TIMEOUT", "TP_JAX_SUPERVISE"
CLUSTER_SIZE_VARS = ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE")  # set inside srun / mpirun; JAX auto-detects
EXIT_INIT_TIMEOUT = 3
DEFAULT_HEARTBEAT_S, MIN_SHUTDOWN_S = 10, 30
_run = {"supervised": False, "heartbeat_s": DEFAULT_HEARTBEAT_S}


class DistributedError(ValueError):
    """Processes that cannot start together or disagree about what to run."""


# --- initialization ---------------------------------------------------------------------------

def resolve(coordinator_address: str | None = None, num_processes: int | None = None,
            process_id: int | None = None, environ=os.environ) -> dict | None:
    """The jax.distributed arguments from flags, then env; {} = auto-detect; None = one process."""
    address = coordinator_address or environ.get(ENV_ADDRESS) or None
    num = num_processes if num_processes is not None else _env_int(environ, ENV_NUM)
    pid = process_id if process_id is not None else _env_int(environ, ENV_ID)
    if address is None and num is None and pid is None:
        if any(_env_int(environ, v) not in (None, 1) for v in CLUSTER_SIZE_VARS):
            return {}
        return None
    if num == 1 and pid in (None, 0):
        return None
    missing = [f for f, v in (("--coordinator-address / JAX_COORDINATOR_ADDRESS", address),
                              ("--num-processes / JAX_NUM_PROCESSES", num),
                              ("--process-id / JAX_PROCESS_ID", pid)) if v is None]
    if missing:
        raise DistributedError(f"a multi-process run needs all three of coordinator address, number of processes "
                               f"and process id; missing: {', '.join(missing)}")
    if num < 1 or not 0 <= pid < num:
        raise DistributedError(f"process id {pid} is not in [0, {num}): ids run 0..num_processes-1, one per process")
    return dict(coordinator_address=address, num_processes=num, process_id=pid)


def _env_int(environ, name: str) -> int | None:
    raw = environ.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"environment variable {name}={raw!r} is not an integer") from None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, simulate_devices: int = 0,
               init_timeout_s: float | None = None, heartbeat_timeout_s: int | None = None,
               supervise: bool | None = None) -> bool:
    """Join the other processes (before any jax computation); False when running alone.

    `simulate_devices=N`: N CPU devices in this process (tests, one-machine runs). Waits are
    bounded: `init_timeout_s` (env TP_JAX_INIT_TIMEOUT, default 300) for every process to
    connect, `heartbeat_timeout_s` (env TP_JAX_HEARTBEAT_TIMEOUT, default 10) for a dead peer
    to be noticed, and on CPU a collective timeout (env TP_JAX_COLLECTIVE_TIMEOUT, default 120).
    `supervise` (env TP_JAX_SUPERVISE, default on; Linux): the program continues in a forked
    child while this process watches it, so a dead peer ends it with one line and exit code 3
    instead of JAX's C++ abort, and native stdout (Gloo's lines) goes to stderr.
    """
    if simulate_devices:
        from tp_jax.multihost.devices import simulate_cpu_devices
        simulate_cpu_devices(simulate_devices)
        _add_xla_flag("--xla_cpu_collective_call_terminate_timeout_seconds",
                      os.environ.get(ENV_COLLECTIVE_TIMEOUT, "120"))
    args = resolve(coordinator_address, num_processes, process_id)
    if args is None or jax.distributed.is_initialized():
        return args is not None
    init_s = float(init_timeout_s or os.environ.get(ENV_INIT_TIMEOUT) or 300)
    beat_s = int(heartbeat_timeout_s or os.environ.get(ENV_HEARTBEAT) or DEFAULT_HEARTBEAT_S)
    _run["heartbeat_s"] = beat_s
    if supervise is None:
        supervise = os.environ.get(ENV_SUPERVISE, "1") != "0"
    if supervise:
        from tp_jax.multihost.supervisor import supervise as watch_from_parent
        _run["supervised"] = watch_from_parent(args.get("process_id"), args.get("num_processes"),
                                               args.get("coordinator_address"), beat_s)
    if args and args["process_id"] != 0:
        init_s = max(10.0, init_s - _wait_for_coordinator(args["coordinator_address"], init_s))
    with _watchdog(args, init_s):
        jax.distributed.initialize(**args, initialization_timeout=int(init_s) + 30, heartbeat_timeout_seconds=beat_s,
                                   shutdown_timeout_seconds=max(beat_s, MIN_SHUTDOWN_S))
    agree("the process count", {"num_processes": args.get("num_processes", jax.process_count())})
    return True


def raise_unless_peer_died(error: BaseException) -> NoReturn:
    """Re-raise `error`, unless it is the echo of a dead peer in a supervised multi-process run.

    A collective fails at once when a peer dies (Gloo: "Connection closed by peer"), before
    JAX's coordination service has named the dead process. Wait quietly for that verdict (the
    supervisor then prints one line and exits 3); raise if none comes in the heartbeat timeout.
    """
    if _run["supervised"] and jax.process_count() > 1:
        time.sleep(_run["heartbeat_s"] + 15)
    raise error


def _add_xla_flag(name: str, value: str) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if name not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {name}={value}".strip()


def _wait_for_coordinator(address: str, timeout_s: float) -> float:
    """Seconds spent until process 0's coordinator accepts TCP connections at `address`."""
    host, _, port = address.rpartition(":")
    start = time.monotonic()
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
            return time.monotonic() - start
        except (OSError, ValueError) as e:
            if time.monotonic() - start > timeout_s:
                raise DistributedError(
                    f"no coordinator answered at {address} within {timeout_s:.0f}s ({e}); start process 0 "
                    f"with the same --coordinator-address, check the host and port, and that the port is open "
                    f"between the hosts") from None
            time.sleep(0.5)


@contextlib.contextmanager
def _watchdog(args: dict, timeout_s: float):
    """JAX aborts the process (no Python exception) when connecting times out: say why first."""
    def fire():
        print(f"tp_jax.multihost.distributed: process {args.get('process_id', '?')} of {args.get('num_processes', '?')} "
              f"could not start with the others at {args.get('coordinator_address', '(auto-detected)')} within "
              f"{timeout_s:.0f}s: not every process connected. Check that --num-processes is the same on every "
              f"host, that process ids 0..N-1 are each started once, and that all hosts use process 0's "
              f"address (raise TP_JAX_INIT_TIMEOUT if hosts start slowly).", file=sys.stderr, flush=True)
        os._exit(EXIT_INIT_TIMEOUT)
    timer = threading.Timer(timeout_s, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def process_index() -> int:
    return jax.process_index()


def is_driver() -> bool:
    """Process 0 returns outputs and prints; the others run the same steps silently."""
    return jax.process_index() == 0


# --- process 0's request, every process's agreement ---------------------------------------------

def broadcast_bytes(payload: bytes | None) -> bytes:
    """Process 0's bytes on every process (two broadcasts: the length, then the bytes)."""
    from jax.experimental import multihost_utils as mh
    n = int(mh.broadcast_one_to_all(np.int32(len(payload) if payload is not None else 0)))
    buf = np.frombuffer(payload, np.uint8) if payload is not None else np.zeros(n, np.uint8)
    return mh.broadcast_one_to_all(buf).tobytes()


def share_from_driver(make: Callable[[], Any]) -> Any:
    """`make()` (JSON-able) evaluated on process 0 and sent to all; others' inputs are ignored.

    If `make` raises on process 0, every process raises the same error (nobody is left
    waiting in a collective).
    """
    if jax.process_count() == 1:
        return make()
    payload = None
    if is_driver():
        try:
            payload = json.dumps({"value": make()}).encode()
        except Exception as e:                            # sent to everyone, then raised
            payload = json.dumps({"error": type(e).__name__, "message": str(e)}).encode()
    msg = json.loads(broadcast_bytes(payload))
    if "error" in msg:
        kind = {"TypeError": TypeError, "KeyError": KeyError}.get(msg["error"], ValueError)
        raise kind(f"{msg['message']} (raised on the driver, process 0)")
    return msg["value"]


def agree(what: str, values: dict) -> dict:
    """Check that every process passed the same `values`; raise naming the first difference."""
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils as mh
    mine = np.frombuffer(json.dumps(values, sort_keys=True, default=str).encode(), np.uint8)
    sizes = np.asarray(mh.process_allgather(np.int32(mine.size)))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:mine.size] = mine
    rows = np.asarray(mh.process_allgather(padded))
    views = [json.loads(rows[p, :sizes[p]].tobytes()) for p in range(len(sizes))]
    for p, view in enumerate(views[1:], start=1):
        diff = {k: (views[0].get(k), view.get(k)) for k in views[0].keys() | view.keys()
                if views[0].get(k) != view.get(k)}
        if diff:
            k, (a, b) = sorted(diff.items())[0]
            raise DistributedError(f"processes disagree on {what}: {k}={a!r} on process 0 but {b!r} on process "
                                   f"{p}; start every process with the same arguments")
    return values


def jsonable(x):
    if x is None or isinstance(x, (str, bool, float)):
        return x
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if hasattr(x, "__index__"):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if hasattr(x, "__iter__"):
        return [jsonable(v) for v in x]
    raise TypeError(f"generate: cannot send a {type(x).__name__} to the other processes; prompts must be "
                    f"strings or lists of token ids")


# --- host <-> device across processes -------------------------------------------------------------

def to_global(x, sharding: NamedSharding) -> jax.Array:
    """`x` (numpy, or a jax array) placed with `sharding`, which may span processes.

    Every process passes the same value; each builds only its own devices' blocks. A jax
    array already on the sharding's devices is resharded on device.
    """
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and x.sharding.device_set == sharding.device_set:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = to_global(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index], dtype=host.dtype)


def to_host(tree):
    """A pytree of jax arrays as numpy arrays, the full global values, on every process.

    When the arrays' devices span every process they are all-gathered; when some processes
    hold none of them (a mesh smaller than the cluster) their owners gather them and process
    0 broadcasts them.
    """
    leaves, treedef = jax.tree.flatten(tree)
    if jax.process_count() == 1 or not leaves:
        return jax.device_get(tree)
    owners = set().union(*({d.process_index for d in x.sharding.device_set} for x in leaves))
    if jax.process_index() in owners:
        values = _replicate(leaves)
    else:
        values = [np.zeros(x.shape, x.dtype) for x in leaves]
    if len(owners) < jax.process_count():
        if 0 not in owners:
            raise DistributedError("to_host: the arrays live on no device of process 0 (the driver); build the "
                                   "mesh on devices that include process 0's (jax.devices() order does)")
        from jax.experimental import multihost_utils as mh
        values = mh.broadcast_one_to_all(values, is_source=is_driver())
    return treedef.unflatten([np.asarray(v) for v in values])


def _replicate(leaves: list) -> list[np.ndarray]:
    """Each array fully on every device it spans (one jitted program), read from a local device."""
    remote = [i for i, x in enumerate(leaves) if not x.is_fully_addressable]
    out = [np.asarray(x) if x.is_fully_addressable else None for x in leaves]
    if remote:
        shardings = tuple(NamedSharding(leaves[i].sharding.mesh, P()) for i in remote)
        gathered = _replicator(shardings)(*(leaves[i] for i in remote))
        for i, g in zip(remote, gathered):
            out[i] = np.asarray(g.addressable_data(0))
    return out


@functools.lru_cache(maxsize=64)
def _replicator(shardings: tuple) -> Callable:
    """One jitted identity per output layout: a fresh lambda per call would recompile every step."""
    return jax.jit(lambda *xs: xs, out_shardings=shardings)
