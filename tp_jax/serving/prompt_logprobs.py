"""Prompt logprobs (vLLM's `SamplingParams(prompt_logprobs=k)`): the logprob of every prompt token.

Prompt token i (i >= 1) is scored by the logits at position i - 1, which exist only while
that position is computed in a prefill chunk. So a step whose rows include such positions
gathers their hidden states, [G, Q, D] (Q bucketed), and the forward returns, per position,
the log-softmax of its logits at the prompt's next token and the top k: one
i32[G, Q, 2 + 2k] (floats bit-cast, the rank an int). Only those Q positions get [Q, V] logits; a step
with no such row runs the very program it ran before (no extra input, output or work).

* `plan(batch, vocab_size)` — the positions to score this step (`PromptPlan`), or None.
* `compute(model, h, packed, k)` — the device side, inside the forward's shard_map.
* `collect(prompt_plan, result)` — the step's results appended to each request's list.

Results follow vLLM's layout: `[None, {token_1: Logprob, top...}, ..., {token_{T-1}: Logprob, ...}]`,
each dict the prompt token's own Logprob (with its rank in the distribution) plus the top k with ranks 1..k
(raw logprobs: before penalties and temperature, like the sampled tokens'). A request keeps the entries it has: after a
preemption its recomputed positions are not scored again. Cached prefix blocks have no
logits, so a request still collecting prompt logprobs does not reuse the prefix cache
(vLLM does the same); its own full blocks are still registered for later requests.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tp_jax.parallel.invariant import row_log_softmax
from tp_jax.serving.batch import MIN_TOKENS, StepBatch, bucket, fine_bucket
from tp_jax.serving.outputs import position_logprobs
from tp_jax.serving.request import Request
from tp_jax.serving.sampling import mask_padding


def pending(req: Request, start: int, num_tokens: int) -> range:
    """The positions of this row (`num_tokens` from `start`) whose logits score a prompt token not yet scored."""
    if req.params.prompt_logprobs is None:
        return range(0)
    done = len(req.prompt_logprobs) - 1                  # entries 1..done are in (entry 0 is None)
    return range(max(start, done), min(start + num_tokens, req.prompt_len - 1))


@dataclasses.dataclass
class PromptPlan:
    index: np.ndarray                                    # i32[G, Q]: token slot in the step's [N] layout
    target: np.ndarray                                   # i32[G, Q]: the prompt token it scores (0 for padding)
    k: int                                               # top-k per position (bucketed, static)
    owners: list[list[tuple[Request, int]]] = dataclasses.field(default_factory=list)   # per group: (req, count)

    def packed(self) -> np.ndarray:
        return np.concatenate([self.index, self.target], axis=1)


def _row_offset(batch: StepBatch, g: int, i: int) -> int:
    """Where sample row i of group g starts in the group's token layout (decode rows first): its
    tokens are back to back and end at the one it samples from."""
    return int(batch.logits_index[g, i]) - batch.rows[g][i].num_tokens + 1


def plan(batch: StepBatch, vocab_size: int) -> PromptPlan | None:
    """The prompt positions to score in this step's batch (None when no row asks)."""
    per_group, k = [], 0
    for g, rows in enumerate(batch.rows):
        picks = []
        for i, row in enumerate(rows):
            if row is None:
                continue
            span = pending(row.request, row.start, row.num_tokens)
            if len(span):
                off = _row_offset(batch, g, i) - row.start
                picks.append((row.request, [off + p for p in span], [row.request.token_ids[p + 1] for p in span]))
                k = max(k, row.request.params.prompt_logprobs)
        per_group.append(picks)
    q = max((sum(len(ix) for _, ix, _ in picks) for picks in per_group), default=0)
    if q == 0:
        return None
    q = fine_bucket(q, MIN_TOKENS)
    index, target = np.zeros((len(per_group), q), np.int32), np.zeros((len(per_group), q), np.int32)
    owners = []
    for g, picks in enumerate(per_group):
        ix = [x for _, xs, _ in picks for x in xs]
        index[g, :len(ix)] = ix
        target[g, :len(ix)] = [t for _, _, ts in picks for t in ts]
        owners.append([(req, len(xs)) for req, xs, _ in picks])
    return PromptPlan(index, target, min(bucket(k), vocab_size), owners)


def compute(model, h: jax.Array, packed: jax.Array, k: int) -> jax.Array:
    """h[G, N, D], packed i32[G, 2Q] (index, target) -> i32[G, Q, 2 + 2k]: the target's logprob, its rank (the
    tokens at least as likely: vLLM's count), the top-k ids and their logprobs (floats bit-cast)."""
    q = packed.shape[1] // 2
    index, target = packed[:, :q], packed[:, q:]
    hq = jnp.take_along_axis(h, index[..., None], axis=1)                       # [G, Q, D]
    lp = row_log_softmax(mask_padding(model.logits(hq)))                        # [G, Q, V] f32
    chosen = jnp.take_along_axis(lp, target[..., None], axis=-1)                # [G, Q, 1]
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)
    rank = jnp.sum(lp >= chosen, axis=-1, keepdims=True, dtype=jnp.int32)          # [G, Q, 1]
    parts = [bits(chosen), rank]
    if k:
        top_lp, top_ids = jax.lax.top_k(lp, k)
        parts += [top_ids.astype(jnp.int32), bits(top_lp)]
    return jnp.concatenate(parts, axis=-1)


def collect(p: PromptPlan, result: np.ndarray) -> None:
    """Append a step's scored positions (result i32[G, Q, 2 + 2k] from `compute`) to their requests."""
    floats = lambda x: np.ascontiguousarray(x).view(np.float32)
    k = p.k
    chosen, ranks = floats(result[..., 0]), result[..., 1]
    top_ids, top_lp = result[..., 2:2 + k], floats(result[..., 2 + k:])
    for g, owners in enumerate(p.owners):
        j = 0
        for req, count in owners:
            n = req.params.prompt_logprobs
            for q in range(j, j + count):
                req.prompt_logprobs.append(position_logprobs(p.target[g, q], chosen[g, q], ranks[g, q],
                                                             top_ids[g, q, :n], top_lp[g, q, :n]))
            j += count
