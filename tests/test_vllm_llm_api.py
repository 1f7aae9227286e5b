"""A script written against vLLM's `LLM` API runs unchanged on tp_jax, and its logprobs are vLLM's (issue 67).

`SCRIPT` is vLLM code (`from vllm import LLM, SamplingParams`, `vllm.logprobs.Logprob`): generate with logprobs,
prompt_logprobs, n > 1 and a seed, then chat. It runs here with `vllm` standing for tp_jax, on the suite's tiny
model (the `ref` fixture), and what it read is checked against references that are not ours: each Logprob's
`logprob` against the log-softmax of `llm.get_logits` at its position (the model's plain forward, no sampler),
its `rank` against the count vLLM makes (the tokens at least as likely, 1-based; the top N ranked 1..N), its
`decoded_token` against the tokenizer's `decode([id])` (vLLM's `convert_ids_list_to_tokens`), and
`cumulative_logprob` against the sum of the sampled tokens' reference logprobs.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

SCRIPT = '''
from vllm import SamplingParams
from vllm.logprobs import Logprob

PROMPTS = ["Once upon a time", "The capital of France is"]


def read(pos):
    """{token id: (logprob, rank, decoded_token)} of one position, every entry a vLLM Logprob."""
    assert all(isinstance(lp, Logprob) for lp in pos.values())
    return {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in pos.items()}


def run(llm):
    params = SamplingParams(n=2, temperature=0.8, top_p=0.95, seed=7, max_tokens=4, logprobs=3, prompt_logprobs=2)
    seen = []
    for out in llm.generate(PROMPTS, params):
        assert out.finished and out.prompt_logprobs[0] is None
        samples = [(c.index, c.text, list(c.token_ids), c.cumulative_logprob, [read(p) for p in c.logprobs],
                    c.finish_reason, c.finished()) for c in out.outputs]
        seen.append((list(out.prompt_token_ids), [read(p) for p in out.prompt_logprobs[1:]], samples))
    again = llm.generate(PROMPTS, params)
    plain = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3))[0]
    chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0.0, max_tokens=3, logprobs=1))
    c = chat[0].outputs[0]
    return {"generate": seen, "again": [[list(c.token_ids) for c in o.outputs] for o in again],
            "plain": (plain.outputs[0].cumulative_logprob, plain.outputs[0].logprobs, plain.prompt_logprobs),
            "chat": (list(chat[0].prompt_token_ids), list(c.token_ids), c.cumulative_logprob,
                     [read(p) for p in c.logprobs])}
'''


@pytest.fixture(scope="module")
def ran(ref):
    """SCRIPT's `run(llm)` on tp_jax under the name `vllm`."""
    import tp_jax
    from tp_jax.serving import outputs
    saved = {k: sys.modules.get(k) for k in ("vllm", "vllm.logprobs")}
    sys.modules["vllm"], sys.modules["vllm.logprobs"] = tp_jax, outputs
    try:
        module = types.ModuleType("vllm_script")
        exec(compile(SCRIPT, "vllm_script", "exec"), module.__dict__)
        return module.run(ref)
    finally:
        for k, v in saved.items():
            sys.modules.pop(k) if v is None else sys.modules.__setitem__(k, v)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def check_position(pos: dict, own: int, row: np.ndarray, n: int, decode, tol: float = 1e-4) -> None:
    """One position's {id: (logprob, rank, decoded_token)} against the reference log-softmax `row`: the token it
    chose (`own`) and the n most likely, vLLM's ranks, the tokenizer's text."""
    top = np.argsort(-row)[:n]
    assert set(pos) == {own, *top.tolist()}
    for t, (lp, rank, text) in pos.items():
        assert lp == pytest.approx(row[t], abs=tol)
        assert text == decode([t])
        if t in top:
            assert rank == top.tolist().index(t) + 1
    lp, rank, _ = pos[own]
    at_least = int((row >= row[own] - tol).sum())          # vLLM's rank, up to ties within roundoff
    assert int((row > row[own] + tol).sum()) + 1 <= rank <= at_least


def test_generate_logprobs_are_vllms_against_the_models_forward(ran, ref):
    decode = ref.get_tokenizer().decode
    assert len(ran["generate"]) == 2
    for prompt, prompt_lps, samples in ran["generate"]:
        assert len(samples) == 2 and [s[0] for s in samples] == [0, 1]
        for _, text, ids, cumulative, lps, reason, finished in samples:
            assert finished and reason in ("stop", "length") and len(lps) == len(ids)
            ref_lp = log_softmax(ref.get_logits([prompt + ids[:-1]])[0])       # [T, V]: row i predicts token i + 1
            for i, (t, pos) in enumerate(zip(ids, lps)):
                check_position(pos, t, ref_lp[len(prompt) - 1 + i], 3, decode)
            assert cumulative == pytest.approx(sum(pos[t][0] for t, pos in zip(ids, lps)), abs=1e-5)
            assert cumulative == pytest.approx(sum(ref_lp[len(prompt) - 1 + i, t] for i, t in enumerate(ids)),
                                               abs=5e-4)
        ref_lp = log_softmax(ref.get_logits([prompt])[0])
        assert len(prompt_lps) == len(prompt) - 1
        for i, pos in enumerate(prompt_lps):                                 # prompt token i + 1
            check_position(pos, prompt[i + 1], ref_lp[i], 2, decode)


def test_a_seed_repeats_and_without_logprobs_there_are_none(ran):
    assert ran["again"] == [[s[2] for s in samples] for _, _, samples in ran["generate"]]
    cumulative, logprobs, prompt_logprobs = ran["plain"]
    assert cumulative is None and logprobs is None and prompt_logprobs is None     # vLLM's LogprobsProcessor


def test_chat_logprobs_against_the_forward_of_its_templated_prompt(ran, ref):
    prompt, ids, cumulative, lps = ran["chat"]
    tok = ref.get_tokenizer()
    assert prompt == tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                        add_generation_prompt=True), add_special_tokens=False)
    ref_lp = log_softmax(ref.get_logits([prompt + ids[:-1]])[0])
    for i, (t, pos) in enumerate(zip(ids, lps)):
        row = ref_lp[len(prompt) - 1 + i]
        assert t == int(np.argmax(row))                                     # greedy: the top token, rank 1
        check_position(pos, t, row, 1, tok.decode)
        assert pos[t][1] == 1
    assert cumulative == pytest.approx(sum(pos[t][0] for t, pos in zip(ids, lps)), abs=1e-5)


def test_outputs_carry_vllms_fields():
    """Every field of vLLM's CompletionOutput and RequestOutput, by name and in vLLM's order (vllm/outputs.py)."""
    import dataclasses

    from tp_jax import CompletionOutput, Logprob, RequestOutput
    assert [f.name for f in dataclasses.fields(Logprob)] == ["logprob", "rank", "decoded_token"]
    assert Logprob(-1.5) == Logprob(logprob=-1.5, rank=None, decoded_token=None)
    assert [f.name for f in dataclasses.fields(CompletionOutput)] == [
        "index", "text", "token_ids", "cumulative_logprob", "logprobs", "routed_experts", "finish_reason",
        "stop_reason", "lora_request", "kv_transfer_params"]
    assert [f.name for f in dataclasses.fields(RequestOutput)] == [
        "request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished", "metrics",
        "lora_request", "encoder_prompt", "encoder_prompt_token_ids", "num_cached_tokens"]
    a = RequestOutput("r", None, [1], None, [CompletionOutput(0, "a", [5], -1.0, [{5: Logprob(-1.0, 1)}])], False)
    b = RequestOutput("r", None, [1], None, [CompletionOutput(0, "b", [6], -3.0, [{6: Logprob(-2.0, 2)}], None,
                                                              "length")], True)
    a.add(b, aggregate=True)
    c = a.outputs[0]
    assert (c.text, c.token_ids, c.cumulative_logprob, c.finish_reason, a.finished) == ("ab", [5, 6], -3.0, "length",
                                                                                         True)
    assert c.logprobs == [{5: Logprob(-1.0, 1)}, {6: Logprob(-2.0, 2)}] and a.kv_transfer_params is None
