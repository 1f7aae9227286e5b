"""The device mesh: vLLM's ExternalDP x DP x PP x TP rank grid as a `jax.sharding.Mesh`.

Axis names live here and only here; every other module imports `DP`, `PP`, `TP`.
The tp axis is innermost, so a tp group is a run of consecutive devices of one
process (one NVLink domain on a GPU host), exactly like vLLM's contiguous TP groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

DP, PP, TP = "dp", "pp", "tp"
AXES = (DP, PP, TP)


def make_mesh(dp: int = 1, pp: int = 1, tp: int = 1, *, devices: Sequence | None = None) -> Mesh:
    """A mesh with axes ("dp", "pp", "tp") over `devices` (default: all devices).

    Devices are laid out in the order given (sorted by process, then id, when taken
    from `jax.devices()`), tp fastest. Axis types are pinned to Auto: the model runs
    inside `shard_map`, and arrays outside it may be placed by XLA.
    """
    sizes = {DP: dp, PP: pp, TP: tp}
    for name, size in sizes.items():
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
            raise ValueError(f"make_mesh: {name}={size!r} is not a positive integer; "
                             f"every axis size must be an int >= 1 (use 1 to leave an axis unused).")
    if devices is None:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    devices = list(devices)
    total = dp * pp * tp
    if total != len(devices):
        raise ValueError(
            f"make_mesh: dp*pp*tp = {dp}*{pp}*{tp} = {total} but {len(devices)} devices were given; "
            f"pass devices=jax.devices()[:{total}] to use a subset, or choose sizes whose product "
            f"is {len(devices)}.")
    grid = np.empty(total, dtype=object)
    grid[:] = devices
    grid = grid.reshape(dp, pp, tp)
    check_tp_groups(grid)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def check_tp_groups(grid: np.ndarray) -> None:
    """Refuse a [dp, pp, tp] device grid whose tp group spans two processes."""
    for idx in np.ndindex(*grid.shape[:-1]):
        procs = sorted({d.process_index for d in grid[idx]})
        if len(procs) > 1:
            raise ValueError(
                f"make_mesh: the tp group at (dp, pp) = {idx} spans processes {procs}; a tp group "
                f"all-reduces twice per layer and must stay inside one host. Choose tp <= the number "
                f"of devices per process ({_devices_per_process(grid)}) and put the rest on dp or pp.")


def _devices_per_process(grid: np.ndarray) -> int:
    counts: dict[int, int] = {}
    for d in grid.flat:
        counts[d.process_index] = counts.get(d.process_index, 0) + 1
    return min(counts.values())
