"""Draft-model proposals for speculative decoding (vLLM's `{"model": PATH, "num_speculative_tokens": k}`).

Placement: the draft model is loaded on the target's mesh, sharded the same way (its layers on
pp, its heads and MLP on tp, its KV heads replicated where tp exceeds them, batches on dp). Its
paged KV pool has its own layout (layers, KV heads, head size) but the target's block count and
block size, and the target's block tables address it: block b of a request holds the same
positions in both pools. So the block manager, the scheduler and the prefix cache serve both.

Keeping the pools in step: the draft runs every step the target runs, on the same batch (the same
tokens, positions and slots; `follow`). Whatever the target's pool holds (prompt chunks, accepted
drafts, the newest token), the draft's pool holds too; a prefix-cache hit finds the draft's keys
in the same block (they were written together); a preempted request recomputes both; rejected
drafts' slots lie past the computed tokens in both and are overwritten as the request grows.

Proposals (`propose`): after the scheduler has reserved slots for a decode row's k drafts, the
draft decodes k tokens from the request's newest one, greedily (argmax, as vLLM's proposers do),
writing its keys at positions n .. n+k-1, one batched step per draft position. The target then
verifies them as any proposal (tp_jax/serving/speculative.py): q is one-hot, so verification is
exact rejection sampling, and greedy output is token for token plain decoding's.

One process only: the proposals are host-driven steps the plan broadcast of many hosts does not carry.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx
from jax.sharding import Mesh

from tp_jax.serving.batch import StepBatch, build_batch, sampled_rows
from tp_jax.serving.kv_pool import PoolShape
from tp_jax.serving.penalties import Penalties
from tp_jax.serving.request import Request
from tp_jax.serving.runner import ModelRunner
from tp_jax.serving.scheduler import ScheduledRow, SchedulerOutput


@dataclasses.dataclass(eq=False)
class _DraftRow:
    """A proposal step's decode row: `token` of `request` at position `start`, its argmax the draft for `row`."""
    request: Request
    start: int
    token: int
    row: ScheduledRow
    num_tokens: int = 1
    draft: tuple = ()
    decodes: bool = True
    samples: bool = True

    def token_ids(self) -> list[int]:
        return [self.token]


class DraftModel:
    def __init__(self, model: nnx.Module, mesh: Mesh, target_pool: PoolShape, microbatches: int,
                 penalties: Penalties, attention_backend: str, split_k: int):
        if jax.process_count() > 1:
            raise ValueError("speculative_config: a draft model runs in one process; on many hosts use "
                             "{'method': 'ngram', ...} or no speculative_config")
        quant = target_pool.layout.quant      # the target's format, never its checkpoint's scales
        quant = None if quant is None else dataclasses.replace(quant, k_scales=None, v_scales=None)
        self.pool = dataclasses.replace(target_pool, layout=dataclasses.replace(
            model.kv_layout(), dtype=target_pool.layout.dtype, quant=quant))
        self.runner = ModelRunner(model, mesh, self.pool, microbatches, penalties, attention_backend)
        self.microbatches, self.split_k = microbatches, split_k

    def follow(self, batch: StepBatch) -> None:
        """Run the draft on the target's step batch: its keys and values for the same tokens and slots."""
        self.runner.forward(batch)

    def propose(self, out: SchedulerOutput, tables: list[dict[str, list[int]]], block_size: int) -> None:
        """Fill each scheduled row's `draft` (placeholders, slots reserved) with the draft's greedy tokens."""
        rows = [(r, row) for r, replica in enumerate(out.rows) for row in replica if row.draft]
        for j in range(max((len(row.draft) for _, row in rows), default=0)):
            step = SchedulerOutput([[] for _ in out.rows], [])
            for r, row in rows:
                if j < len(row.draft):
                    token = row.request.token_ids[row.start] if j == 0 else row.draft[j - 1]
                    step.rows[r].append(_DraftRow(row.request, row.start + j, token, row))
            batch = build_batch(step, tables, block_size, self.microbatches, split_k=self.split_k)
            tokens = self.runner.greedy_tokens(batch)
            for g, sample_rows in enumerate(batch.rows):
                for i, d in sampled_rows(sample_rows):
                    d.row.draft[j] = int(tokens[g, i])

    def warmup(self, shapes) -> None:
        for shape in shapes:
            self.runner.forward(StepBatch.empty(shape))


def check_draft(target_config, draft_config, max_model_len: int, where: str) -> None:
    """ValueError naming the mismatch when the draft cannot propose for the target."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"{where}: the draft model's vocabulary ({draft_config.vocab_size} tokens) differs from "
                         f"the target's ({target_config.vocab_size}); a draft must share the target's tokenizer")
    if draft_config.max_position_embeddings < max_model_len:
        raise ValueError(f"{where}: the draft model reaches {draft_config.max_position_embeddings} positions, "
                         f"fewer than max_model_len={max_model_len}; lower max_model_len or pick another draft")
