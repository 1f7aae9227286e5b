"""Structured outputs and tools through the real server (tests/server_process.py: a tiny random Llama with
SmolLM2's tokenizer, no --tool-call-parser, compact JSON) and the real `openai` client: response_format
json_schema / json_object, vLLM's structured_outputs (choice, regex, grammar, json) on chat and completions,
400s for bad schemas, tools with tool_choice required / named / auto (the parser chosen from the template,
the tools described in the prompt), their streamed argument deltas, a follow-up `role: "tool"` turn,
LangChain's ChatOpenAI (bind_tools, with_structured_output), a reasoning parser chosen from a thinking
template (in process, over the reference engine), and 8 concurrent constrained requests beside an
unconstrained one that keeps its solo tokens. The model's outputs are garbage unless constrained, so every
check of validity can fail."""

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI

from tp_jax.serving.sampling import SamplingParams
from tp_jax.serving.structured import StructuredOutputsParams

POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50},
                                          "label": {"type": "string", "maxLength": 6},
                                          "ok": {"type": "boolean"}},
         "required": ["x", "label", "ok"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat_text(stream) -> tuple[str, str, list]:
    text, finish, chunks = "", None, []
    for ch in stream:
        chunks.append(ch)
        for c in ch.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish, chunks


def test_response_format_json_schema_whole_and_streamed(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT, "strict": True}}
    for seed in range(3):
        whole = client.chat.completions.create(model="tiny", messages=ASK, response_format=fmt, max_tokens=120,
                                               seed=seed)
        c = whole.choices[0]
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), POINT)
        text, finish, _ = chat_text(client.chat.completions.create(
            model="tiny", messages=ASK, response_format=fmt, max_tokens=120, seed=seed, stream=True))
        assert (text, finish) == (c.message.content, "stop")


def test_json_object_and_structured_outputs_equal_the_engine(client, ref):
    """Each form reaches the engine as the same constraint: the answer equals LLM.generate's with it."""
    tok = ref.get_tokenizer()
    prompt_ids = tok.encode(tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
    forms = [({"response_format": {"type": "json_object"}}, dict(json_object=True)),
             ({"extra_body": {"structured_outputs": {"choice": ["sunny", "rainy", "foggy"]}}},
              dict(choice=["sunny", "rainy", "foggy"])),
             ({"extra_body": {"structured_outputs": {"json": POINT}}}, dict(json=POINT))]
    for kw, so in forms:
        exp = ref.generate([prompt_ids], SamplingParams(max_tokens=24, seed=4, structured_outputs=
                                                        StructuredOutputsParams(**so, disable_any_whitespace=True)))
        got = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=24, seed=4, **kw)
        assert got.choices[0].message.content == exp[0].outputs[0].text, kw
    assert got.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(got.choices[0].message.content), POINT)


def test_completions_take_structured_outputs(client):
    for so, ok in [({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
                   ({"grammar": 'start: "(" N ("," N)* ")"\nN: /[0-9]/'}, lambda t: re.fullmatch(r"\(\d(,\d)*\)", t)),
                   ({"choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta"))]:
        r = client.completions.create(model="tiny", prompt=["Code:", "Tuple:"], max_tokens=60, n=2, seed=1,
                                      extra_body={"structured_outputs": so})
        assert len(r.choices) == 4
        for c in r.choices:
            assert c.finish_reason == "stop" and ok(c.text), (so, c.text)


def test_bad_schemas_and_conflicts_are_400_before_the_engine(client):
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
         "response_format", "Invalid type"),
        ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs", "unclosed group"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs",
         "exactly one of"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
         "response_format", "send only one"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None,
         "not among the tools"),
        ({"tool_choice": "required"}, None, "needs tools"),
    ]
    for kw, param, msg in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, **kw)
        err = e.value.body
        assert msg in err["message"], (kw, err)
        if param is not None:
            assert err["param"] == param, (kw, err)


def test_tool_choice_required_and_named_make_valid_calls_whole_and_streamed(client):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for choice in ["required", {"type": "function", "function": {"name": "get_time"}}]:
        kw = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=80, seed=9,
                  parallel_tool_calls=False)
        m = client.chat.completions.create(**kw).choices[0]
        assert m.finish_reason == ("tool_calls" if choice == "required" else "stop")     # vLLM's: named is "stop"
        assert m.message.content is None
        calls = m.message.tool_calls
        assert len(calls) == 1 and calls[0].id.startswith("call_") and calls[0].type == "function"
        if isinstance(choice, dict):
            assert calls[0].function.name == "get_time"
        jsonschema.validate(json.loads(calls[0].function.arguments), schemas[calls[0].function.name])
        names, args, finish, pieces = {}, {}, None, 0
        for ch in client.chat.completions.create(**kw, stream=True):
            for c in ch.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or ():
                    if d.function.name:
                        names[d.index] = d.function.name
                        assert d.id.startswith("call_") and d.type == "function"
                    args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
                    pieces += 1
        assert finish == "tool_calls" and pieces > 2                  # the arguments came as they were sampled
        assert (names, args) == ({0: calls[0].function.name}, {0: calls[0].function.arguments})


def test_tool_choice_auto_returns_the_text_when_the_model_makes_no_call(tiny_server, client, ref):
    """No --tool-call-parser: SmolLM2's template renders no tools, so the server chose hermes and describes the
    tools in a system message. The random model never writes <tool_call>: auto answers with its text."""
    from tp_jax.server.tools import with_tools_described
    assert "chat: tool calls: hermes (the chat template has no tool-call format; the template renders no tools" \
        in tiny_server.log()
    got = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=10, seed=2)
    c = got.choices[0]
    assert c.message.tool_calls is None and c.finish_reason == "length" and c.message.content
    tok = ref.get_tokenizer()
    described = tok.apply_chat_template(with_tools_described(ASK, [WEATHER]), tokenize=False,
                                        add_generation_prompt=True)
    assert "<tools>\n" + json.dumps(WEATHER) in described
    assert got.usage.prompt_tokens == len(tok.encode(described, add_special_tokens=False))
    text, finish, _ = chat_text(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER],
                                                               max_tokens=10, seed=2, stream=True))
    assert (text, finish) == (c.message.content, "length")


def test_a_follow_up_turn_with_tool_results_renders_through_the_template(client, ref):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "C"}'}}
    conv = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    got = client.chat.completions.create(model="tiny", messages=conv, tools=[WEATHER], tool_choice="none",
                                         max_tokens=4)
    tok = ref.get_tokenizer()
    rendered = tok.apply_chat_template(
        [ASK[0], {"role": "assistant", "content": "", "tool_calls": [
            {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}],
        tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert "18 C, sunny" in rendered
    assert got.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


def test_langchain_chat_openai_binds_tools_and_parses_structured_output(tiny_server):
    """LangChain's ChatOpenAI as users point it at vLLM: bind_tools with the default tool_choice (auto) answers
    an AIMessage; with_structured_output (json_schema) returns the Pydantic instance."""
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=8)
        sunny: bool

    llm = ChatOpenAI(model="tiny", base_url=tiny_server.base, api_key="unused", max_tokens=24, seed=1,
                     max_retries=0, timeout=600)
    answer = llm.bind_tools([WEATHER]).invoke("What is the weather in Paris?")
    assert isinstance(answer, AIMessage)
    assert answer.response_metadata["finish_reason"] in ("length", "stop", "tool_calls")
    city = llm.with_structured_output(City, method="json_schema").invoke("Name a sunny city.")
    assert isinstance(city, City) and len(city.name) <= 8


THINKING = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
            "{% if enable_thinking is not defined or enable_thinking %}{{ '<think>\\n' }}{% endif %}{% endif %}")


def test_a_thinking_template_reads_the_answer_as_reasoning(ref):
    """A template that opens <think> in the prompt: deepseek_r1 is chosen, so the random model's answer (which
    never closes the block) is all reasoning_content, whole and streamed, equal to the engine's own text;
    chat_template_kwargs enable_thinking=False reaches the template and turns the parser off."""
    import copy

    import httpx
    from tp_jax.server.app import create_app
    from tp_jax.server.reasoning import split
    from tp_jax.serving.async_engine import AsyncLLMEngine
    tok = copy.deepcopy(ref.get_tokenizer())       # the loaded tokenizer is shared (lru_cache): change a copy
    tok.chat_template = THINKING
    aengine = AsyncLLMEngine(ref.engine)
    app = create_app(aengine, tok, model_names=["tiny"], max_model_len=256)
    assert app.state.handler.format.reasoning_parser == "deepseek_r1"
    kw = dict(model="tiny", messages=ASK, max_tokens=12, seed=4)

    async def scenario():
        async with AsyncOpenAI(base_url="http://app/v1", api_key="x", http_client=httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://app")) as ac:
            whole = await ac.chat.completions.create(**kw)
            chunks = [c async for c in await ac.chat.completions.create(**kw, stream=True)]
            off = await ac.chat.completions.create(**kw,
                                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            return whole, chunks, off

    try:
        whole, chunks, off = asyncio.run(scenario())
    finally:
        aengine.shutdown()
    prompt = tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    text = ref.generate([ids], SamplingParams(max_tokens=12, seed=4))[0].outputs[0].text
    m = whole.choices[0].message
    assert (m.model_extra["reasoning_content"], m.content) == split("deepseek_r1", text) == (text, None)
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    assert streamed == text and not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert off.choices[0].message.content and "reasoning_content" not in off.choices[0].message.model_extra
    unthinking = tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.usage.prompt_tokens == len(tok.encode(unthinking, add_special_tokens=False)) < len(ids)


def test_8_concurrent_constrained_beside_an_unconstrained_request(tiny_server, client):
    """Different schemas at once; the unconstrained request's tokens equal its solo run's, token for token."""
    plain = dict(model="tiny", prompt="Once upon a time", max_tokens=24, seed=3, logprobs=0)
    solo = client.completions.create(**plain).choices[0]
    schemas = [{"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9 * (i + 1)},
                "minItems": 1, "maxItems": 2 + i % 3} if i % 2 else
               {"type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": i + 1},
                                                 "n": {"enum": [i, -i, "none"]}},
                "required": [f"k{i}", "n"], "additionalProperties": False} for i in range(8)]

    async def run_all():
        async with AsyncOpenAI(base_url=tiny_server.base, api_key="unused", max_retries=0, timeout=600) as ac:
            constrained = [ac.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"Item {i}"}], max_tokens=100, seed=i,
                response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s}})
                for i, s in enumerate(schemas)]
            return await asyncio.gather(ac.completions.create(**plain), *constrained)

    beside, *answers = asyncio.run(run_all())
    assert beside.choices[0].logprobs.tokens == solo.logprobs.tokens and beside.choices[0].text == solo.text
    for s, a in zip(schemas, answers):
        assert a.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(a.choices[0].message.content), s)


def test_the_serving_doc_client_example_runs(tiny_server):
    """docs/serving.md's openai-client block, run as written against the server (only the URL changed)."""
    import os
    import subprocess
    import sys
    from tests.server_process import ROOT
    text = open(os.path.join(ROOT, "docs", "serving.md")).read()
    code = re.search(r"### With the openai client\n\n```python\n(.*?)```", text, re.S).group(1)
    assert code.count("client.") >= 9 and 'base_url="http://127.0.0.1:8000/v1"' in code
    r = subprocess.run([sys.executable, "-c", code.replace("http://127.0.0.1:8000/v1", tiny_server.base)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert json.loads(lines[0])["label"] is not None and lines[1] in ("sunny", "rainy")
    assert re.fullmatch(r"[0-9]{1,3}\+[0-9]{1,3}", lines[2]) and lines[3].startswith("tool_calls get_weather {")
