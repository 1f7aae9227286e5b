"""The device side of a step (vLLM's ModelRunner): the jitted forward over the paged pool, then sampling.

* `forward`: one `shard_map`ped program per `StepShape` (ids, positions and the paged
  batch sharded on dp, the pool donated and written in place); logits only for each row's
  sampling token, gathered over tp: [G, D + P, V].
* `sample`: per row, vLLM's sampler with the row's own PRNG key and output step, so a
  row's draw never depends on the rest of the batch. Penalties read per-request state
  (prompt-token mask and output-token counts, [slots + 1, V], the last row a scratch row
  for padding) that lives on the devices while the request runs.
Both are jitted once per shape and flag set; `compiled_shapes` lists the forward's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tp_jax.models.cache import KVCache, PagedBatch
from tp_jax.multihost.distributed import to_global
from tp_jax.parallel.mesh import DP
from tp_jax.serving import sampling
from tp_jax.serving.batch import StepBatch, StepShape
from tp_jax.serving.kv_pool import POOL_SPEC, PoolShape, new_pool
from tp_jax.serving.sampling import SamplingTensors


class ModelRunner:
    def __init__(self, model: nnx.Module, mesh: Mesh, pool: PoolShape, microbatches: int, vocab_size: int,
                 num_slots: int):
        self.mesh, self.pool, self.vocab_size, self.num_slots = mesh, pool, vocab_size, num_slots
        graphdef, self.state = nnx.split(model)
        specs = nnx.get_partition_spec(self.state)
        self.k, self.v = new_pool(pool, mesh)
        self.penalty_state = None                # (prompt_mask bool[S+1, V], counts i32[S+1, V]) once needed
        self.compiled_shapes: set[StepShape] = set()

        def forward(state, ids, positions, k, v, batch, logits_index):
            m = nnx.merge(graphdef, state)
            h, cache = m.hidden_states(ids, positions, KVCache(k, v, batch), microbatches=microbatches)
            last = jnp.take_along_axis(h, logits_index[..., None], axis=1)          # [M, R, D]
            return m.logits(last), cache.k, cache.v

        rows = P(DP)
        fn = jax.shard_map(forward, mesh=mesh, in_specs=(specs, rows, rows, POOL_SPEC, POOL_SPEC,
                                                          PagedBatch(rows, rows, rows, rows), rows),
                           out_specs=(rows, POOL_SPEC, POOL_SPEC), check_vma=False)
        self._forward = jax.jit(fn, donate_argnums=(3, 4))

    def put(self, x, spec=P(DP)):
        return to_global(x, NamedSharding(self.mesh, spec))

    def forward(self, batch: StepBatch) -> jax.Array:
        """Run the model on one step's tokens, writing their k/v; logits [G, D + P, V] stay on device."""
        a = {k: self.put(v) for k, v in batch.arrays().items()}
        paged = PagedBatch(a["slots"], a["decode_tables"], a["prefill_tables"], a["prefill_index"])
        logits, self.k, self.v = self._forward(self.state, a["ids"], a["positions"], self.k, self.v, paged,
                                               a["logits_index"])
        self.compiled_shapes.add(batch.shape)
        return logits

    # --- sampling ---------------------------------------------------------------------------------
    def init_penalty_slot(self, slot: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Load a request's prompt-token mask and output counts into penalty row `slot`."""
        if self.penalty_state is None:
            shape = (self.num_slots + 1, self.vocab_size)
            self.penalty_state = (self.put(np.zeros(shape, bool), P()), self.put(np.zeros(shape, np.int32), P()))
        mask = np.zeros(self.vocab_size, bool)
        mask[np.asarray(prompt_ids, np.int64)] = True
        counts = np.bincount(np.asarray(output_ids, np.int64), minlength=self.vocab_size).astype(np.int32)
        self.penalty_state = _set_row(*self.penalty_state, self.put(np.int32(slot), P()), self.put(mask, P()),
                                      self.put(counts, P()))

    def sample(self, logits: jax.Array, floats: np.ndarray, top_k: np.ndarray, words: np.ndarray,
               steps: np.ndarray, slots: np.ndarray, *, num_logprobs: int, penalties: bool, all_greedy: bool):
        """Rows' tokens and logprobs, as numpy: (tokens[G, R], logprob[G, R], top_ids[G, R, N], top_lp[G, R, N]).

        floats[G, R, 6], top_k / steps / slots [G, R], words u32[G, R, 3] (sampling.py's row packing).
        """
        put = self.put
        if penalties:
            mask, counts = self.penalty_state
            out, counts = _sample_penalized(logits, put(floats), put(top_k), put(words), put(steps), put(slots),
                                            mask, counts, num_logprobs=num_logprobs)
            self.penalty_state = (mask, counts)
        elif all_greedy:
            out = _greedy(logits, num_logprobs=num_logprobs)
        else:
            out = _sample(logits, put(floats), put(top_k), put(words), put(steps), num_logprobs=num_logprobs)
        return out


def _flat(x):
    return x.reshape(-1, *x.shape[2:])


@jax.jit
def _set_row(mask, counts, slot, mask_row, counts_row):
    return mask.at[slot].set(mask_row), counts.at[slot].set(counts_row)


def _unflat(g: int, tokens, lp):
    r = tokens.shape[0] // g
    return (tokens.reshape(g, r), lp.logprob.reshape(g, r), lp.top_ids.reshape(g, r, -1),
            lp.top_logprobs.reshape(g, r, -1))


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def _greedy(logits, *, num_logprobs):
    tokens, lp = sampling.greedy(_flat(logits), num_logprobs=num_logprobs)
    return _unflat(logits.shape[0], tokens, lp)


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def _sample(logits, floats, top_k, words, steps, *, num_logprobs):
    t = SamplingTensors.from_rows(_flat(floats), top_k.reshape(-1), _flat(words))
    tokens, lp = sampling.sample(_flat(logits), t, steps.reshape(-1), num_logprobs=num_logprobs)
    return _unflat(logits.shape[0], tokens, lp)


@functools.partial(jax.jit, static_argnames=("num_logprobs",), donate_argnames=("counts",))
def _sample_penalized(logits, floats, top_k, words, steps, slots, mask, counts, *, num_logprobs):
    t = SamplingTensors.from_rows(_flat(floats), top_k.reshape(-1), _flat(words))
    rows = slots.reshape(-1)
    tokens, lp = sampling.sample(_flat(logits), t, steps.reshape(-1), mask[rows], counts[rows],
                                 num_logprobs=num_logprobs)
    counts = counts.at[rows, tokens].add(1)            # padding rows add to the scratch row
    return _unflat(logits.shape[0], tokens, lp), counts
