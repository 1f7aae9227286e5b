"""The Responses API (`/v1/responses`) through the real server (tests/server_process.py: a tiny random Llama
with SmolLM2's tokenizer and chat template) and the real `openai` client: a response equals the chat
completion of the same messages (greedy: the same text and token counts), whole and streamed (OpenAI's
event sequence, `client.responses.stream`), `text.format` json_schema, forced function calls and the
follow-up with their outputs, `previous_response_id`, the store (retrieve, delete, store=false, cancel),
logprobs, `max_output_tokens` making it "incomplete", and 400s / 404s naming the field."""

import json
import os
import re
import subprocess
import sys

import jsonschema
import openai
import pytest

from tests.server_process import ROOT, metrics, success, wait_metrics

SYSTEM, ASK = "You are terse.", "What is 2 + 2?"
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50},
                                          "label": {"type": "string", "maxLength": 6}},
         "required": ["x", "label"], "additionalProperties": False}
TIME = {"type": "function", "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                       "additionalProperties": False}}
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


def chat(client, messages, max_tokens, **kw):
    return client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=max_tokens,
                                          temperature=0, **kw)


def assert_same_as_chat(resp, completion):
    c = completion.choices[0]
    assert resp.output_text == c.message.content
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == \
        (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens)
    assert resp.status == ("incomplete" if c.finish_reason == "length" else "completed")


def collapsed(types: list[str]) -> list[str]:
    """Event types with runs of the same delta event collapsed to one."""
    return [t for i, t in enumerate(types) if i == 0 or t != types[i - 1] or not t.endswith(".delta")]


def test_text_input_with_instructions_equals_the_chat_completion(client):
    completion = chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}], 8)
    resp = client.responses.create(model="tiny", input=ASK, instructions=SYSTEM, max_output_tokens=8, temperature=0)
    assert_same_as_chat(resp, completion)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == "tiny"
    assert resp.instructions == SYSTEM and resp.max_output_tokens == 8 and resp.temperature == 0
    body = resp.model_dump()
    assert resp.text is None and resp.tools == [] and body.get("store") is None       # vLLM sends neither
    assert body["frequency_penalty"] == body["presence_penalty"] == 0.0                 # vLLM's fields
    assert body["usage"]["input_tokens_details"]["cache_write_tokens"] == 0
    assert body["usage"]["output_tokens_details"]["tool_output_tokens"] == 0
    [item] = resp.output
    assert (item.type, item.role, item.content[0].type, item.content[0].annotations) == \
        ("message", "assistant", "output_text", [])
    if resp.status == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens" and item.status == "incomplete"
    items = [{"role": "system", "content": SYSTEM},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]}]
    listed = client.responses.create(model="tiny", input=items, max_output_tokens=8, temperature=0)
    assert_same_as_chat(listed, completion)


def test_max_output_tokens_makes_it_incomplete_whole_and_streamed(client):
    resp = client.responses.create(model="tiny", input=ASK, max_output_tokens=3, temperature=0)
    assert (resp.status, resp.incomplete_details.reason, resp.usage.output_tokens) == \
        ("incomplete", "max_output_tokens", 3)
    events = list(client.responses.create(model="tiny", input=ASK, max_output_tokens=3, temperature=0, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == resp.output_text


def test_streamed_events_in_order_add_up_to_the_whole_response(client):
    kw = dict(model="tiny", input=ASK, instructions=SYSTEM, max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert collapsed(types) == TEXT_EVENTS + [f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert text == done.text == whole.output_text == final.output_text
    assert final.id == events[0].response.id and final.usage == whole.usage
    assert final.output[0].id == events[2].item.id == done.item_id
    assert client.responses.retrieve(final.id).output_text == text             # streamed ones are stored too


def test_the_clients_stream_helper_and_a_completed_constrained_answer(client):
    with client.responses.stream(model="tiny", input=ASK, max_output_tokens=10,
                                 extra_body={"structured_outputs": {"choice": ["four", "five"]}}) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == deltas and deltas in ("four", "five")


def test_text_format_json_schema_is_valid_json(client):
    fmt = {"format": {"type": "json_schema", "name": "point", "schema": POINT, "strict": True}}
    for seed in range(2):
        resp = client.responses.create(model="tiny", input=ASK, text=fmt, max_output_tokens=60,
                                       extra_body={"seed": seed})
        assert resp.status == "completed" and resp.text.format.name == "point"
        jsonschema.validate(json.loads(resp.output_text), POINT)
    obj = client.responses.create(model="tiny", input=ASK, text={"format": {"type": "json_object"}},
                                  max_output_tokens=40, temperature=0)
    assert obj.status != "completed" or isinstance(json.loads(obj.output_text), dict)


def test_forced_function_calls_then_their_outputs_continue_the_conversation(client):
    """One tool: the tiny server's 256-token context holds the tools' description and a call."""
    kw = dict(model="tiny", input="Time in Paris?", tools=[TIME], max_output_tokens=40, extra_body={"seed": 3})
    for choice in ("required", {"type": "function", "name": "get_time"}):
        resp = client.responses.create(**kw, tool_choice=choice, parallel_tool_calls=False)
        [call] = resp.output
        assert (resp.status, call.type, call.name, call.status) == ("completed", "function_call", "get_time",
                                                                    "completed")
        jsonschema.validate(json.loads(call.arguments), TIME["parameters"])
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and resp.output_text == ""
        assert resp.tool_choice == choice or resp.tool_choice.name == "get_time"
        events = list(client.responses.create(**kw, tool_choice=choice, parallel_tool_calls=False, stream=True))
        assert collapsed([e.type for e in events])[2:] == [
            "response.output_item.added", "response.function_call_arguments.delta",
            "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert args == events[-2].item.arguments == call.arguments and events[-2].item.name == "get_time"
    outputs = [{"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}]
    follow = client.responses.create(model="tiny", previous_response_id=resp.id, input=outputs, tools=[TIME],
                                     max_output_tokens=4, temperature=0)
    assert follow.usage.input_tokens > resp.usage.input_tokens + resp.usage.output_tokens
    again = client.responses.create(model="tiny", input=[{"role": "user", "content": "Time in Paris?"}, *resp.output,
                                                         *outputs],
                                    tools=[TIME], max_output_tokens=4, temperature=0)
    assert (again.output_text, again.usage.input_tokens) == (follow.output_text, follow.usage.input_tokens)


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model="tiny", input="Hi", instructions=SYSTEM, max_output_tokens=5,
                                    temperature=0)
    second = client.responses.create(model="tiny", input="And then?", previous_response_id=first.id,
                                     max_output_tokens=5, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.output_tokens + 5                # the earlier turn is in it
    completion = chat(client, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
                               {"role": "user", "content": "And then?"}], 5)     # instructions are not carried over
    assert_same_as_chat(second, completion)


def test_the_store_retrieve_delete_cancel_and_store_false(client):
    resp = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, metadata={"k": "v"})
    got = client.responses.retrieve(resp.id)
    assert got.model_dump() == resp.model_dump() and got.metadata == {"k": "v"}
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        client.responses.cancel(resp.id)
    client.responses.delete(resp.id)
    unstored = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, store=False)
    for rid in (resp.id, unstored.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError, match="not found"):
            client.responses.retrieve(rid)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="tiny", input="Hi", previous_response_id=unstored.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


def test_logprobs_when_included_equal_the_chat_completions(client, tiny_server):
    before = success(wait_metrics(tiny_server.url, lambda m: True), "length")
    resp = client.responses.create(model="tiny", input=ASK, max_output_tokens=4, temperature=0, top_logprobs=2,
                                   include=["message.output_text.logprobs"])
    lps = resp.output[0].content[0].logprobs
    completion = chat(client, [{"role": "user", "content": ASK}], 4, logprobs=True, top_logprobs=2)
    assert [(lp.token, lp.logprob, len(lp.top_logprobs)) for lp in lps] == \
        [(lp.token, lp.logprob, 2) for lp in completion.choices[0].logprobs.content]
    assert success(wait_metrics(tiny_server.url, lambda m: success(m, "length") >= before + 2), "length") >= before + 2


def test_a_client_leaving_a_stream_aborts_its_request(tiny_server, client):
    before = metrics(tiny_server.url)
    stream = client.responses.create(model="tiny", input="Tell me a long story", max_output_tokens=200, temperature=0,
                                     stream=True, extra_body={"ignore_eos": True})
    for _ in zip(range(6), stream):
        pass
    stream.close()
    after = wait_metrics(tiny_server.url, lambda m: m["tp_jax:num_requests_running"] == 0 and
                         m["tp_jax:kv_blocks_used"] == 0 and success(m, "abort") > success(before, "abort"))
    assert success(after, "abort") - success(before, "abort") == 1 and after["tp_jax:kv_blocks_used"] == 0


@pytest.mark.parametrize("kw, field", [
    (dict(tools=[{"type": "web_search"}]), "tools[0]"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]),
     "input[0].content[0]"),
    (dict(input=[{"type": "function_call", "name": "f"}]), "call_id"),
    (dict(extra_body={"background": True}), "background"),
    (dict(text={"format": {"type": "json_schema", "name": "x"}}), "schema"),
    (dict(tools=[TIME], tool_choice={"type": "function", "name": "nope"}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(max_output_tokens=10_000), "max_output_tokens"),
    (dict(temperature=5), "temperature"),
])
def test_bad_fields_are_400_naming_the_field(client, kw, field):
    kw = {"model": "tiny", "input": "Hi", "max_output_tokens": 2, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**kw)
    assert field in e.value.message


def test_an_unknown_field_is_accepted_and_logged_once_as_vllm_does(client, tiny_server):
    for _ in range(2):
        resp = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, temperature=0,
                                       extra_body={"responses_frobnicate": 1})
        assert resp.status in ("completed", "incomplete")
    lines = [line for line in tiny_server.log().splitlines()
             if "accepted and not used" in line and "responses_frobnicate" in line]
    assert len(lines) == 1


def test_the_serving_doc_responses_example_runs(tiny_server):
    """docs/serving.md's Responses block, run as written against the server (only the URL changed)."""
    text = open(os.path.join(ROOT, "docs", "serving.md")).read()
    code = re.search(r"### The Responses API\n.*?```python\n(.*?)```", text, re.S).group(1)
    r = subprocess.run([sys.executable, "-c", code.replace("http://127.0.0.1:8000/v1", tiny_server.base)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # the texts before it are sampled (temperature 1, unseeded: they depend on what the server ran before, and may
    # hold newlines), the forced call is not
    calls = [line for line in r.stdout.splitlines() if line.startswith("function_call ")]
    assert len(calls) == 1 and calls[0].startswith("function_call get_time {"), r.stdout


def test_events_of_reasoning_text_and_a_call_match_the_whole_answers_items():
    """Without a server: a chat stream's deltas (reasoning, content, a named call in pieces) become OpenAI's
    events, one item at a time, and the final Response's output equals the one the whole answer gives."""
    from tp_jax.server.responses_api import ResponsesRequest, Run
    from tp_jax.server.responses_output import Events, output_items
    run = Run(ResponsesRequest(input="Hi", tools=[TIME]), None, "resp_1", 0, "tiny", [])
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": ""}}
    chunks = [{"delta": {"role": "assistant", "content": ""}}, {"delta": {"reasoning_content": "Hmm, "}},
              {"delta": {"reasoning_content": "time."}}, {"delta": {"content": "Let me look."}},
              {"delta": {"tool_calls": [call]}},
              {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"zone":'}}]}},
              {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"UTC"}'}}]},
               "finish_reason": "tool_calls"}]
    events = Events(run)
    sse = events.start() + [e for c in chunks for e in events.delta(c)]
    closing, response = events.finish("tool_calls", {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12})
    parsed = [json.loads(e.split("\ndata: ", 1)[1]) for e in sse + closing]
    assert [e["sequence_number"] for e in parsed] == list(range(len(parsed)))
    assert collapsed([e["type"] for e in parsed]) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        *TEXT_EVENTS[2:], "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    message = {"role": "assistant", "reasoning_content": "Hmm, time.", "content": "Let me look.",
               "tool_calls": [{"id": "call_1", "type": "function",
                               "function": {"name": "get_time", "arguments": '{"zone":"UTC"}'}}]}
    strip = lambda items: [{k: v for k, v in i.items() if k != "id"} for i in items]
    assert strip(response["output"]) == strip(output_items(message, "tool_calls", None))
    assert response["status"] == "completed" and response["usage"]["output_tokens"] == 9
