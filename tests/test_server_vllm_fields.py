"""vLLM's request fields on the server (the shared tiny server, tests/server_process.py), through the `openai`
client, against the engine in this process (`ref`): min_tokens, logit_bias, continue_final_message,
add_generation_prompt, return_tokens_as_token_ids, skip_special_tokens, the deprecated functions / function_call,
echo with logprobs' prompt_logprobs, stream_options.continuous_usage_stats, system_fingerprint, and fields accepted
and not used.
Refusals (limits, fields not implemented here): tests/test_server_errors.py."""

import httpx

from tp_jax.serving.sampling import SamplingParams

CHAT = [{"role": "user", "content": "Hi"}]


def test_min_tokens_and_logit_bias_answer_as_the_engine(client, ref):
    plain = ref.generate(["Hello there"], SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0]
    stop = plain.token_ids[1]
    sp = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[stop], min_tokens=4, logit_bias={42: 2.5})
    exp = ref.generate(["Hello there"], sp)[0].outputs[0]
    got = client.completions.create(model="tiny", prompt="Hello there", max_tokens=6, temperature=0, logit_bias={
        "42": 2.5}, extra_body={"stop_token_ids": [stop], "min_tokens": 4}).choices[0]
    assert got.text == exp.text and len(exp.token_ids) >= 4


def test_continue_final_message_continues_the_assistants_text(client, ref):
    tok = ref.get_tokenizer()
    conv = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    text = tok.apply_chat_template(conv, tokenize=False, continue_final_message=True)
    assert text.rstrip().endswith("The answer is")
    exp = ref.generate([tok.encode(text, add_special_tokens=False)], SamplingParams(max_tokens=5, temperature=0.0))
    got = client.chat.completions.create(model="tiny", messages=conv, max_tokens=5, temperature=0, extra_body={
        "continue_final_message": True, "add_generation_prompt": False})
    assert got.choices[0].message.content == exp[0].outputs[0].text
    assert got.usage.prompt_tokens == len(exp[0].prompt_token_ids)


def test_chat_echo_puts_the_last_assistant_message_before_each_answer_as_vllm(client, ref):
    """vLLM's chat `echo`: the last message, when it is the assistant's, before the answer (whole and streamed);
    otherwise the answer alone."""
    tok = ref.get_tokenizer()
    conv = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    kw = dict(model="tiny", messages=conv, max_tokens=4, temperature=0, n=2)
    body = {"continue_final_message": True, "add_generation_prompt": False}
    exp = ref.generate([tok.encode(tok.apply_chat_template(conv, tokenize=False, continue_final_message=True),
                                   add_special_tokens=False)], SamplingParams(max_tokens=4, temperature=0.0))
    got = client.chat.completions.create(**kw, extra_body={**body, "echo": True})
    assert [c.message.content for c in got.choices] == ["The answer is" + exp[0].outputs[0].text] * 2
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body={**body, "echo": True}))
    for k in range(2):
        deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == k]
        assert deltas[1] == "The answer is" and "".join(deltas) == got.choices[k].message.content
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0)
    echoed = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0,
                                            extra_body={"echo": True})           # the last message is the user's
    assert echoed.choices[0].message.content == plain.choices[0].message.content


def test_return_tokens_as_token_ids_names_tokens_by_id(client):
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(c.token.startswith("token_id:") for c in content)
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)
    comp = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0, logprobs=1,
                                     extra_body={"return_tokens_as_token_ids": True})
    assert all(t.startswith("token_id:") for t in comp.choices[0].logprobs.tokens)


def test_skip_special_tokens_false_keeps_them_in_the_text(client):
    bias = {"1": 100}                                  # <|im_start|>: a special token, drawn every time
    for extra, text in (({}, ""), ({"skip_special_tokens": True}, ""), ({"skip_special_tokens": False},
                                                                        "<|im_start|>" * 3)):
        comp = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0, logit_bias=bias,
                                         extra_body=extra)
        assert comp.choices[0].text == text, extra
        kw = dict(model="tiny", messages=CHAT, max_tokens=3, temperature=0, logit_bias=bias, extra_body=extra)
        assert client.chat.completions.create(**kw).choices[0].message.content == text, extra
        chunks = client.chat.completions.create(**kw, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text, extra


def test_deprecated_functions_are_answered_with_function_call(client):
    fn = {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                                           "required": ["q"]}}
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40, temperature=0, functions=[fn],
                                       function_call={"name": "lookup"})
    msg = r.choices[0].message
    assert msg.tool_calls is None and msg.function_call.name == "lookup"
    assert r.choices[0].finish_reason in ("stop", "length")          # a named (forced) function: "stop", as OpenAI


def test_echo_with_logprobs_reports_prompt_logprobs_as_vllm(tiny_server):
    r = httpx.post(f"{tiny_server.base}/completions", json={"model": "tiny", "prompt": "Hello there friend",
                                                           "max_tokens": 2, "echo": True, "logprobs": 1}, timeout=60)
    choice = r.json()["choices"][0]
    prompt_lp, lp = choice["prompt_logprobs"], choice["logprobs"]
    assert prompt_lp[0] is None and lp["token_logprobs"][0] is None
    n = len(prompt_lp)
    for entry, own in zip(prompt_lp[1:], lp["token_logprobs"][1:n]):     # the echoed part's logprobs, both layouts
        assert any(abs(v["logprob"] - own) < 1e-6 for v in entry.values())
        best = max(entry.values(), key=lambda v: v["logprob"])              # vLLM's rank: 1 is the most likely
        assert best["rank"] == 1 and all(v["rank"] >= 1 for v in entry.values())


def test_continuous_usage_stats_put_usage_in_every_chunk(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0,
                                                 stream=True, stream_options=options))
    assert all(c.usage is not None for c in chunks)
    done = [c.usage.completion_tokens for c in chunks]
    assert done == sorted(done) and done[-1] == 4 and chunks[-1].choices == []


def test_fields_vllm_ignores_are_accepted_and_said_once(tiny_server, client):
    # a field name no other test of the session's shared server sends: its log is the session's
    extra = {"store": True, "metadata": {"k": "v"}, "service_tier": "auto", "chat_frobnicate": 1}
    for _ in range(2):
        r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, temperature=0,
                                           reasoning_effort="low", extra_body=extra)
        assert r.choices[0].message.content is not None
    assert r.system_fingerprint.startswith("tp_jax-")
    log = tiny_server.log()
    lines = [line for line in log.splitlines() if "accepted and not used" in line and "chat_frobnicate" in line]
    assert len(lines) == 1 and "store" in log


def test_best_of_answers_the_most_likely_of_its_samples(client, ref):
    samples = ref.generate(["Once"], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5, logprobs=0))[0].outputs
    best = max(samples, key=lambda c: c.cumulative_logprob)
    r = client.completions.create(model="tiny", prompt="Once", max_tokens=6, temperature=1.0, seed=5, best_of=3, n=1)
    assert [c.text for c in r.choices] == [best.text] and len({c.text for c in samples}) > 1
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in samples)     # OpenAI counts every sample


def test_every_request_field_of_vllm_is_implemented_refused_unless_neutral_or_ignored():
    """vLLM 0.32.0's own field lists (ChatCompletionRequest / CompletionRequest.model_fields, kept as test data):
    each is ours, one that would change the answer and is refused unless neutral (NEUTRAL), or one that cannot
    change it and is accepted unused (IGNORED). A new vLLM field shows up here."""
    import json
    import os

    from tp_jax.server.protocol import IGNORED, NEUTRAL, ChatCompletionRequest, CompletionRequest
    path = os.path.join(os.path.dirname(__file__), "data", "vllm_server", "request_fields_0.32.0.json")
    fields = json.load(open(path))
    for route, ours in (("chat/completions", ChatCompletionRequest), ("completions", CompletionRequest)):
        unplaced = [f for f in fields[route] if f not in ours.model_fields and f not in NEUTRAL and f not in IGNORED]
        assert not unplaced, f"{route}: vLLM {fields['vllm']} fields this server does not place: {unplaced}"
        for name, neutral in NEUTRAL.items():                    # refused at another value, accepted at neutral
            if name in fields[route] and name not in ours.model_fields:
                body = {"messages": CHAT} if route.startswith("chat") else {"prompt": "Hi"}
                ours.model_validate({**body, name: neutral})
                other = False if neutral is True else "x"
                try:
                    ours.model_validate({**body, name: other})
                except ValueError as e:
                    assert f"{name}=" in str(e) and "not supported" in str(e)
                else:
                    raise AssertionError(f"{route}: {name}={other!r} was accepted")


def test_deprecated_functions_stream_function_call_deltas(client):
    fn = {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                                           "required": ["q"]}}
    kw = dict(model="tiny", messages=CHAT, max_tokens=40, temperature=0, functions=[fn],
              function_call={"name": "lookup"})
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert all(d.tool_calls is None for d in deltas)
    calls = [d.function_call for d in deltas if d.function_call is not None]
    assert calls[0].name == "lookup" and all(c.name is None for c in calls[1:])
    assert "".join(c.arguments or "" for c in calls) == whole.message.function_call.arguments
    # a forced call: the whole answer ends "stop" (OpenAI's and vLLM's), the stream as vLLM's streams of calls end
    assert (whole.finish_reason, chunks[-1].choices[0].finish_reason) in (("stop", "function_call"),
                                                                         ("length", "length"))
