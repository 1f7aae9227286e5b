"""Completions' `echo`, `max_tokens: 0` and vLLM's `prompt_logprobs` field on the tiny server subprocess
(tests/server_process.py), through the `openai` client, against transformers' log-softmax of the same
weights: the prompt's tokens, logprobs (null first), top logprobs and text offsets, then the generated
token's; whole == streamed; chat's top-level `prompt_logprobs`."""

import httpx
import numpy as np
import pytest

PROMPT_IDS = [9690, 198, 2683, 359, 253, 5356, 30, 2683, 3522, 665, 17, 28, 42]


@pytest.fixture(scope="module")
def hf(tiny_path):
    """(tokenizer, ids -> transformers' log-softmax [T, V] float64) for the served weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()

    def log_softmax(ids):
        with torch.no_grad():
            x = model(torch.tensor([ids])).logits[0].double()
        return torch.log_softmax(x, -1).numpy()
    return AutoTokenizer.from_pretrained(tiny_path), log_softmax


def test_echo_gives_the_prompt_logprobs_then_the_completion(client, hf):
    tok, log_softmax = hf
    ref = log_softmax(PROMPT_IDS)
    r = client.completions.create(model="tiny", prompt=PROMPT_IDS, echo=True, logprobs=2, max_tokens=1,
                                  temperature=0, n=2)
    gen = int(np.argmax(ref[-1]))
    for choice in r.choices:
        lp = choice.logprobs
        assert lp.tokens == [tok.decode([t]) for t in PROMPT_IDS + [gen]]
        assert choice.text == tok.decode(PROMPT_IDS) + tok.decode([gen])
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = [ref[i - 1, t] for i, t in enumerate(PROMPT_IDS) if i] + [ref[-1, gen]]
        np.testing.assert_allclose(lp.token_logprobs[1:], want, atol=1e-4)
        for i, top in enumerate(lp.top_logprobs[1:]):
            best = np.sort(ref[i])[::-1][:2]
            assert len(top) == 2 and sorted(top.values(), reverse=True) == pytest.approx(best, abs=1e-4)
        assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    assert r.usage.prompt_tokens == len(PROMPT_IDS) and r.usage.completion_tokens == 2


def test_max_tokens_zero_echoes_only_the_prompt(client, hf):
    tok, log_softmax = hf
    r = client.completions.create(model="tiny", prompt=PROMPT_IDS, echo=True, logprobs=1, max_tokens=0)
    c = r.choices[0]
    assert c.text == tok.decode(PROMPT_IDS) and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == len(PROMPT_IDS) and r.usage.completion_tokens == 0
    ref = log_softmax(PROMPT_IDS)
    np.testing.assert_allclose(c.logprobs.token_logprobs[1:], [ref[i - 1, t] for i, t in enumerate(PROMPT_IDS) if i],
                               atol=1e-4)
    text = client.completions.create(model="tiny", prompt="Hello there, world", echo=True, max_tokens=0).choices[0]
    assert text.text == "Hello there, world" and text.logprobs is None


def test_streamed_echo_equals_whole(client):
    kw = dict(model="tiny", prompt="The capital of France is", echo=True, logprobs=1, max_tokens=5, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    chunks = [c for ch in client.completions.create(**kw, stream=True) for c in ch.choices]
    assert "".join(c.text for c in chunks) == whole.text and whole.text.startswith("The capital of France is")
    assert sum((c.logprobs.tokens for c in chunks), []) == whole.logprobs.tokens
    assert sum((c.logprobs.text_offset for c in chunks), []) == whole.logprobs.text_offset
    assert sum((c.logprobs.token_logprobs for c in chunks), []) == whole.logprobs.token_logprobs


def test_prompt_logprobs_field_on_completions_and_chat(tiny_server, hf):
    tok, log_softmax = hf
    ref = log_softmax(PROMPT_IDS)
    body = httpx.post(f"{tiny_server.base}/completions", timeout=600, json={
        "model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 2, "prompt_logprobs": 3}).json()
    field = body["choices"][0]["prompt_logprobs"]
    assert field[0] is None and len(field) == len(PROMPT_IDS)
    for i, entries in enumerate(field[1:], start=1):
        top = np.argsort(-ref[i - 1])[:3]
        assert set(map(int, entries)) == {PROMPT_IDS[i], *top.tolist()}
        for t, e in entries.items():
            assert e["logprob"] == pytest.approx(ref[i - 1, int(t)], abs=1e-4)
            assert e["decoded_token"] == tok.decode([int(t)])
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{tiny_server.base}/chat/completions", timeout=600, json={
        "model": "tiny", "messages": messages, "max_tokens": 1, "prompt_logprobs": 0}).json()
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    ref = log_softmax(ids)
    got = chat["prompt_logprobs"]
    assert got[0] is None and [list(map(int, e)) for e in got[1:]] == [[t] for t in ids[1:]]
    np.testing.assert_allclose([e[str(t)]["logprob"] for e, t in zip(got[1:], ids[1:])],
                               [ref[i - 1, t] for i, t in enumerate(ids) if i], atol=1e-4)
