"""Prompt logprobs (`SamplingParams(prompt_logprobs=k)`) == transformers' log-softmax at every prompt
position: at tp 1, 2, 8, pp 2 and dp 2, with a prompt longer than one prefill chunk (and one
attended in several attention chunks), with and without a cached prefix, under preemption;
`max_tokens=0`; bad input."""

import numpy as np
import pytest

from tests.tiny_models import hf_greedy, hf_logits, make_checkpoint
from tp_jax.serving.batch import PREFILL_CHUNK
from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams

CHUNK = 32                                          # max_num_batched_tokens: the long prompt takes 3 chunks
K = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The gqa checkpoint, prompts (one of 75 tokens, > 2 chunks; two sharing its first 40), and
    transformers' log-softmax for each."""
    path = make_checkpoint("gqa", str(tmp_path_factory.mktemp("prompt_lp")))
    rng = np.random.default_rng(0)
    long = rng.integers(3, 1000, 75).tolist()
    prompts = [long, long[:40] + rng.integers(3, 1000, 9).tolist(), rng.integers(3, 1000, 5).tolist()]
    refs = []
    for p in prompts:
        x = hf_logits(path, np.array([p]))[0].astype(np.float64)
        refs.append(x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)))
    return path, prompts, refs


def check_against(ref: np.ndarray, prompt: list[int], got: list, k: int) -> float:
    """The worst |logprob - transformers'| over the prompt's tokens and their top-k entries."""
    assert len(got) == len(prompt) and got[0] is None
    worst = 0.0
    for i in range(1, len(prompt)):
        row, entry = ref[i - 1], got[i]
        top = np.argsort(-row)[:k]
        assert set(entry) == {prompt[i], *top.tolist()}, (i, entry, top)
        worst = max(worst, *(abs(lp.logprob - row[t]) for t, lp in entry.items()))
    return worst


@pytest.mark.parametrize("pp,tp", [(1, 1), (1, 2), (2, 1)], ids=lambda s: str(s))
def test_a_prompt_attended_in_chunks_equals_transformers(model, pp, tp):
    """With the default token budget the 75-token prompt is one prefill row of one step, whose
    attention runs as chunks of PREFILL_CHUNK queries (batch.py): its prompt logprobs, and the
    greedy tokens of every prompt, are transformers'."""
    path, prompts, refs = model
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, progress=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=K))
    worst = max(check_against(ref, p, o.prompt_logprobs, K) for p, ref, o in zip(prompts, refs, outs))
    assert worst <= 1e-4, worst
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 3) for p in prompts]
    widths = {s.prefill_width for s in llm.engine.core.runner.compiled_shapes}
    assert PREFILL_CHUNK in widths and 128 not in widths             # the 75 tokens ran as 64 + 11, not padded to 128


@pytest.mark.parametrize("dp,pp,tp", [(1, 1, 1), (1, 1, 2), (1, 1, 8), (1, 2, 1), (2, 1, 2)],
                         ids=lambda s: str(s))
def test_prompt_logprobs_equal_transformers(model, dp, pp, tp):
    path, prompts, refs = model
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
              max_num_batched_tokens=CHUNK, progress=False)
    scored = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=K)
    fresh = llm.generate(prompts, scored)                                   # nothing cached yet
    plain = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0))
    cached = llm.generate(prompts, scored)                                  # every prompt's prefix is cached now
    worst = max(check_against(ref, p, a.prompt_logprobs, K) for p, ref, a in zip(prompts, refs, fresh))
    print(f"prompt_logprobs dp{dp} pp{pp} tp{tp}: max |logprob - transformers'| = {worst:.2e}")
    assert worst <= 1e-4
    for a, b, c in zip(fresh, plain, cached):
        assert c.prompt_logprobs == a.prompt_logprobs                       # with a cached prefix: the same numbers
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids   # generation unchanged
        assert b.prompt_logprobs is None and c.num_cached_tokens == 0       # scoring recomputes the prefix
    assert plain[0].num_cached_tokens > 0                                   # ... which the plain run reused


def test_prompt_logprobs_survive_preemption(model):
    """A pool too small for the batch preempts requests mid-prefill; their prompt logprobs stay exact."""
    path, prompts, refs = model
    llm = LLM(path, max_num_batched_tokens=CHUNK, block_size=16, num_gpu_blocks=8, max_model_len=128,
              progress=False)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompts, params)
    assert llm.engine.core.stats["preemptions"] > 0
    for p, ref, o in zip(prompts, refs, outs):
        assert check_against(ref, p, o.prompt_logprobs, 1) <= 1e-4
        assert len(o.outputs[0].token_ids) == 6


def test_max_tokens_zero_and_limits(model):
    path, prompts, _ = model
    llm = LLM(path, max_model_len=49, progress=False)
    with pytest.raises(ValueError, match=r"max_tokens=0 generates nothing.*prompt_logprobs"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=r"prompt_logprobs=-1 must be >= 0"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match=r"prompt 0: prompt_logprobs=21 exceeds the limit of 20"):
        llm.generate(prompts[2], SamplingParams(prompt_logprobs=21))
    full = prompts[1]                                                        # 49 tokens = max_model_len
    with pytest.raises(ValueError, match="leaves no room to generate"):
        llm.generate(full, SamplingParams(max_tokens=1, prompt_logprobs=0))
    out = llm.generate(full, SamplingParams(max_tokens=0, prompt_logprobs=0, logprobs=2))[0]
    assert len(out.prompt_logprobs) == 49 and out.outputs[0].token_ids == [] and out.outputs[0].logprobs == []
    n2 = llm.generate(prompts[2], SamplingParams(n=2, max_tokens=2, prompt_logprobs=1, seed=3))[0]
    assert len(n2.outputs) == 2 and len(n2.prompt_logprobs) == len(prompts[2])


def test_max_tokens_zero_scores_the_prompt_only(model):
    path, prompts, refs = model
    llm = LLM(path, max_num_batched_tokens=CHUNK, progress=False)
    only = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=0))
    for p, ref, o in zip(prompts, refs, only):
        assert o.outputs[0].token_ids == [] and o.outputs[0].finish_reason == "length"
        assert check_against(ref, p, o.prompt_logprobs, 0) <= 1e-4
    again = llm.generate(prompts[0], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert again.num_cached_tokens > 0                   # the scored requests' blocks serve later requests
    plain = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1)
    mixed = llm.generate(prompts[1:], [SamplingParams(max_tokens=0, prompt_logprobs=2), plain])[1].outputs[0]
    alone = llm.generate(prompts[2], plain)[0].outputs[0]       # a request beside a scored one keeps its tokens
    assert mixed.token_ids == alone.token_ids
    np.testing.assert_allclose([d[t].logprob for t, d in zip(mixed.token_ids, mixed.logprobs)],
                               [d[t].logprob for t, d in zip(alone.token_ids, alone.logprobs)], atol=1e-6)
