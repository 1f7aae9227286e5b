"""The engine: jitted prefill and decode steps over a sharded KV cache, and the token loop.

vLLM's Worker steps, on one mesh: the model and the cache are sharded (tp, dp, pp), the
forward runs under `shard_map`, logits come back gathered over tp, and sampling runs on
the gathered logits with one key per sequence, so every device draws the same token.

* prefill: prompts right-padded to a bucketed length (powers of two), one pass that
  fills the cache and samples each sequence's first token from its last prompt position.
* decode:  one token per sequence per step, at its own position; the cache is donated.
* finished sequences drop out: when at most half of the batch is still running, the
  batch (cache included) is compacted to the next smaller bucket.

The engine knows no tokenizer: callers pass token ids and may stop a sequence early
through `should_stop` (the front door uses it for stop strings).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tp_jax.serving import sampling
from tp_jax.multihost.distributed import to_global, to_host
from tp_jax.serving.kv_cache import CACHE_SPEC, cache_shape, new_cache
from tp_jax.parallel.mesh import DP, PP, TP
from tp_jax.parallel.pipeline import choose_microbatches
from tp_jax.serving.sampling import SamplingParams, SamplingTensors


def next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


@dataclasses.dataclass
class Event:
    """One generated token of sequence `index` (and its finish reason, when it is the last)."""
    index: int
    token: int
    logprob: float
    top: dict[int, float]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Engine:
    def __init__(self, model: nnx.Module, mesh: Mesh, max_model_len: int, eos_token_ids: Sequence[int] = (),
                 max_num_seqs: int = 256, seed: int = 0, num_microbatches: int | None = None):
        self.mesh, self.max_model_len, self.seed = mesh, max_model_len, seed
        self.cfg = model.config
        self.eos = tuple(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.num_microbatches = mesh.shape[PP] if num_microbatches is None else num_microbatches
        choose_microbatches(1, self.num_microbatches)              # validates >= 1
        graphdef, self.state = nnx.split(model)
        self.dtype = model.model.embed_tokens.embedding.get_value().dtype
        specs = nnx.get_partition_spec(self.state)
        self.stats = {"decode_steps": 0, "compactions": 0, "kv_cache_bytes_per_device": 0}

        def prefill(state, ids, positions, lengths, cache, microbatches):
            m = nnx.merge(graphdef, state)
            h, cache = m.model(ids, positions, cache, False, microbatches)
            last = h[jnp.arange(h.shape[0]), lengths - 1]                       # [B, D]
            return m.logits(last[:, None])[:, 0], cache

        def decode(state, tokens, positions, cache, microbatches):
            m = nnx.merge(graphdef, state)
            logits, cache = m(tokens[:, None], positions[:, None], cache, True, microbatches)
            return logits[:, 0], cache

        b, c = P(DP), (CACHE_SPEC,) * 2
        self._prefill = lambda mb: jax.shard_map(functools.partial(prefill, microbatches=mb), mesh=mesh,
                                                 in_specs=(specs, b, b, b, c), out_specs=(b, c), check_vma=False)
        self._decode = lambda mb: jax.shard_map(functools.partial(decode, microbatches=mb), mesh=mesh,
                                                in_specs=(specs, b, b, c), out_specs=(b, c), check_vma=False)
        self.prefill_step = jax.jit(self._prefill_step, donate_argnames=("cache",),
                                    static_argnames=("num_logprobs", "penalties", "all_greedy"))
        self.decode_step = jax.jit(self._decode_step, donate_argnames=("cache", "counts"),
                                   static_argnames=("num_logprobs", "penalties", "all_greedy"))

    def batch_bucket(self, n: int) -> int:
        """The padded batch for n sequences: a power of two, a multiple of dp."""
        return _round_up(next_pow2(n), self.mesh.shape[DP])

    def microbatches(self, batch: int) -> int:
        return choose_microbatches(batch // self.mesh.shape[DP], self.num_microbatches)

    def prefill_logits(self, state, ids, positions, lengths, cache):
        """Last-prompt-token logits [B, V] and the filled cache (a shard_map'd forward; jit it)."""
        return self._prefill(self.microbatches(ids.shape[0]))(state, ids, positions, lengths, cache)

    def decode_logits(self, state, tokens, positions, cache):
        """One decode step's logits [B, V] and the updated cache."""
        return self._decode(self.microbatches(tokens.shape[0]))(state, tokens, positions, cache)

    # --- jitted steps: forward + sampling ---------------------------------------------------
    def _sample(self, logits, tensors, steps, prompt_mask, counts, active, num_logprobs, penalties, all_greedy):
        if all_greedy and not penalties:
            tokens, lp = sampling.greedy(logits, num_logprobs=num_logprobs)
        elif penalties:
            tokens, lp = sampling.sample(logits, tensors, steps, prompt_mask, counts, num_logprobs=num_logprobs)
            counts = sampling.update_output_counts(counts, tokens, active)
        else:
            tokens, lp = sampling.sample(logits, tensors, steps, num_logprobs=num_logprobs)
        return tokens, lp, counts

    def _prefill_step(self, state, ids, lengths, cache, tensors, prompt_mask, counts, active, *,
                      num_logprobs, penalties, all_greedy):
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        logits, cache = self.prefill_logits(state, ids, positions, lengths, cache)
        steps = jnp.zeros(ids.shape[:1], jnp.int32)
        tokens, lp, counts = self._sample(logits, tensors, steps, prompt_mask, counts, active, num_logprobs,
                                          penalties, all_greedy)
        return tokens, lp, cache, counts

    def _decode_step(self, state, tokens, positions, steps, cache, tensors, prompt_mask, counts, active, *,
                     num_logprobs, penalties, all_greedy):
        logits, cache = self.decode_logits(state, tokens, positions, cache)
        tokens, lp, counts = self._sample(logits, tensors, steps, prompt_mask, counts, active, num_logprobs,
                                          penalties, all_greedy)
        return tokens, lp, cache, counts, positions + 1, steps + 1    # the next step's inputs stay on device

    # --- the host loop ------------------------------------------------------------------------
    def check_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        if not prompts:
            raise ValueError("generate: no prompts given")
        if len(prompts) > self.max_num_seqs:
            raise ValueError(f"generate: {len(prompts)} prompts exceed max_num_seqs={self.max_num_seqs}, the "
                             f"largest batch the KV cache is sized for; pass fewer prompts per call or raise "
                             f"max_num_seqs")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"generate: prompt {i} is empty; give at least one token")
            if len(p) >= self.max_model_len:
                raise ValueError(f"generate: prompt {i} has {len(p)} tokens, but max_model_len="
                                 f"{self.max_model_len} leaves no room to generate; shorten it or raise "
                                 f"max_model_len")
            bad = [t for t in p if not 0 <= int(t) < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"generate: prompt {i} has token ids outside [0, {self.cfg.vocab_size}): {bad[:5]}")

    def run(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
            should_stop: Callable[[int, list[int]], str | None] | None = None) -> Iterator[list[Event]]:
        """Generate for every prompt; yields the events of each step (one per running sequence)."""
        self.check_prompts(prompts)
        run = _Run(self, [list(map(int, p)) for p in prompts], list(params), should_stop)
        yield from run.loop()


class _Run:
    """The state of one `Engine.run`: host-side sequences and device-side batch arrays."""

    def __init__(self, engine: Engine, prompts: list[list[int]], params: list[SamplingParams], should_stop):
        self.e, self.prompts, self.params, self.should_stop = engine, prompts, params, should_stop
        n = len(prompts)
        self.lengths = [len(p) for p in prompts]
        self.budget = [min(p.max_tokens or engine.max_model_len, engine.max_model_len - len(q))
                       for p, q in zip(params, prompts)]
        need = max(l + b for l, b in zip(self.lengths, self.budget))
        self.max_len = min(engine.max_model_len, next_pow2(need, 64))
        self.batch = engine.batch_bucket(n)
        self.rows = list(range(n)) + [-1] * (self.batch - n)              # batch row -> sequence (-1: pad)
        self.generated: list[list[int]] = [[] for _ in range(n)]
        self.done = [False] * n
        self.num_logprobs = max((p.logprobs or 0) for p in params)
        self.all_greedy = all(p.greedy for p in params)
        self._active = None
        self.penalties = any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty
                             for p in params)

    def put(self, x, spec=P(DP)):
        return to_global(x, NamedSharding(self.e.mesh, spec))           # works when the mesh spans processes

    def loop(self) -> Iterator[list[Event]]:
        e = self.e
        t_pad = min(next_pow2(max(self.lengths), 16), self.max_len)
        ids = np.zeros((self.batch, t_pad), np.int32)
        lengths = np.ones(self.batch, np.int32)
        for r, s in enumerate(self.rows):
            if s >= 0:
                ids[r, :self.lengths[s]] = self.prompts[s]
                lengths[r] = self.lengths[s]
        pad_params = self.params + [SamplingParams(temperature=0.0)] * (self.batch - len(self.params))
        seq_ids = [s if s >= 0 else len(self.params) + r for r, s in enumerate(self.rows)]
        tensors = SamplingTensors.from_params(pad_params, e.cfg.vocab_size, engine_seed=e.seed, seq_ids=seq_ids)
        self.tensors = jax.tree.map(self.put, tensors)
        v = e.cfg.vocab_size
        self.prompt_mask = self.put(sampling.prompt_mask_from_ids(jnp.asarray(ids), jnp.asarray(lengths), v)) \
            if self.penalties else self.put(np.zeros((self.batch, 1), bool))
        self.counts = self.put(np.zeros((self.batch, v if self.penalties else 1), np.int32))
        shape = cache_shape(e.cfg, e.mesh.shape[TP], self.batch, self.max_len, e.dtype, e.mesh.shape[PP])
        cache = new_cache(shape, e.mesh)
        e.stats["kv_cache_bytes_per_device"] = shape.bytes_per_device(e.mesh)
        tokens, lp, cache, self.counts = e.prefill_step(
            e.state, self.put(ids), self.put(lengths), cache, self.tensors, self.prompt_mask, self.counts,
            self.put(self.active_mask()), num_logprobs=self.num_logprobs, penalties=self.penalties,
            all_greedy=self.all_greedy)
        self.cache = cache
        # decode inputs live on device: the last token, its position and the output step, per row
        self.inputs = (tokens, self.put(lengths), self.put(np.ones(self.batch, np.int32)))
        yield self.collect(tokens, lp)
        while not all(self.done):
            self.maybe_compact()
            tokens, lp, self.cache, self.counts, pos, steps = e.decode_step(
                e.state, *self.inputs, self.cache, self.tensors, self.prompt_mask, self.counts,
                self.active_device(), num_logprobs=self.num_logprobs, penalties=self.penalties,
                all_greedy=self.all_greedy)
            self.inputs = (tokens, pos, steps)
            e.stats["decode_steps"] += 1
            yield self.collect(tokens, lp)

    def active_device(self) -> jax.Array:
        """The running-rows mask on device, sent again only when a sequence has finished."""
        mask = self.active_mask()
        if self._active is None or not np.array_equal(mask, self._active[0]):
            self._active = (mask, self.put(mask))
        return self._active[1]

    def active_mask(self) -> np.ndarray:
        return np.array([s >= 0 and not self.done[s] for s in self.rows])

    def collect(self, tokens, lp) -> list[Event]:
        tokens, chosen, top_ids, top_lp = to_host((tokens, lp.logprob, lp.top_ids, lp.top_logprobs))
        events = []
        for r, s in enumerate(self.rows):
            if s < 0 or self.done[s]:
                continue
            tok = int(tokens[r])
            self.generated[s].append(tok)
            n = self.params[s].logprobs or 0
            top = {int(i): float(x) for i, x in zip(top_ids[r, :n], top_lp[r, :n])}
            ev = Event(s, tok, float(chosen[r]), top)
            ev.finish_reason, ev.stop_reason = self.finish(s, tok)
            self.done[s] = ev.finish_reason is not None
            events.append(ev)
        return events

    def finish(self, s: int, tok: int) -> tuple[str | None, int | str | None]:
        p = self.params[s]
        if tok in p.stop_token_ids:
            return "stop", tok
        if tok in self.e.eos and not p.ignore_eos:
            return "stop", None
        if self.should_stop is not None:
            reason = self.should_stop(s, self.generated[s])
            if reason is not None:
                return "stop", reason
        if len(self.generated[s]) >= self.budget[s]:
            return "length", None
        return None, None

    def maybe_compact(self) -> None:
        """Shrink the batch to the next smaller bucket once at most half of it is running."""
        live = [r for r, s in enumerate(self.rows) if s >= 0 and not self.done[s]]
        new_batch = self.e.batch_bucket(len(live))
        if new_batch >= self.batch:
            return
        keep = live + [r for r in range(self.batch) if r not in live][:new_batch - len(live)]
        idx = self.put(np.array(keep, np.int32), P())
        self.cache = tuple(self.put(_take(c, idx, 1), CACHE_SPEC) for c in self.cache)
        self.tensors = jax.tree.map(lambda x: self.put(_take(x, idx, 0)), self.tensors)
        self.prompt_mask, self.counts = (self.put(_take(x, idx, 0)) for x in (self.prompt_mask, self.counts))
        self.inputs = tuple(self.put(_take(x, idx, 0)) for x in self.inputs)
        self.rows = [self.rows[r] if r in live else -1 for r in keep]
        self.batch = new_batch
        self.e.stats["compactions"] += 1


@functools.partial(jax.jit, static_argnums=2)
def _take(x: jax.Array, idx: jax.Array, axis: int) -> jax.Array:
    return jnp.take(x, idx, axis=axis)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m
