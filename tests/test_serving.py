"""Continuous batching on the real engine (tiny model): arrival order, preemption, prefix caching,
abort, no leaked blocks over 500 requests (some aborted, some preempted), n > 1, fresh randomness, the asyncio
wrapper, bad input.
Exactness at every (dp, pp, tp) factorization is in test_pipeline.py."""

import asyncio

import numpy as np
import pytest

from tests.tiny_models import make_checkpoint
from tests.workload import compact_workload, mixed_workload, run_workload
from tp_jax.serving.async_engine import AsyncLLMEngine
from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint("gqa", str(tmp_path_factory.mktemp("serving")))


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, tensor_parallel_size=2, progress=False)


@pytest.fixture(scope="module")
def alone(llm):
    return {rid: llm.generate([p], sp)[0].outputs[0].token_ids for rid, p, sp, _ in mixed_workload()}


@pytest.fixture(scope="module")
def compact_alone(llm):
    """compact_workload's requests, each alone on the tp = 2 engine (the reference attention backend)."""
    return {rid: llm.generate([p], sp)[0].outputs[0].token_ids for rid, p, sp, _ in compact_workload()}


def used_blocks(llm) -> int:
    return llm.engine.core.kv_usage()[0]


def test_arrival_order_and_batch_do_not_change_outputs(llm, alone):
    work = mixed_workload()
    assert run_workload(llm.engine, work) == alone
    reversed_arrivals = [(rid, p, sp, 9 - t) for rid, p, sp, t in work]
    assert run_workload(llm.engine, reversed_arrivals) == alone
    together = llm.generate([p for _, p, _, _ in work], [sp for _, _, sp, _ in work])
    assert [o.outputs[0].token_ids for o in together] == [alone[rid] for rid, *_ in work]


def test_a_pool_too_small_preempts_and_loses_nothing(path, compact_alone):
    small = LLM(path, tensor_parallel_size=2, num_gpu_blocks=4, block_size=16, max_model_len=64, progress=False)
    work = compact_workload()                        # needs 6 blocks at once from step 2; the pool has 4
    got = run_workload(small.engine, work)
    assert got == compact_alone
    assert all(len(got[rid]) == sp.max_tokens for rid, _, sp, _ in work)
    assert small.engine.core.stats["preemptions"] > 0
    assert used_blocks(small) == 0


def test_prefix_caching_reuses_a_shared_prompt(path):
    rng = np.random.default_rng(5)
    system = rng.integers(0, 1000, 70).tolist()                  # 4 full blocks of 16 shared
    prompts = [system + rng.integers(0, 1000, 5).tolist() for _ in range(4)]
    outs = {}
    for caching in (True, False):
        llm = LLM(path, enable_prefix_caching=caching, progress=False)
        first = llm.generate([prompts[0]], GREEDY)[0]
        rest = llm.generate(prompts[1:], GREEDY)
        outs[caching] = ([first] + rest, llm.engine.core.stats["scheduled_tokens"], llm.engine.core)
    (cached, work_cached, core), (plain, work_plain, _) = outs[True], outs[False]
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in plain]
    assert [o.num_cached_tokens for o in cached] == [0, 64, 64, 64]
    assert [o.num_cached_tokens for o in plain] == [0, 0, 0, 0]
    assert work_plain - work_cached == 3 * 64                    # the shared blocks were not recomputed
    assert core.prefix_cache_hit_rate() == pytest.approx(3 * 64 / (4 * 75))


def test_abort_frees_the_request_blocks(llm):
    engine = llm.engine
    engine.add_request("keep", [1, 2, 3, 4, 5], SamplingParams(max_tokens=20, temperature=0.0))
    engine.add_request("drop", list(range(10, 50)), SamplingParams(max_tokens=20, temperature=0.0))
    for _ in range(3):
        engine.step()
    before = used_blocks(llm)
    table = len(engine.core.scheduler.blocks[0].table(engine.processor.child_ids("drop")[0]))
    final = engine.abort("drop")
    assert final.finished and final.outputs[0].finish_reason == "abort" and len(final.outputs[0].token_ids) == 3
    assert used_blocks(llm) == before - table
    while engine.has_unfinished():
        outs = engine.step()
    assert outs[0].request_id == "keep" and outs[0].outputs[0].token_ids == \
        llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=20, temperature=0.0))[0].outputs[0].token_ids
    assert engine.abort("drop") is None and engine.abort("nobody") is None
    assert used_blocks(llm) == 0


def test_hundreds_of_requests_with_aborts_and_preemptions_leak_no_blocks(path):
    """500 requests, random lengths and arrivals, a fifth of the steps abort one, a pool small enough to preempt:
    afterwards every block, penalty slot and request record is free. 4 rows and 16 tokens a step keep the compiled
    shapes to about a dozen (1,000 requests with up to 64 rows a step compiled 26 and never preempted)."""
    llm = LLM(path, max_num_seqs=4, max_num_batched_tokens=16, num_gpu_blocks=8, block_size=4, max_model_len=16,
              progress=False)
    engine, rng = llm.engine, np.random.default_rng(9)
    done, aborted, added, total = set(), set(), 0, 500
    while added < total or engine.has_unfinished():
        for _ in range(min(int(rng.integers(0, 40)), total - added)):
            engine.add_request(f"q{added}", rng.integers(0, 1000, int(rng.integers(1, 12))).tolist(),
                               SamplingParams(max_tokens=int(rng.integers(1, 5)), temperature=0.0))
            added += 1
        for out in engine.step():
            if out.finished:
                done.add(out.request_id)
        if rng.random() < 0.2 and engine.processor.states:
            victim = sorted(engine.processor.states)[0]
            engine.abort(victim)
            aborted.add(victim)
    assert len(done | aborted) == total and not (done & aborted) and aborted
    core = engine.core
    assert core.stats["preemptions"] > 0
    assert used_blocks(llm) == 0 and not core.requests and core.scheduler.num_running == 0
    bm = core.scheduler.blocks[0]
    assert sorted(bm.free_queue) == list(range(bm.num_blocks)) and not bm.tables
    assert sorted(core.penalties.free) == list(range(core.penalties.num_slots)) and not core.penalties.rows


def test_n_samples_and_their_seeds(llm):
    out = llm.generate([[3, 4, 5]], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, c in enumerate(out.outputs):
        one = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=8, temperature=1.0, seed=7 + i))[0].outputs[0]
        assert c.token_ids == one.token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_unseeded_sampling_is_fresh_per_call_and_reproducible_per_engine_seed(path):
    p = SamplingParams(max_tokens=10, temperature=1.0)
    runs = []
    for _ in range(2):
        llm = LLM(path, seed=3, progress=False)
        runs.append([llm.generate([[5, 6, 7]], p)[0].outputs[0].token_ids for _ in range(3)])
    assert runs[0] == runs[1]                               # the same engine seed: the same draws
    assert len({tuple(t) for t in runs[0]}) == 3            # each call draws fresh randomness


def test_async_engine_streams_and_cancels(llm):
    aengine = AsyncLLMEngine(llm.engine)
    ref = llm.generate([[9, 8, 7]], SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0].token_ids

    async def main():
        async def full():
            seen = []
            async for out in aengine.generate([9, 8, 7], SamplingParams(max_tokens=12, temperature=0.0),
                                              request_id="full"):
                seen.append(len(out.outputs[0].token_ids))
            return out, seen

        async def cancelled():
            n = 0
            async for out in aengine.generate(list(range(30)), SamplingParams(max_tokens=50, temperature=0.0),
                                              request_id="gone"):
                n += 1
                if n == 3:
                    break                                    # the client went away
            return n

        (out, seen), n = await asyncio.gather(full(), cancelled())
        with pytest.raises(ValueError, match=r"token ids outside \[0, 1000\)"):
            async for _ in aengine.generate([5000], GREEDY, request_id="bad"):
                pass
        used = await asyncio.wrap_future(aengine.call(used_blocks_of))
        return out, seen, n, used

    try:
        out, seen, n, used = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert out.outputs[0].token_ids == ref and seen == list(range(1, 13))
    assert n == 3 and used == 0


def used_blocks_of(engine) -> int:
    return engine.core.kv_usage()[0]


def test_abort_ends_the_stream_without_waiting_for_a_slow_step(llm):
    """A stopping server aborts its streams; a step in progress (a compile under load) must not hold the last
    chunk back past the grace period: the stream ends at once with its last output, finish_reason "abort"."""
    import threading
    import time
    aengine, release = AsyncLLMEngine(llm.engine), threading.Event()
    step = llm.engine.step

    def slow_step():
        outs = step()
        if any(len(o.outputs[0].token_ids) >= 2 for o in outs):
            release.wait(30)                                     # the engine thread is stuck inside a step
        return outs

    async def main():
        seen, took = [], None
        async for out in aengine.generate([4, 5, 6], SamplingParams(max_tokens=40, temperature=0.0),
                                          request_id="stuck"):
            seen.append(out)
            if len(out.outputs[0].token_ids) == 2:
                t0 = time.monotonic()
                asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(aengine.abort("stuck")))
        took = time.monotonic() - t0
        release.set()
        used = await asyncio.wrap_future(aengine.call(used_blocks_of))
        return seen, took, used

    llm.engine.step = slow_step
    try:
        seen, took, used = asyncio.run(main())
    finally:
        release.set()
        llm.engine.step = step
        aengine.shutdown()
    last = seen[-1]
    assert took < 5 and last.finished and last.outputs[0].finish_reason == "abort"
    assert last.outputs[0].token_ids == seen[-2].outputs[0].token_ids and len(last.outputs[0].token_ids) == 2
    assert used == 0                                              # the engine freed it after the step


@pytest.mark.parametrize("kw,msg", [
    (dict(max_num_batched_tokens=8, block_size=16), r"max_num_batched_tokens=8 is smaller than one block"),
    (dict(num_gpu_blocks=0), r"num_gpu_blocks=0 must be >= 1"),
    (dict(kv_cache_memory_bytes=0), r"kv_cache_memory_bytes=0 must be >= 1"),
    (dict(num_gpu_blocks=4, max_model_len=128), r"holds 64 tokens per replica .* fewer than one sequence of "
                                                 r"max_model_len=128; raise num_gpu_blocks to >= 8"),
    (dict(kv_cache_memory_bytes=100), r"the KV pool would have no blocks"),
])
def test_bad_engine_settings_fail_before_loading(path, monkeypatch, kw, msg):
    import tp_jax.loaders.model as loader
    monkeypatch.setattr(loader, "load_from_source", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(ValueError, match=msg):
        LLM(path, progress=False, **kw)


def test_bad_requests_name_the_prompt(llm):
    with pytest.raises(ValueError, match=r"prompt 1: logprobs=21 exceeds the limit of 20"):
        llm.generate([[1, 2], [3, 4]], [GREEDY, SamplingParams(logprobs=21)])
    with pytest.raises(TypeError, match=r"prompt 0: token 0 is 1.5 \(float\)"):
        llm.generate([[1.5, 2.7]], GREEDY)
    with pytest.raises(TypeError, match=r"prompt 0 is bytes"):
        llm.generate(b"hello", GREEDY)
    with pytest.raises(TypeError, match=r"chat: messages must be a non-empty list"):
        llm.chat("hello")
    assert used_blocks(llm) == 0 and not llm.engine.core.requests


def test_two_dimensional_id_arrays_are_prompts(llm):
    ids = np.array([[5, 6, 7], [8, 9, 10]])
    outs = llm.generate(ids, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in
                                                      llm.generate([[5, 6, 7], [8, 9, 10]], GREEDY)]


def test_warmup_compiles_the_listed_shapes_and_changes_nothing(path):
    llm = LLM(path, max_num_seqs=8, max_num_batched_tokens=64, progress=False)
    core = llm.engine.core
    k_before = np.asarray(core.runner.k)
    shapes = core.warmup()
    assert shapes == sorted(core.warmup_shapes())
    assert [s.decode_rows for s in shapes if s.decode_rows] == [1, 2, 3, 4, 6, 8]
    assert [(s.tokens, s.prefill_width) for s in shapes if s.prefill_rows] == [(64, 64)]
    np.testing.assert_array_equal(np.asarray(core.runner.k), k_before)        # padding writes nothing
    out = llm.generate([[1, 2, 3]], GREEDY)[0]
    assert len(out.outputs[0].token_ids) == 6 and core.runner.compiled_shapes >= set(shapes)


def test_split_k_steps_lay_every_decode_row_out_in_chunks(path):
    """The split-K backend ("bf16") gets each decode row's own chunks on every step, short contexts too (a gate on
    the step's longest row would make a row's numbers depend on its neighbours); the warm-up compiles the
    one-chunk-a-row shapes of short contexts. The reference's steps never carry chunks."""
    llm = LLM(path, max_num_seqs=4, block_size=4, attention_backend="bf16", progress=False)
    core = llm.engine.core
    warm = set(core.warmup())
    assert all(s.decode_chunks == s.decode_rows and s.chunk_blocks == 8 for s in warm if s.decode_rows)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 2, 3]] * 4, greedy)                                # contexts up to 23 positions: one chunk
    decode_steps = lambda: {s for s in core.runner.compiled_shapes if s.decode_rows and not s.prefill_rows}
    assert decode_steps() and all(s.decode_chunks >= s.decode_rows for s in decode_steps())
    ref = LLM(path, max_num_seqs=4, block_size=4, progress=False).engine.core
    assert all(s.decode_chunks == s.chunk_blocks == 0 for s in ref.warmup_shapes())


def test_a_step_plan_survives_the_trip_to_other_processes(llm):
    from tp_jax.serving.batch import DECODE_CHUNK, build_batch
    from tp_jax.serving.plan import StepPlan
    engine = llm.engine
    core = engine.core
    engine.add_request("plan-a", [5, 17, 300], SamplingParams(max_tokens=3, repetition_penalty=1.3, logprobs=2))
    engine.add_request("plan-b", list(range(40)), SamplingParams(max_tokens=3, temperature=0.5, seed=4,
                                                                 prompt_logprobs=2))
    out = core.scheduler.schedule()
    plan = core._plan(build_batch(out, [b.tables for b in core.scheduler.blocks], 16, core.microbatches,
                                  split_k=DECODE_CHUNK))
    back = StepPlan.from_bytes(plan.to_bytes())
    assert back.batch.shape == plan.batch.shape
    for name in plan.batch.ARRAYS:
        np.testing.assert_array_equal(getattr(back.batch, name), getattr(plan.batch, name), err_msg=name)
    for name in plan.SAMPLE_ARRAYS:
        np.testing.assert_array_equal(getattr(back, name), getattr(plan, name), err_msg=name)
    assert (back.num_logprobs, back.penalties, back.all_greedy) == (2, True, False)
    assert back.penalty_inits == [tuple(x) for x in plan.penalty_inits] and len(plan.penalty_inits) == 1
    assert back.prompt.k == plan.prompt.k == 2
    np.testing.assert_array_equal(back.prompt.packed(), plan.prompt.packed())
    assert plan.prompt.target[0, :39].tolist() == list(range(1, 40))          # every prompt token but the first
    for rid in ("plan-a", "plan-b"):
        engine.abort(rid)


def test_the_bf16_attention_backend_is_batch_invariant(path):
    """Continuous batching on "bf16" (the decode rows split-K, several chunks a row at these contexts with
    block_size 4) == each request alone on "bf16" (the compact workload: joins, finishes, sampled rows); an
    unknown backend is refused naming the registered ones."""
    llm = LLM(path, tensor_parallel_size=2, attention_backend="bf16", block_size=4, progress=False)
    alone = {rid: llm.generate([p], sp)[0].outputs[0].token_ids for rid, p, sp, _ in compact_workload()}
    assert run_workload(llm.engine, compact_workload()) == alone
    with pytest.raises(ValueError, match=r"attention_backend='flash' is not an attention backend; choose one of "
                                         r"'auto', 'reference', 'bf16'"):
        LLM(path, attention_backend="flash", progress=False)


def test_the_cpu_default_pool_never_refuses_to_start_on_a_busy_host(path, monkeypatch):
    from tp_jax.serving import kv_pool
    monkeypatch.setattr(kv_pool, "_available_ram", lambda: 1024)               # almost nothing free
    llm = LLM(path, max_model_len=64, max_num_seqs=8, progress=False)
    pool = llm.engine.core.pool
    assert pool.num_blocks == 4 * 64 // 16 and pool.tokens == 4 * 64          # four max_model_len sequences
    monkeypatch.setenv("TP_JAX_CPU_KV_CACHE_BYTES", str(2**40))
    monkeypatch.setattr(kv_pool, "_available_ram", lambda: 2**40)
    roomy = LLM(path, max_model_len=64, max_num_seqs=8, progress=False).engine.core.pool
    assert roomy.num_blocks == 8 * 64 // 16                                    # capped by what 8 sequences use
