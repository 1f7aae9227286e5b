"""The paged KV pool on the mesh, and its size from a stated memory budget.

    k, v: [L_pad, Hkv_pad, dp * num_blocks, block_size, hd]   spec P("pp", "tp", "dp", None, None)

With KV cache groups (a model mixing sliding and full layers, `kv_cache_groups` on: tp_jax/models/cache.py
KVGroups) the layer axis is pp * S, S layer slots per stage, and a block belongs to one group at a time; a
sequence of max_model_len tokens then holds every block in a full group and its window's in a sliding one.
Layers on pp (padded like the model's stacked params), kv heads on tp exactly as the head
plan places them (`KVLayout` from the model), the block axis on dp (each replica owns
`num_blocks` blocks; block ids are local to a replica). Head-major, so a block of one head
is one contiguous [block_size, hd] tile and attention gathers a row's context straight into
the [kv head, position, hd] layout its dots want (tp_jax/models/attention.py). Memory is budgeted, never discovered:

* `num_gpu_blocks`: this many blocks per replica, or else
* `kv_cache_memory_bytes`: K + V bytes per device, or else
* the default budget: on an accelerator `gpu_memory_utilization` of each device's memory
  minus what is in use after the weights are placed; on CPU (where devices share the host's
  RAM) min(2 GiB, a quarter of the available RAM) per process (`TP_JAX_CPU_KV_CACHE_BYTES`
  sets another ceiling), split over its mesh devices, and never less than four sequences of
  `max_model_len` tokens (a busy host must not make the engine refuse to start).

The pool never holds more blocks than `max_num_seqs` sequences of `max_model_len` tokens can
use, and must hold at least one sequence of `max_model_len` tokens. With a speculative draft model
(tp_jax/serving/draft_model.py) the draft has a pool of the same block count: a block's bytes in
the budget are then both models' (`draft_layout`).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tp_jax.models.cache import KVGroups, KVLayout, KVQuant, KVScales
from tp_jax.parallel.mesh import DP, PP, TP

POOL_SPEC = P(PP, TP, DP, None, None)
CPU_DEFAULT_BYTES = 2 * 2**30
CPU_ENV = "TP_JAX_CPU_KV_CACHE_BYTES"
CPU_FLOOR_SEQS = 4


@dataclasses.dataclass(frozen=True)
class PoolShape:
    layout: KVLayout
    num_blocks: int              # per dp replica
    block_size: int
    mesh_shape: tuple[int, int, int]   # (dp, pp, tp)
    window: int | None = None    # every layer (the draft's too) sees the latest `window` keys: older blocks are freed
    window_blocks: int = 0       # then: the most blocks a sequence holds at once (`blocks_per_sequence`)
    group_blocks: tuple[int, ...] = ()   # KV cache groups: the most blocks a sequence holds in each
    dcp: int = 1                 # decode context parallel ranks: each device's block holds block_size / dcp tokens

    @property
    def device_block_size(self) -> int:
        """Tokens of a block one device holds: block_size, or its share under decode context parallelism
        (tp_jax/models/dcp.py: a block's positions interleaved over the dcp ranks)."""
        return self.block_size // self.dcp

    @property
    def shape(self) -> tuple[int, ...]:
        """The k pool's global shape."""
        dp, pp, _ = self.mesh_shape
        return (self.layout.pool_layers(pp), self.layout.kv_heads, dp * self.num_blocks, self.device_block_size,
                self.layout.row_dims[0])

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each KV cache group's window (None: full attention); one entry without groups (the pool's `window`)."""
        return (self.window,) if self.layout.groups is None else self.layout.groups.windows

    @property
    def v_shape(self) -> tuple[int, ...]:
        """The v pool's global shape (last axis 0 for MLA: its values are the keys' first channels)."""
        return self.shape[:-1] + (self.layout.row_dims[1],)

    @property
    def tokens(self) -> int:
        """Tokens one replica can hold."""
        return self.num_blocks * self.block_size

    @property
    def bytes_per_device(self) -> int:
        return self.num_blocks * block_bytes_per_device(self.layout, self.block_size, self.mesh_shape, self.dcp)

    @property
    def bytes_per_token(self) -> int:
        """K + V bytes one token takes on one device (its stage's layers, its share of the kv heads; under decode
        context parallelism a block's bytes per device over its block_size tokens: divided by dcp)."""
        _, pp, tp = self.mesh_shape
        return self.layout.bytes_per_token(pp, tp) // self.dcp

    def sequences(self, max_model_len: int) -> int:
        """How many sequences of `max_model_len` tokens the pool holds at once, over every dp replica (under a
        sliding window, each holds only `blocks_per_sequence`)."""
        return self.mesh_shape[0] * (self.num_blocks // self.sequence_blocks(max_model_len))

    def sequence_blocks(self, max_model_len: int) -> int:
        """The most blocks one sequence of `max_model_len` tokens holds at once (over its KV cache groups)."""
        if self.group_blocks:
            return sum(self.group_blocks)
        return math.ceil(max_model_len / self.block_size) if self.window is None else self.window_blocks

    def sequence_bytes(self, max_model_len: int) -> int:
        """K + V bytes per device one sequence of `max_model_len` tokens holds at once (this pool's max_model_len)."""
        return self.sequence_blocks(max_model_len) * block_bytes_per_device(self.layout, self.block_size,
                                                                            self.mesh_shape, self.dcp)

    def describe(self, max_model_len: int | None = None) -> str:
        fit = "" if max_model_len is None else \
            f"; {self.sequences(max_model_len)} sequences of max_model_len={max_model_len} fit"
        window = "" if self.window is None else (f"; sliding window {self.window}: a sequence holds the blocks of "
                                                 f"its latest {self.window} tokens and the step's")
        dcp = "" if self.dcp == 1 else (f"; decode context parallel over {self.dcp} tp ranks: each holds "
                                        f"{self.device_block_size} of a block's {self.block_size} tokens")
        groups = self.layout.groups
        if groups is not None:
            kinds = {}
            for w, n in zip(groups.windows, self.group_blocks):
                kinds.setdefault(w, [0, n])[0] += 1
            held = ", ".join(f"{count} {'full' if w is None else f'sliding-{w}'} group{'s' * (count > 1)}: {n} "
                             f"blocks{' each' * (count > 1)}" for w, (count, n) in kinds.items())
            window = (f"; {groups.count} KV cache groups of {groups.slots} layer slot{'s' * (groups.slots > 1)} "
                      f"(a block holds one group's slots); a sequence of max_model_len holds at most {held} "
                      f"({sum(self.group_blocks)} in all)")
        return (f"{self.num_blocks} blocks x {self.block_size} tokens = {self.tokens} tokens per replica, "
                f"{self.bytes_per_device / 2**20:.1f} MiB per device ({np.dtype(self.layout.dtype).name}, "
                f"{self.bytes_per_token} bytes per token per device{fit}){window}{dcp}")


def sliding_window(layout: KVLayout, draft_layout: KVLayout | None) -> int | None:
    """The window beyond which no layer (the draft model's included: it reads the same blocks) sees a key."""
    windows = [x.window for x in (layout, draft_layout) if x is not None]
    return None if None in windows else max(windows)


def blocks_per_sequence(max_model_len: int, block_size: int, window: int | None, max_num_batched_tokens: int) -> int:
    """The most blocks one sequence holds at once: all of max_model_len's, or under a sliding window the window's
    keys before a step plus the step's tokens (and a block each side cut by a boundary)."""
    full = math.ceil(max_model_len / block_size)
    return full if window is None else min(full, math.ceil((window - 1 + max_num_batched_tokens) / block_size) + 1)


def block_bytes_per_device(layout: KVLayout, block_size: int, mesh_shape: tuple[int, int, int], dcp: int = 1) -> int:
    """K + V bytes of one block on one device (its layers and kv heads; its block_size / dcp tokens)."""
    _, pp, tp = mesh_shape
    return block_size // dcp * layout.bytes_per_token(pp, tp)


def default_budget_bytes(mesh: Mesh, gpu_memory_utilization: float) -> int:
    """Bytes per device the pool may take when no size is given (see the module docstring)."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if local[0].platform == "cpu":
        ceiling = int(os.environ.get(CPU_ENV) or CPU_DEFAULT_BYTES)
        return min(ceiling, _available_ram() // 4) // len(local)
    stats = [d.memory_stats() or {} for d in local]
    limits = [s.get("bytes_limit", 0) * gpu_memory_utilization - s.get("bytes_in_use", 0) for s in stats]
    return max(int(min(limits)), 0)


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


KV_DTYPES = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2,   # vLLM's names
             "int8": jnp.int8}


def stored_layout(layout: KVLayout, kv_cache_dtype: str, scales: KVScales | None = None) -> KVLayout:
    """`layout` as the pool stores it: "auto" the model's dtype; an fp8 name float8 with the checkpoint's per-layer
    `scales` (None: 1.0, as vLLM's fp8 cache without them); "int8" int8 with a scale per token and head
    (tp_jax/models/cache.py KVQuant). The attention reads it back into the activations' dtype."""
    if kv_cache_dtype in ("auto", None):
        return layout
    dtype = np.dtype(KV_DTYPES[kv_cache_dtype])
    if scales is None or dtype == np.int8:
        return dataclasses.replace(layout, dtype=dtype, quant=KVQuant(dtype))
    if len(scales.k) != layout.num_layers:
        raise ValueError(f"KV cache scales for {len(scales.k)} stacked layers, the pool has {layout.num_layers}; "
                         f"give them per stacked slot (KVScales.per_slot)")
    return dataclasses.replace(layout, dtype=dtype, quant=KVQuant(dtype, scales.k, scales.v))


def plan_pool(layout: KVLayout, mesh: Mesh, setup, *, num_gpu_blocks: int | None = None,
              draft_layout: KVLayout | None = None, scales: KVScales | None = None) -> PoolShape:
    """The pool's size per replica for the resolved configuration `setup` (its block_size, max_model_len,
    max_num_seqs, kv_cache_memory_bytes, gpu_memory_utilization, kv_cache_dtype; `num_gpu_blocks` as given here,
    the driver's count on every process), or a ValueError naming the numbers and the fix. `scales`: the
    checkpoint's KV scales per stacked slot (a float8 cache reads them; the draft's pool never)."""
    layout = stored_layout(layout, setup.kv_cache_dtype, scales)
    draft_layout = None if draft_layout is None else stored_layout(draft_layout, setup.kv_cache_dtype)
    block_size, max_model_len, max_num_seqs = setup.block_size, setup.max_model_len, setup.max_num_seqs
    kv_cache_memory_bytes, gpu_memory_utilization = setup.kv_cache_memory_bytes, setup.gpu_memory_utilization
    mesh_shape = (mesh.shape[DP], mesh.shape[PP], mesh.shape[TP])
    dcp = check_dcp(layout, draft_layout, setup.decode_context_parallel_size, mesh_shape[2], block_size)
    layout = grouped_layout(layout, setup.kv_cache_groups, mesh.shape[PP], draft_layout)
    per_block = sum(block_bytes_per_device(x, block_size, mesh_shape, dcp) for x in (layout, draft_layout) if x)
    window = sliding_window(layout, draft_layout)
    per_seq = blocks_per_sequence(max_model_len, block_size, window, setup.max_num_batched_tokens)
    group_blocks = () if layout.groups is None else tuple(
        blocks_per_sequence(max_model_len, block_size, w, setup.max_num_batched_tokens) for w in layout.groups.windows)
    per_seq = sum(group_blocks) or per_seq
    if num_gpu_blocks is not None:
        num, source = int(num_gpu_blocks), f"num_gpu_blocks={num_gpu_blocks}"
    else:
        if kv_cache_memory_bytes is not None:
            budget, source = int(kv_cache_memory_bytes), f"kv_cache_memory_bytes={kv_cache_memory_bytes}"
        else:
            budget = default_budget_bytes(mesh, gpu_memory_utilization)
            if mesh.devices.flat[0].platform == "cpu":
                budget = max(budget, min(CPU_FLOOR_SEQS, max_num_seqs) * per_seq * per_block)
            source = f"the default budget of {budget / 2**20:.1f} MiB per device"
        num = min(budget // per_block, max_num_seqs * per_seq)
    if num < 1:
        raise ValueError(f"the KV pool would have no blocks ({source}; one block of {block_size} tokens takes "
                         f"{per_block} bytes per device); give num_gpu_blocks >= {per_seq} or "
                         f"kv_cache_memory_bytes >= {per_seq * per_block}")
    if num < per_seq:
        held = "" if window is None else (f" (under the sliding window of {window} tokens a sequence holds at most "
                                          f"{per_seq} blocks at once)")
        raise ValueError(f"the KV pool holds {num * block_size} tokens per replica ({num} blocks of {block_size}, "
                         f"from {source}), fewer than one sequence of max_model_len={max_model_len}{held}; raise "
                         f"num_gpu_blocks to >= {per_seq} (kv_cache_memory_bytes >= {per_seq * per_block}) or "
                         f"lower max_model_len to <= {num * block_size}")
    return PoolShape(layout, num, block_size, mesh_shape, window, per_seq if window is not None else 0, group_blocks,
                     dcp)


def grouped_layout(layout: KVLayout, kv_cache_groups: str, pp: int, draft_layout: KVLayout | None = None) -> KVLayout:
    """`layout` in KV cache groups (`KVGroups.of` its layers' windows, stage by stage) when its layers mix kinds and
    `kv_cache_groups` (the resolved setting) is "on"; else as it is (one table per sequence)."""
    if layout.layer_windows is None or kv_cache_groups != "on":
        return layout
    groups = KVGroups.of(layout.layer_windows, pp)
    if groups is not None and draft_layout is not None:
        raise ValueError("kv_cache_groups='on' with a speculative draft model: the draft writes through the target's "
                         "one block table per sequence; set kv_cache_groups='off' (or 'auto')")
    return dataclasses.replace(layout, groups=groups)


def check_dcp(layout: KVLayout, draft_layout: KVLayout | None, dcp: int, tp: int, block_size: int) -> int:
    """`decode_context_parallel_size`, or a ValueError naming the fix: only a latent (MLA) cache (one latent per tp
    rank, no value pool) is split, over ranks of the tp group, each holding whole shares of a block."""
    if dcp == 1:
        return 1
    if layout.value_dim != 0:
        raise ValueError(f"decode_context_parallel_size={dcp} splits a latent-attention (MLA: DeepSeek-V2/V3) cache; "
                         f"this model caches keys and values per head (its tp shards already split them): use "
                         f"decode_context_parallel_size=1")
    if draft_layout is not None:
        raise ValueError(f"decode_context_parallel_size={dcp} with a draft model is not supported: use "
                         f"decode_context_parallel_size=1, or an ngram speculative_config")
    if tp % dcp:
        raise ValueError(f"decode_context_parallel_size={dcp} must divide tensor_parallel_size={tp} (its ranks are "
                         f"tp ranks): choose one of {[d for d in range(1, tp + 1) if tp % d == 0]}")
    if block_size % dcp:
        raise ValueError(f"decode_context_parallel_size={dcp} must divide block_size={block_size} (each rank holds "
                         f"block_size / dcp tokens of a block): use block_size={block_size * dcp}")
    return dcp


def stored_format(layout: KVLayout) -> KVQuant | None:
    """The format whose bits a pool's uint8 arrays hold (None: the pool is in its layout's dtype). XLA:CPU
    writes into a float8 array by copying it whole (~150 ms a layer for SmolLM2's pool) and into a uint8 one in
    place."""
    return layout.quant


def new_pool(shape: PoolShape, mesh: Mesh) -> tuple[jax.Array, jax.Array]:
    """Zeroed (k, v), allocated directly on the devices in their shards (finite: masked reads stay exact); a
    quantized layout's bits in uint8 (`stored_format`; zero bits are 0.0, an int8 row's zero scale reads 0.0)."""
    sharding = NamedSharding(mesh, POOL_SPEC)
    dtype = jnp.uint8 if stored_format(shape.layout) else shape.layout.dtype
    k = jax.jit(lambda: jnp.zeros(shape.shape, dtype), out_shardings=sharding)
    v = jax.jit(lambda: jnp.zeros(shape.v_shape, dtype), out_shardings=sharding)
    return k(), v()
