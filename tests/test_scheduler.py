"""Scheduler, block manager and batch builder against a simulated model (no devices).

The simulation writes each scheduled token id into a host copy of the pool at the slot the
batch gives it, and for every sampled row reads the row's whole context back through the
row's block table: it must be exactly the request's tokens (so block tables, prefix sharing,
preemption and the flat layout never mix sequences up). The "model" then appends a token
that is a hash of the full context, so outputs are known independently of scheduling.
"""

import collections
import hashlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tp_jax.serving.batch import DECODE_CHUNK, PREFILL_CHUNK, build_batch
from tp_jax.serving.request import Request, Status
from tp_jax.serving.sampling import SamplingParams
from tp_jax.serving.scheduler import Scheduler, SchedulerConfig

VOCAB = 50


def next_token(tokens: list[int]) -> int:
    return int.from_bytes(hashlib.sha256(np.asarray(tokens, np.int32).tobytes()).digest()[:4], "little") % VOCAB


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(next_token(toks))
    return toks[len(prompt):]


def make_request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, len(prompt), list(prompt), SamplingParams(max_tokens=max_tokens), max_tokens, (0, 0, 0))


class Sim:
    def __init__(self, cfg: SchedulerConfig, microbatches: int = 1):
        self.cfg, self.m = cfg, microbatches
        self.sched = Scheduler(cfg)
        self.pool = np.full((cfg.num_replicas, cfg.num_blocks * cfg.block_size), -1, np.int64)
        self.finished: dict[str, list[int]] = {}
        self.steps = 0
        self.scheduled_tokens = 0
        self.batches = []                     # (shape, prefill rows) of each step

    def step(self) -> None:
        out = self.sched.schedule()
        check_invariants(self.sched)
        if out.empty:
            return
        self.steps += 1
        self.scheduled_tokens += out.num_tokens
        for rows in out.rows:
            assert sum(r.num_tokens for r in rows) <= self.cfg.max_num_batched_tokens
            assert len(rows) <= self.cfg.max_num_seqs
        batch = build_batch(out, [b.tables for b in self.sched.blocks], self.cfg.block_size, self.m,
                            split_k=DECODE_CHUNK)
        bs, d = self.cfg.block_size, batch.shape.decode_rows
        for g in range(batch.shape.groups):
            r = g // self.m
            for slot, tok in zip(batch.slots[g], batch.ids[g]):
                if slot >= 0:
                    self.pool[r, slot] = tok
        check_prefill_chunks(batch)
        real = batch.chunk_row < d
        assert (np.sort(batch.chunk_row, axis=1) == batch.chunk_row).all() and (~real[:, 1:] | real[:, :-1]).all(), \
            "chunks in row order, padding (row D) last"
        self.batches.append((batch.shape, sum(r is not None for rows in batch.rows for r in rows[d:])))
        sampled = []
        for g, rows in enumerate(batch.rows):
            r = g // self.m
            for i, row in enumerate(rows):
                if row is None:
                    continue
                last = batch.positions[g, batch.logits_index[g, i]]
                assert last == row.start + row.num_tokens - 1
                table = batch.decode_tables[g, i] if i < d else batch.prefill_tables[g, i - d]
                ctx = [self.pool[r, table[p // bs] * bs + p % bs] for p in range(last + 1)]
                assert ctx == row.request.token_ids[:last + 1], "a row read another sequence's keys"
                if i < d and batch.shape.decode_chunks:       # and its split-K chunks read the same, in order
                    mine = np.flatnonzero(batch.chunk_row[g] == i)
                    span = batch.shape.chunk_blocks * bs
                    assert batch.chunk_start[g, mine].tolist() == list(range(0, last + 1, span))
                    ctx = [self.pool[r, batch.chunk_tables[g, v, (p - batch.chunk_start[g, v]) // bs] * bs + p % bs]
                           for v in mine for p in range(batch.chunk_start[g, v], min(batch.chunk_start[g, v] + span,
                                                                                       last + 1))]
                    assert ctx == row.request.token_ids[:last + 1], "a decode chunk read another sequence's keys"
                if row.samples:
                    sampled.append(row.request)
        self.sched.update(out)
        for req in sampled:
            req.token_ids.append(next_token(req.token_ids))
            if req.num_output_tokens >= req.max_tokens:
                self.sched.finish(req, "length")
                self.finished[req.request_id] = req.output_token_ids

    def run(self, arrivals: dict[int, list[Request]], max_steps: int = 10_000) -> None:
        t = 0
        while t in arrivals or self.sched.has_work() or any(k > t for k in arrivals):
            for req in arrivals.get(t, []):
                self.sched.add(req)
            self.step()
            t += 1
            assert t < max_steps, "the scheduler made no progress"


def check_prefill_chunks(batch) -> None:
    """The attention rows of each prefill row: its tokens in order, each once, in chunks of at most
    T queries back to back, each with the row's block table; the row samples at its last chunk."""
    d, n, t = batch.shape.decode_rows, batch.shape.tokens, batch.shape.prefill_width
    assert t <= PREFILL_CHUNK
    for g, rows in enumerate(batch.rows):
        index, tables, j = batch.prefill_index[g], batch.prefill_tables[g], 0
        for i in range(d, len(rows)):
            if rows[i] is None:
                continue
            last, chunks = int(batch.logits_index[g, i]), -(-rows[i].num_tokens // t)
            assert i - d == j + chunks - 1, "a row samples at its last chunk, right after the previous row's"
            mine = index[j:j + chunks]
            assert mine[mine < n].tolist() == list(range(last - rows[i].num_tokens + 1, last + 1))
            assert (tables[j:j + chunks] == tables[j]).all()
            j += chunks
        assert (index[j:] == n).all(), "attention rows past the last chunk are padding"


def check_invariants(sched: Scheduler) -> None:
    for r, bm in enumerate(sched.blocks):
        refs = collections.Counter(b for table in bm.tables.values() for b in table)
        assert all(bm.ref[b] == refs.get(b, 0) for b in range(bm.num_blocks))
        assert set(bm.free_queue) == {b for b in range(bm.num_blocks) if bm.ref[b] == 0}
        assert all(bm.hash_of[b] == h for h, b in bm.cached.items())
        assert all(bm.hash_of[b] is not None for b, c in refs.items() if c > 1), "shared block without a hash"
        running = {q.request_id for q in sched.running[r]}
        assert set(bm.tables) == running
        for q in sched.running[r]:
            assert q.status is Status.RUNNING and q.replica == r
            assert len(bm.tables[q.request_id]) * bm.block_size >= q.num_computed_tokens


def arrivals(pairs) -> dict[int, list[Request]]:
    out = collections.defaultdict(list)
    for t, r in pairs:
        out[t].append(r)
    return dict(out)


def config(**kw) -> SchedulerConfig:
    base = dict(max_num_seqs=8, max_num_batched_tokens=32, block_size=4, num_blocks=64, num_replicas=1,
                enable_prefix_caching=True)
    return SchedulerConfig(**{**base, **kw})


def workload(rng, n, max_prompt=40, max_out=12, shared=None):
    reqs = []
    for i in range(n):
        prompt = list(rng.integers(0, VOCAB, rng.integers(1, max_prompt)))
        if shared is not None and i % 2:
            prompt = shared + prompt[:4]
        reqs.append(make_request(f"r{i}", prompt, int(rng.integers(1, max_out))))
    return reqs


def test_outputs_equal_the_reference_and_blocks_come_back():
    rng = np.random.default_rng(0)
    reqs = workload(rng, 30)
    sim = Sim(config())
    sim.run(arrivals((i // 3, r) for i, r in enumerate(reqs)))
    for r in reqs:
        assert sim.finished[r.request_id] == reference(r.token_ids[:r.prompt_len], r.max_tokens)
    assert all(bm.num_free == bm.num_blocks for bm in sim.sched.blocks)


def test_long_prompts_are_chunked_to_the_token_budget():
    sim = Sim(config(max_num_batched_tokens=8, num_blocks=32))
    req = make_request("long", list(range(30)), 3)
    sim.run({0: [req]})
    assert sim.finished["long"] == reference(list(range(30)), 3)
    assert sim.steps == 4 + 2                      # 30 prompt tokens in chunks of 8, then 2 decodes


@pytest.mark.parametrize("microbatches", [1, 2])
def test_prompts_longer_than_an_attention_chunk_are_split_into_chunks(microbatches):
    rng = np.random.default_rng(3)
    reqs = workload(rng, 12, max_prompt=3 * PREFILL_CHUNK, max_out=6)
    sim = Sim(config(max_num_batched_tokens=4 * PREFILL_CHUNK, num_blocks=512), microbatches)
    sim.run(arrivals((i // 4, r) for i, r in enumerate(reqs)))
    for r in reqs:
        assert sim.finished[r.request_id] == reference(r.token_ids[:r.prompt_len], r.max_tokens)
    assert any(s.prefill_width == PREFILL_CHUNK and s.prefill_rows > rows for s, rows in sim.batches)


def test_a_pool_too_small_preempts_and_still_completes_everything():
    rng = np.random.default_rng(1)
    reqs = workload(rng, 20, max_prompt=30, max_out=20)
    sim = Sim(config(num_blocks=14, enable_prefix_caching=False))          # 56 tokens for 20 requests
    sim.run({0: reqs})
    assert sim.sched.num_preemptions > 0
    for r in reqs:
        assert sim.finished[r.request_id] == reference(r.token_ids[:r.prompt_len], r.max_tokens)
        assert r.num_output_tokens == r.max_tokens            # none lost, none duplicated
    assert sim.sched.blocks[0].num_free == 14


def test_newest_running_request_is_the_one_preempted():
    cfg = config(num_blocks=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    sched = Scheduler(cfg)
    a, b = make_request("a", [1] * 8, 9), make_request("b", [2] * 8, 9)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()                        # both prefill: 2 + 2 blocks
    assert [row.request for row in out.rows[0]] == [a, b]
    sched.update(out)
    for r in (a, b):
        r.token_ids.append(0)
    out = sched.schedule()                        # a needs a third block: b (the newest) goes
    assert out.preempted == [b] and [row.request for row in out.rows[0]] == [a]
    assert b.status is Status.PREEMPTED and b.num_computed_tokens == 0 and sched.waiting[0] is b
    assert b.output_token_ids == [0]              # it keeps its outputs and recomputes them later


def test_prefix_caching_shares_blocks_and_skips_their_work():
    rng = np.random.default_rng(2)
    shared = list(rng.integers(0, VOCAB, 33))
    first = make_request("first", shared + [1, 2], 4)
    later = [make_request(f"r{i}", shared + [i], 4) for i in range(5)]
    sim = Sim(config(max_num_batched_tokens=64))
    sim.run({0: [first], 3: later})
    assert all(r.num_cached_tokens == 32 for r in later)          # 8 full blocks of the 33 shared tokens
    assert first.num_cached_tokens == 0
    for r in [first] + later:
        assert sim.finished[r.request_id] == reference(r.token_ids[:r.prompt_len], 4)
    plain = Sim(config(max_num_batched_tokens=64, enable_prefix_caching=False))
    plain.run({0: [make_request("first", shared + [1, 2], 4)],
               3: [make_request(f"r{i}", shared + [i], 4) for i in range(5)]})
    assert plain.scheduled_tokens - sim.scheduled_tokens == 5 * 32
    bm = sim.sched.blocks[0]
    assert bm.prefix_hits == 5 * 32 and bm.prefix_queries == sum(r.prompt_len for r in [first] + later)


def test_a_whole_cached_prompt_still_computes_its_last_token():
    sim = Sim(config())
    a, b = make_request("a", list(range(8)), 2), make_request("b", list(range(8)), 2)
    sim.run({0: [a], 4: [b]})
    assert b.num_cached_tokens == 4              # 8 tokens = 2 full blocks, but the last token is recomputed
    assert sim.finished["b"] == sim.finished["a"]


def test_dp_replicas_balance_and_keep_their_own_blocks():
    rng = np.random.default_rng(3)
    reqs = workload(rng, 16)
    sim = Sim(config(num_replicas=2, num_blocks=40), microbatches=2)
    seen = set()
    orig = sim.sched.schedule

    def spy():
        out = orig()
        seen.update((r, row.request.request_id) for r, rows in enumerate(out.rows) for row in rows)
        return out
    sim.sched.schedule = spy
    sim.run({0: reqs})
    replicas = collections.Counter(r for r, _ in seen)
    assert replicas[0] > 0 and replicas[1] > 0
    for r in reqs:
        assert sim.finished[r.request_id] == reference(r.token_ids[:r.prompt_len], r.max_tokens)


def test_max_num_seqs_bounds_the_running_set():
    sim = Sim(config(max_num_seqs=3))
    reqs = [make_request(f"r{i}", [i + 1] * 3, 5) for i in range(7)]
    sim.run({0: reqs})
    assert len(sim.finished) == 7


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), blocks=st.integers(10, 40), budget=st.integers(4, 48),
       seqs=st.integers(1, 6), dp=st.sampled_from([1, 2]), m=st.sampled_from([1, 2]),
       caching=st.booleans())
def test_random_workloads(seed, blocks, budget, seqs, dp, m, caching):
    rng = np.random.default_rng(seed)
    shared = list(rng.integers(0, VOCAB, 9))
    reqs = workload(rng, 12, max_prompt=20, max_out=10, shared=shared)
    cfg = config(num_blocks=blocks, max_num_batched_tokens=max(budget, 4), max_num_seqs=seqs, num_replicas=dp,
                 enable_prefix_caching=caching)
    sim = Sim(cfg, microbatches=m)
    sim.run(arrivals((int(rng.integers(0, 6)), r) for r in reqs))
    for r in reqs:
        assert sim.finished.get(r.request_id) == reference(r.token_ids[:r.prompt_len], r.max_tokens)
    assert all(bm.num_free == bm.num_blocks for bm in sim.sched.blocks)


def test_finish_frees_waiting_and_running_requests():
    sched = Scheduler(config())
    a, b = make_request("a", [1, 2, 3], 4), make_request("b", [4, 5], 4)
    sched.add(a)
    out = sched.schedule()
    sched.update(out)
    sched.add(b)
    sched.finish(a, "abort")
    sched.finish(b, "abort")
    assert not sched.has_work() and sched.blocks[0].num_free == 64
    assert a.finish_reason == b.finish_reason == "abort"


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 7, 16, 17, 25, 33, 300, 513])
def test_buckets(n):
    from tp_jax.serving.batch import bucket, fine_bucket
    b, f = bucket(n), fine_bucket(n)
    if n == 0:
        assert b == f == 0
        return
    assert b >= n and b & (b - 1) == 0 and b < 2 * n
    assert n <= f <= b and 2 * f <= 3 * n + 1 and (f & (f - 1) == 0 or (f // 3) & (f // 3 - 1) == 0)
    assert fine_bucket(n, 16) >= 16
