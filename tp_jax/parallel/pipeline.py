"""Pipeline parallelism inside one SPMD program: layers split over the pp axis, GPipe schedule.

Layer assignment: the L layers are padded to L_pad = pp * ceil(L / pp) stacked slots, stage s
holding slots [s * L_pad/pp, (s+1) * L_pad/pp). Real layers are spread so stages differ by at
most one real layer; the remaining slots are *identity layers* (all-zero weights: a pre-norm
residual block with zero weights adds exactly zero). `stage_layer_map` gives the slot -> HF
layer index map (-1 = identity) that the loader follows.

Schedule (inside shard_map, on one stage's local layers): the local batch is cut into M
micro-batches; at step t = 0 .. M + pp - 2 stage s runs micro-batch t - s (when it exists)
through its layers and hands the activation to stage s + 1 with a collective-permute.
The last stage's outputs are then broadcast over pp (one all-reduce of the final hidden
states), so every stage can compute logits. Idle stage-steps: pp (pp - 1) of pp (M + pp - 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from tp_jax.parallel import collectives
from tp_jax.parallel.mesh import PP


def stage_layer_map(num_layers: int, pp: int) -> tuple[int, ...]:
    """Slot -> HF layer index (-1: identity), stage-major; real layers balanced across stages."""
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pipeline_parallel_size={pp!r} must be a positive integer")
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {num_layers} layers; every "
                         f"stage needs at least one layer: use pipeline_parallel_size <= {num_layers}")
    per_stage = math.ceil(num_layers / pp)
    base, extra = divmod(num_layers, pp)
    out, next_layer = [], 0
    for s in range(pp):
        real = base + (s < extra)
        out += list(range(next_layer, next_layer + real)) + [-1] * (per_stage - real)
        next_layer += real
    return tuple(out)


def bubble_fraction(pp: int, microbatches: int) -> float:
    """Idle stage-steps / total stage-steps of the GPipe schedule."""
    return (pp - 1) / (microbatches + pp - 1)


def choose_microbatches(local_batch: int, requested: int) -> int:
    """The largest count <= requested that divides the per-device batch."""
    if requested < 1:
        raise ValueError(f"num_microbatches={requested} must be >= 1")
    return max(m for m in range(1, min(requested, local_batch) + 1) if local_batch % m == 0)


def run_pipeline(stage_fn: Callable, h: jax.Array, rows, shared, microbatches: int):
    """h[B, ...] through every stage's layers; `rows` (leaves [B, ...]) go with their micro-batch.

    stage_fn(h_mb, rows_mb, shared, valid) -> (h_mb, shared) runs this stage's local layers.
    `shared` (e.g. a KV pool, or None) is threaded through every step; `valid` is False on the
    stage's idle steps of the schedule, where stage_fn must leave `shared` unchanged (it is
    the Python value True when there is no schedule: pp = 1 and one micro-batch).
    """
    pp = collectives.axis_size(PP)
    if pp == 1 and microbatches == 1:
        return stage_fn(h, rows, shared, True)
    stage = collectives.axis_index(PP)
    m_total, b = microbatches, h.shape[0]
    mb = b // m_total
    split = lambda x: x.reshape(m_total, mb, *x.shape[1:])
    h_in, rows_in = split(h), jax.tree.map(split, rows)
    state, out = jnp.zeros_like(h_in[0]), jnp.zeros_like(h_in)
    for t in range(m_total + pp - 1):
        m = jnp.clip(t - stage, 0, m_total - 1)
        valid = (t - stage >= 0) & (t - stage < m_total)
        x = jnp.where(stage == 0, h_in[min(t, m_total - 1)], state)
        y, shared = stage_fn(x, jax.tree.map(lambda r: r[m], rows_in), shared, valid)
        if t >= pp - 1:
            out = out.at[t - pp + 1].set(jnp.where(stage == pp - 1, y, out[t - pp + 1]))
        state = collectives.send_to_next(y, PP)
    out = collectives.all_reduce(jnp.where(stage == pp - 1, out, jnp.zeros_like(out)), PP)
    return out.reshape(b, *h.shape[1:]), shared
