"""Simulated host devices: N CPU devices for testing sharded code on a laptop.

Must run before jax initialises its backend (the first `jax.devices()` or computation);
importing jax is fine. Sets NPROC >= 2 x N: on a 2-core machine XLA:CPU collectives
over simulated devices otherwise deadlock (docs/running.md).
"""

from __future__ import annotations

import os
import re


def simulate_cpu_devices(n: int) -> None:
    """Make jax see `n` CPU devices (and use the CPU platform)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"simulate_cpu_devices: n={n!r} must be a positive integer.")
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
        import jax
        have = jax.device_count()
        if jax.default_backend() == "cpu" and have == n:
            return
        raise RuntimeError(f"simulate_cpu_devices({n}) was called after jax started with {have} "
                           f"{jax.default_backend()} device(s); call it before any jax computation.")
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ["NPROC"] = str(max(int(os.environ.get("NPROC") or 0), 2 * n, 16))
    os.environ["JAX_PLATFORMS"] = "cpu"
