"""The paged KV cache as a model sees it, and the runner of a model's stacked layers.

The serving engine (tp_jax/serving) owns the pool and the block tables; a model receives
them as a `KVCache` and needs to know nothing else:

    KVCache   k, v: [L_local, kv_local, num_blocks, block_size, hd] (this rank's pool) + a PagedBatch
    PagedBatch, per micro-batch row b (leading axis B):
              slots[B, N]              flat slot (block * block_size + offset) of each token's k/v; -1: none
              decode_tables[B, D, Wd]  block table of each decode row (tokens 0 .. D-1, one each)
              chunk_tables[B, Rv, Cb]  the decode rows split-K: each chunk's blocks (Cb * block_size positions)
              chunk_row[B, Rv]         the decode row of each chunk (D: padding)
              chunk_start[B, Rv]       the chunk's first position
              prefill_tables[B, P, Wp] block table of each prefill row
              prefill_index[B, P, T]   the flat tokens of each prefill row, in order (N: padding)
    LayerCache  one layer's view inside the scan: the pool, the layer's pool slot, its KV cache group, the batch

KV cache groups (`KVGroups`, a model mixing sliding and full layers): the pool holds S layer slots per pp stage and
each stacked layer reads and writes slot `slot[layer]` with the block table of group `group[layer]`; the tables
and `slots` then carry a group axis K after B (slots[B, K, N], decode_tables[B, K, D, Wd], ...), and a layer picks
its group's (`PagedBatch.kv_group`) before attending. One kind of layer: no groups, no K axis.

`run_layers(stack, h, positions, cache, microbatches)` runs every local layer of a `Stack`
(each `layer(h, positions, layer_cache) -> (h, layer_cache)`) across the pipeline stages,
threading the pool through the scan so each layer writes its slots in place. `KVLayout`
is what a model tells the engine about the cache it needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from tp_jax.parallel import collectives
from tp_jax.parallel.layers.lora import LoRAStep
from tp_jax.parallel.layers.stack import Stack
from tp_jax.parallel.mesh import PP
from tp_jax.parallel.pipeline import run_pipeline


@dataclasses.dataclass(frozen=True)
class KVQuant:
    """A quantized KV cache's stored format (`kv_cache_dtype`): its pools are uint8 arrays holding the bits of `dtype`
    (XLA:CPU writes a float8 array by copying it whole; a uint8 one in place).

    * float8 (e4m3, e5m2): x / s saturated to the format's range, read back as q * s, s the layer's per-tensor scale
      (`k_scales` / `v_scales` per stacked layer, a checkpoint's; None: 1.0, as vLLM without checkpoint scales);
    * int8: each token's row of one head (its hd channels) carries its own scale s = max|x| / 127 in float16, the
      row's last `ROW_SCALE_BYTES` bytes; q = round(x / s), read back as q * s. A token's bytes depend on its own
      values alone (batch-invariant, nothing calibrated)."""
    dtype: np.dtype
    k_scales: tuple[float, ...] | None = None
    v_scales: tuple[float, ...] | None = None

    ROW_SCALE_BYTES = 2

    @property
    def scale_bytes(self) -> int:
        """Bytes each (token, head) row carries after its values."""
        return self.ROW_SCALE_BYTES if np.dtype(self.dtype) == np.int8 else 0


@dataclasses.dataclass(frozen=True)
class KVScales:
    """Per-tensor KV scales, one (k, v) pair per layer (a checkpoint's: tp_jax/loaders/kv_scales.py); a float8
    cache stores x / s and reads q * s."""
    k: tuple[float, ...]
    v: tuple[float, ...]

    def per_slot(self, layer_map: tuple[int, ...]) -> KVScales:
        """The scales of each stacked slot (`layer_map`: slot -> layer, -1 an identity slot, whose 1.0 is never
        read)."""
        return KVScales(*(tuple(x[i] if i >= 0 else 1.0 for i in layer_map) for x in (self.k, self.v)))


@dataclasses.dataclass(frozen=True)
class KVGroups:
    """KV cache groups (vLLM's hybrid KV cache manager on our stacked pool): the layers of each attention kind
    (full; sliding window w) are split into groups of at most `slots` layers per pp stage; every group has its
    own block table per sequence and the pool holds `slots` layer slots per stage, so a block id belongs to
    one group at a time and block b of group g holds its layers' keys in pool slots 0 .. slots - 1.

    slot[l], group[l]: stacked layer l's pool slot (within its stage) and group; windows[g]: group g's window
    (None: full attention: every block kept)."""
    slots: int
    slot: tuple[int, ...]
    group: tuple[int, ...]
    windows: tuple[int | None, ...]

    @property
    def count(self) -> int:
        return len(self.windows)

    @classmethod
    def of(cls, layer_windows: tuple[int | None, ...], pp: int = 1) -> KVGroups | None:
        """The groups of stacked layers whose windows are `layer_windows` (None: full), stage by stage (each of the
        pp stages holds len / pp consecutive layers). S = the fewest layers of a kind on a stage (vLLM's uniform
        page size: the smallest kind's count); a kind with n layers on a stage fills ceil(n / S) groups there,
        the last one padded. None when every layer is of one kind (today's layout)."""
        kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))       # full first
        if len(kinds) < 2:
            return None
        per = len(layer_windows) // pp
        stages = [layer_windows[s * per:(s + 1) * per] for s in range(pp)]
        counts = [[st.count(k) for k in kinds] for st in stages]
        s_count = min(c for row in counts for c in row if c)
        per_kind = [max(-(-row[i] // s_count) for row in counts) for i in range(len(kinds))]
        first = [sum(per_kind[:i]) for i in range(len(kinds))]
        slot, group = [], []
        for st in stages:
            seen = [0] * len(kinds)
            for w in st:
                i = kinds.index(w)
                group.append(first[i] + seen[i] // s_count)
                slot.append(seen[i] % s_count)
                seen[i] += 1
        windows = tuple(k for k, n in zip(kinds, per_kind) for _ in range(n))
        return cls(s_count, tuple(slot), tuple(group), windows)


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """The pool a model needs: [num_layers, kv_heads, blocks, block_size, head_dim] for k, and v_head_dim for v.

    num_layers counts the stacked slots (padded for pp); kv_heads is global (tp * kv_local,
    from the head plan), so the pool shards on tp exactly like the model's KV heads.
    v_head_dim: None = head_dim; 0 = no value pool (MLA caches one latent per token as its k: kv_heads = tp,
    one copy per tp rank).
    window: every layer attends only the latest `window` keys (a query at p sees keys p - window + 1 .. p): the
    engine frees a sequence's blocks that no query still to come can see. None: some layer sees every key.
    quant: how a quantized cache stores them (`KVQuant`; dtype is then its element dtype); None: in `dtype`.
    layer_windows: each stacked slot's window (None: full attention), given when the layers differ.
    groups: the KV cache groups the pool is laid out in (`KVGroups`, set by the engine's pool plan from
    layer_windows); None: one table per sequence, a pool slot per stacked layer.
    """
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: np.dtype
    v_head_dim: int | None = None
    window: int | None = None
    quant: KVQuant | None = None
    layer_windows: tuple[int | None, ...] | None = None
    groups: KVGroups | None = None

    def pool_layers(self, pp: int = 1) -> int:
        """The pool's layer axis (global): a slot per stacked layer, or the groups' slots on each stage."""
        return self.num_layers if self.groups is None else pp * self.groups.slots

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def row_dims(self) -> tuple[int, int]:
        """The last axis of the k and v pools: a row's values, then its scale's bytes (int8); v: 0 for no pool."""
        extra = 0 if self.quant is None else self.quant.scale_bytes
        return self.head_dim + extra, self.value_dim + extra if self.value_dim else 0

    def bytes_per_token(self, pp: int = 1, tp: int = 1) -> int:
        """K + V bytes one token takes on one device (its pp stage's layers, its tp share of the heads)."""
        return (self.pool_layers(pp) // pp) * (self.kv_heads // tp) * sum(self.row_dims) * \
            np.dtype(self.dtype).itemsize


def _pytree(data: tuple[str, ...], meta: tuple[str, ...] = ()):
    def wrap(cls):
        cls = dataclasses.dataclass(frozen=True)(cls)
        cls.replace = lambda self, **kw: dataclasses.replace(self, **kw)
        return jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=list(meta))
    return wrap


_PAGED = ("slots", "decode_tables", "chunk_tables", "chunk_row", "chunk_start", "prefill_tables", "prefill_index")


@_pytree(_PAGED)
class PagedBatch:
    slots: jax.Array
    decode_tables: jax.Array
    chunk_tables: jax.Array
    chunk_row: jax.Array
    chunk_start: jax.Array
    prefill_tables: jax.Array
    prefill_index: jax.Array

    FIELDS = _PAGED

    def row(self, b: int) -> PagedBatch:
        """Micro-batch row b's arrays (no leading B axis): what a paged backend receives."""
        return PagedBatch(*(getattr(self, k)[b] for k in self.FIELDS))

    def kv_group(self, group) -> PagedBatch:
        """KV cache group `group`'s slots and tables (a traced int; arrays with a group axis after B, or after
        nothing in a `row`): the batch of one table per sequence that a backend reads."""
        k_axis = self.chunk_row.ndim - 1                       # 0 in a row, 1 with the micro-batch axis
        pick = lambda x: jax.lax.dynamic_index_in_dim(x, group, k_axis, keepdims=False)     # noqa: E731
        return self.replace(slots=pick(self.slots), decode_tables=pick(self.decode_tables),
                            chunk_tables=pick(self.chunk_tables), prefill_tables=pick(self.prefill_tables))

    def masked(self, valid) -> PagedBatch:
        """No writes when `valid` is False (a pipeline stage's idle step)."""
        if valid is True:
            return self
        return self.replace(slots=jnp.where(valid, self.slots, -1))


@_pytree(("k", "v", "batch"), ("backend", "stored", "dcp", "groups"))
class KVCache:
    """The paged pool of a step. `stored`: None (k and v hold the activations' dtype), or the `KVQuant` whose bits
    the uint8 pools hold (`kv_cache_dtype`). `dcp`: decode context parallel ranks a latent cache's tokens are
    interleaved over (tp_jax/models/dcp.py; each rank's block holds block_size / dcp of a block's positions).
    `groups`: the pool's KV cache groups (`KVGroups`; None: none)."""
    k: jax.Array
    v: jax.Array
    batch: PagedBatch
    backend: str = "reference"
    stored: KVQuant | None = None
    dcp: int = 1
    groups: KVGroups | None = None


@_pytree(("k", "v", "layer", "batch", "scales", "group"), ("backend", "stored", "dcp"))
class LayerCache:
    """One layer's view; `layer`: its pool slot (its stage-local stacked index, or its `KVGroups` slot);
    `scales`: f32[2], the layer's (k, v) per-tensor scales of a float8 cache with checkpoint scales (else None);
    `group`: its KV cache group (a traced int: `batch` then has a group axis), else None; `dcp`: as `KVCache`'s."""
    k: jax.Array
    v: jax.Array
    layer: jax.Array
    batch: PagedBatch
    backend: str = "reference"
    stored: KVQuant | None = None
    scales: jax.Array | None = None
    group: jax.Array | None = None
    dcp: int = 1


def run_layers(stack: Stack, h: jax.Array, positions: jax.Array, cache: KVCache | None = None,
               microbatches: int = 1, slot_args: Callable | None = None,
               lora: LoRAStep | None = None) -> tuple[jax.Array, KVCache | None]:
    """h[B, T, D] through every layer of `stack` (pp stages, GPipe micro-batches); the pool written in place.

    `slot_args(slot) -> tuple` (None: the layers are alike): more arguments for the layer at global stacked slot
    `slot` (a traced int32: the stage's first slot + the local index), e.g. its index for per-layer tables.
    `lora`: the step's LoRA adapters (tp_jax/parallel/layers/lora.py): each micro-batch's token slots ride with
    its rows, and each layer runs as `lora.view(layer, index, slots)`."""
    rows = (positions, None if cache is None else cache.batch, None if lora is None else lora.slots)
    pools = None if cache is None else (cache.k, cache.v)
    backend = "reference" if cache is None else cache.backend
    stored = None if cache is None else cache.stored
    dcp = 1 if cache is None else cache.dcp
    tables = None if stored is None or stored.k_scales is None else np.stack([stored.k_scales, stored.v_scales], 1)
    groups = None if cache is None else cache.groups

    def stage(h, rows, pools, valid):
        pos, batch, slots = rows
        batch = None if batch is None else batch.masked(valid)
        pp = collectives.axis_size(PP)
        first = 0 if (slot_args is None and tables is None and groups is None) or pp == 1 else \
            collectives.axis_index(PP) * (stack.num_layers // pp)

        def layer_step(layer, index, h, pools):
            more = () if slot_args is None else slot_args(first + index)
            if lora is not None:
                layer = lora.view(layer, index, slots)
            if pools is None:
                return layer(h, pos, None, *more)[0], None
            scales = None if tables is None else jnp.asarray(tables, jnp.float32)[first + index]     # [2]
            slot, group = index, None
            if groups is not None:                                  # the layer's pool slot and block tables
                slot = jnp.asarray(np.asarray(groups.slot, np.int32))[first + index]
                group = jnp.asarray(np.asarray(groups.group, np.int32))[first + index]
            h, lc = layer(h, pos, LayerCache(pools[0], pools[1], slot, batch, backend, stored, scales, group, dcp),
                          *more)
            return h, (lc.k, lc.v)

        return stack(layer_step, h, pools)

    h, pools = run_pipeline(stage, h, rows, pools, microbatches)
    return h, None if cache is None else cache.replace(k=pools[0], v=pools[1])
