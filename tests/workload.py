"""A mixed serving workload for the engine tests: prompt and output lengths, sampling settings and
arrival steps all differ; requests join while others run."""

from __future__ import annotations

import numpy as np

from tp_jax.serving.sampling import SamplingParams


def mixed_workload(vocab: int = 1000, seed: int = 0) -> list[tuple[str, list[int], SamplingParams, int]]:
    """(request id, prompt ids, params, arrival step): greedy requests and seeded sampled ones."""
    rng = np.random.default_rng(seed)
    out = []
    for i, (plen, ntok, arrive) in enumerate([(5, 9, 0), (40, 6, 0), (13, 12, 1), (2, 7, 2), (27, 10, 4),
                                             (9, 5, 4), (61, 8, 6), (17, 11, 9)]):
        prompt = rng.integers(0, vocab, plen).tolist()
        if i % 3 == 2:
            params = SamplingParams(max_tokens=ntok, temperature=0.9, top_p=0.9, top_k=50, seed=100 + i)
        else:
            params = SamplingParams(max_tokens=ntok, temperature=0.0)
        out.append((f"w{i}", prompt, params, arrive))
    return out


def compact_workload(vocab: int = 1000, seed: int = 0) -> list[tuple[str, list[int], SamplingParams, int]]:
    """Continuous batching in few step shapes, for the tests that run it at every mesh: 3 requests arrive
    together (one prompt over 2 blocks, one decode over 2), 2 join at step 2 in the step where 2 of the first
    finish, greedy and seeded sampled rows share steps, the last 3 finish together. On one replica the forward
    compiles 4 shapes (mixed_workload: 11): the first prefill, decode 3 rows, decode 3 + 2 joining prefills,
    and decode 3 is also what `generate` of 3 short prompts compiles."""
    rng = np.random.default_rng(seed)
    out = []
    for i, (plen, ntok, arrive) in enumerate([(5, 3, 0), (27, 10, 0), (13, 3, 0), (2, 8, 2), (9, 8, 2)]):
        prompt = rng.integers(0, vocab, plen).tolist()
        if i in (2, 4):
            params = SamplingParams(max_tokens=ntok, temperature=0.9, top_p=0.9, top_k=50, seed=100 + i)
        else:
            params = SamplingParams(max_tokens=ntok, temperature=0.0)
        out.append((f"c{i}", prompt, params, arrive))
    return out


def run_workload(engine, workload) -> dict[str, list[int]]:
    """Add each request at its arrival step (an LLMEngine), step until all finish; tokens per id."""
    pending = sorted(workload, key=lambda w: w[3])
    results, step = {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][3] <= step:
            rid, prompt, params, _ = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        step += 1
    return results
