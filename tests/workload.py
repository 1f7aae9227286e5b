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
