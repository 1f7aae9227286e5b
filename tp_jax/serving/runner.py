"""The device side of a step (vLLM's ModelRunner): the jitted forward over the paged pool, then sampling.

* `forward`: one `shard_map`ped program per `StepShape`: the step's arrays arrive packed in
  one int32 buffer (sharded on dp) and are unpacked inside; the pool is donated and written
  in place; logits only for each row's sampling token, gathered over tp: [G, D + P, V].
* `sample`: per row, vLLM's sampler with the row's own PRNG key and output step, so a
  row's draw never depends on the rest of the batch. Penalties read per-request rows of
  device state that tp_jax/serving/penalties.py owns (prompt-token mask, output-token
  counts). The result comes back
  as one int32 array (logprobs bit-cast), so a step costs one transfer each way (plus
  one for the sampling rows when any row samples randomly or is penalized).
* prompt logprobs (tp_jax/serving/prompt_logprobs.py): only in a step that scores prompt
  positions, the forward takes their index and returns their logprobs; other steps run
  the same program as without them.
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
from tp_jax.multihost.distributed import to_global, to_host
from tp_jax.parallel.invariant import consistent_jit
from tp_jax.parallel.layers.lora import LoRAStep
from tp_jax.parallel.mesh import DP
from tp_jax.serving import prompt_logprobs, sampling
from tp_jax.serving.batch import StepShape, unpack
from tp_jax.serving.kv_pool import POOL_SPEC, PoolShape, new_pool, stored_format
from tp_jax.serving.penalties import Penalties, add_sampled
from tp_jax.serving.plan import StepPlan
from tp_jax.serving.sampling import SamplingTensors
from tp_jax.serving.structured import apply_bitmask


class ModelRunner:
    def __init__(self, model: nnx.Module, mesh: Mesh, pool: PoolShape, microbatches: int, penalties: Penalties,
                 attention_backend: str = "reference", lora=None):
        """`lora`: the adapters' device slots (tp_jax/serving/lora.py LoRAWeights); each step then passes them and
        every token's slot to the model (`hidden_states(..., lora=LoRAStep(...))`)."""
        self.mesh, self.pool, self.penalties, self.lora = mesh, pool, penalties, lora
        graphdef, state = nnx.split(model)
        specs = jax.tree.leaves(nnx.get_partition_spec(state), is_leaf=lambda x: isinstance(x, P))
        self.weights, treedef = jax.tree.flatten(state)     # flat: an nnx State costs ms to flatten per call
        self.k, self.v = new_pool(pool, mesh)
        stored = stored_format(pool.layout)          # a quantized KV cache: its bits in uint8 pools
        self.compiled_shapes: set[StepShape] = set()

        def forward(weights, packed, k, v, adapters, *prompt, shape, prompt_k):
            a = unpack(packed, shape)
            m = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))
            paged = PagedBatch(*(a[k] for k in PagedBatch.FIELDS))
            cache = KVCache(k, v, paged, attention_backend, stored, pool.dcp, pool.layout.groups)
            step = {"lora": LoRAStep(*adapters, lora.parts())} if adapters else {}     # LoRA engines only
            h, cache = m.hidden_states(a["ids"], a["positions"], cache, microbatches=microbatches, **step)
            last = jnp.take_along_axis(h, a["logits_index"][..., None], axis=1)     # [M, R, D]
            scored = tuple(prompt_logprobs.compute(m, h, x, prompt_k) for x in prompt)   # () unless asked
            return m.logits(last), cache.k, cache.v, *scored

        adapter_specs = () if lora is None else (lora.specs(), P(DP))

        def sharded(weights, packed, k, v, *prompt, shape, prompt_k=0, adapters=()):
            """`adapters`: () without LoRA, else (the LoRA weights, each token's slot i32[G, N])."""
            extra = (P(DP),) * len(prompt)
            fn = jax.shard_map(functools.partial(forward, shape=shape, prompt_k=prompt_k), mesh=mesh,
                               in_specs=(specs, P(DP), POOL_SPEC, POOL_SPEC, adapter_specs if adapters else (),
                                         *extra),
                               out_specs=(P(DP), POOL_SPEC, POOL_SPEC, *extra), check_vma=False)
            return fn(weights, packed, k, v, adapters, *prompt)

        self._forward = consistent_jit(sharded, donate_argnums=(2, 3), static_argnames=("shape", "prompt_k"))

    def put(self, x, spec=P(DP)):
        return to_global(x, NamedSharding(self.mesh, spec))

    def forward(self, batch, prompt=None) -> tuple[jax.Array, jax.Array | None]:
        """Run the model on one step's tokens, writing their k/v; logits [G, D + P, V] stay on device.
        With a PromptPlan, also the scored prompt positions (prompt_logprobs.compute), else None."""
        extra = () if prompt is None else (self.put(prompt.packed()),)
        adapters = () if self.lora is None else (self.lora.args(), self.put(batch.lora_slots if batch.lora_slots
                                                 is not None else np.full(batch.ids.shape, -1, np.int32)))
        logits, self.k, self.v, *scored = self._forward(self.weights, self.put(batch.packed()), self.k, self.v,
                                                        *extra, adapters=adapters, shape=batch.shape,
                                                        prompt_k=0 if prompt is None else prompt.k)
        self.compiled_shapes.add(batch.shape)
        return logits, (scored[0] if scored else None)

    def greedy_tokens(self, batch) -> np.ndarray:
        """The forward of one step and each sample row's argmax, i32[G, R] (draft proposals)."""
        logits, _ = self.forward(batch)
        return np.asarray(to_host(_greedy(logits, num_logprobs=0)), np.int32)[..., 0]

    def execute(self, plan: StepPlan, late_bitmask=None):
        """Forward and sample one step; (tokens[G, R], logprob[G, R], rank[G, R], top_ids[G, R, N], top_lp[G, R, N],
        prompt)
        as numpy, `prompt` the scored prompt positions (i32[G, Q, 2 + 2k]) or None.

        Structured outputs: `plan.bitmask`, or else `late_bitmask()` (called after the forward is
        dispatched, so the host fills it while the device computes), masks the logits before sampling."""
        for row, prompt, outputs in plan.penalty_inits:
            self.penalties.load(row, prompt, outputs)
        logits, scored = self.forward(plan.batch, plan.prompt)
        bitmask = plan.bitmask if plan.bitmask is not None or late_bitmask is None else late_bitmask()
        if bitmask is not None:                          # -inf where the grammar says no
            logits = apply_bitmask(logits, self.put(bitmask))
        n, bias = plan.num_logprobs, None if plan.bias is None else self.put(plan.bias)     # logit_bias
        if plan.all_greedy:
            out = _greedy(logits, bias, num_logprobs=n)
        else:
            floats, ints = self.put(plan.floats), self.put(plan.sample_ints())
            if plan.penalties:
                mask, counts = self.penalties.state
                out, counts = _sample_penalized(logits, floats, ints, mask, counts, bias, num_logprobs=n)
                self.penalties.state = (mask, counts)
            else:
                out = _sample(logits, floats, ints, bias, num_logprobs=n)
        out = np.asarray(to_host(out), np.int32)
        floats = lambda x: np.ascontiguousarray(x).view(np.float32)
        scored = None if scored is None else np.asarray(to_host(scored), np.int32)
        n = max(n, 0)                                    # -1: no row asked for logprobs (no ranks, no top N)
        return out[..., 0], floats(out[..., 1]), out[..., 2], out[..., 3:3 + n], floats(out[..., 3 + n:]), scored


def _pack(g: int, tokens, lp) -> jax.Array:
    """One i32[G, R, 3 + 2N] result: token, its logprob (bit-cast), its rank, top ids, top logprobs (bit-cast).

    Integers, not floats: a cross-process broadcast may sum in float32, where bit-cast token
    ids would be denormals and flushed to zero."""
    bits = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    out = jnp.concatenate([tokens.astype(jnp.int32)[:, None], bits(lp.logprob)[:, None], lp.rank[:, None],
                           lp.top_ids.astype(jnp.int32), bits(lp.top_logprobs)], axis=1)
    return out.reshape(g, -1, out.shape[-1])


def _rows(x):
    """[G, R, V] -> [G * R, V] (None stays None)."""
    return None if x is None else x.reshape(-1, x.shape[-1])


def _tensors(floats, ints) -> tuple[SamplingTensors, jax.Array]:
    """SamplingTensors from the packed rows (sampling.py's ROW_FLOATS; StepPlan.sample_ints), and the steps."""
    f, i = floats.reshape(-1, floats.shape[-1]), ints.reshape(-1, ints.shape[-1])
    words = jax.lax.bitcast_convert_type(i[:, 3:6], jnp.uint32)
    return SamplingTensors.from_rows(f, i[:, 0], words), i[:, 1]


@consistent_jit(static_argnames=("num_logprobs",))
def _greedy(logits, bias=None, *, num_logprobs):
    tokens, lp = sampling.greedy(logits.reshape(-1, logits.shape[-1]), num_logprobs=num_logprobs, bias=_rows(bias))
    return _pack(logits.shape[0], tokens, lp)


@consistent_jit(static_argnames=("num_logprobs",))
def _sample(logits, floats, ints, bias=None, *, num_logprobs):
    t, steps = _tensors(floats, ints)
    tokens, lp = sampling.sample(logits.reshape(-1, logits.shape[-1]), t, steps, num_logprobs=num_logprobs,
                                 bias=_rows(bias))
    return _pack(logits.shape[0], tokens, lp)


@consistent_jit(static_argnames=("num_logprobs",), donate_argnames=("counts",))
def _sample_penalized(logits, floats, ints, mask, counts, bias=None, *, num_logprobs):
    t, steps = _tensors(floats, ints)
    rows = ints.reshape(-1, ints.shape[-1])[:, 2]
    tokens, lp = sampling.sample(logits.reshape(-1, logits.shape[-1]), t, steps, mask[rows], counts[rows],
                                 num_logprobs=num_logprobs, bias=_rows(bias))
    counts = add_sampled(counts, rows, tokens)          # padding rows add to the scratch row
    return _pack(logits.shape[0], tokens, lp), counts
