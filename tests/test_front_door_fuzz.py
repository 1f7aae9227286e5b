"""Random sampling settings and prompt shapes at the front door: a clear ValueError / TypeError
before any device work, or valid outputs; never a crash, a hang or a leaked block."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from tests.tiny_models import make_checkpoint
from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams

VOCAB, MAX_LEN = 1000, 32

odd = st.one_of(st.integers(-3, 40), st.floats(allow_nan=True, allow_infinity=True, width=32),
                st.sampled_from([None, True, "2", [1], -2**70]))
VALID = st.fixed_dictionaries({}, optional={
    "n": st.integers(1, 3), "max_tokens": st.integers(1, 5), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "seed": st.one_of(st.none(), st.integers(-2**70, 2**70)),
    "logprobs": st.integers(0, 5), "stop_token_ids": st.lists(st.integers(0, 1200), max_size=3),
    "ignore_eos": st.booleans(), "prompt_logprobs": st.integers(0, 3),
})
# three times out of four a valid set; otherwise one field set to anything at all
PARAMS = st.one_of(VALID, VALID, VALID, st.builds(lambda kw, field, value: {**kw, field: value}, VALID,
                                                  st.sampled_from(["n", "max_tokens", "temperature", "top_p",
                                                                   "top_k", "min_p", "seed", "logprobs",
                                                                   "stop_token_ids", "ignore_eos",
                                                                   "repetition_penalty", "prompt_logprobs"]), odd))
token = st.one_of(st.integers(-5, VOCAB + 5), st.floats(-1, 5, width=32), st.booleans(), st.just("a"))
one_prompt = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),              # mostly valid
    st.lists(token, max_size=6),
    st.lists(st.integers(0, VOCAB - 1), min_size=MAX_LEN - 1, max_size=MAX_LEN + 2),
    st.just(""), st.just(b"hi"), st.none(), st.just({"prompt_token_ids": [3, 4]}), st.just({"text": 1}),
    st.builds(lambda n: np.arange(1, n + 1), st.integers(0, 5)),
)
PROMPTS = st.one_of(one_prompt, st.lists(one_prompt, max_size=3),
                    st.builds(lambda r, c: np.ones((r, c), np.int64), st.integers(0, 3), st.integers(0, 4)),
                    st.builds(lambda: np.zeros((2, 2, 2), np.int32)))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(make_checkpoint("gqa", str(tmp_path_factory.mktemp("fuzz"))), max_model_len=MAX_LEN, progress=False)


def idle(llm) -> bool:
    core = llm.engine.core
    return not core.requests and core.kv_usage()[0] == 0


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(kw=PARAMS, prompts=PROMPTS)
def test_front_door_is_clear_or_correct(llm, kw, prompts):
    try:
        params = SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        assert str(e).startswith("SamplingParams:") and len(str(e)) < 400, e
        event("refused by SamplingParams")
        return
    if kw.get("max_tokens") is None:
        params = SamplingParams(**{**kw, "max_tokens": 3})          # bound the run, keep the rest
    steps = llm.engine.core.stats["steps"]
    try:
        outs = llm.generate(prompts, params)
    except (ValueError, TypeError) as e:
        assert llm.engine.core.stats["steps"] == steps, f"{e!r} raised after device work"
        assert "Traceback" not in str(e) and 0 < len(str(e)) < 400
        assert idle(llm)
        event(f"refused by generate: {type(e).__name__}")
        return
    event("generated")
    assert idle(llm)
    assert outs and all(len(o.outputs) == params.n for o in outs)
    for o in outs:
        for c in o.outputs:
            assert (1 if params.max_tokens else 0) <= len(c.token_ids) <= params.max_tokens
            assert all(0 <= t < VOCAB for t in c.token_ids)
            assert c.finish_reason in ("stop", "length")
            if params.logprobs is None:                                # vLLM's: None unless logprobs are asked
                assert c.cumulative_logprob is None
            else:
                assert c.cumulative_logprob is not None and math.isfinite(c.cumulative_logprob)
            assert (c.logprobs is None) == (params.logprobs is None)
        if params.prompt_logprobs is not None:
            assert len(o.prompt_logprobs) == len(o.prompt_token_ids) and o.prompt_logprobs[0] is None
            assert all(t in d and len(d) <= params.prompt_logprobs + 1 and all(x.logprob <= 0 for x in d.values())
                       for t, d in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:]))
