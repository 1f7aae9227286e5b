"""Tool calling's front-door pieces: the hermes and llama3_json parsers, the streamed deltas of each
tool_choice (fed a few characters at a time, as tokens arrive), the `required` schema, and the chat
template receiving `tools=` and an earlier call's arguments as a dict (a Qwen2.5-style template)."""

import copy
import json
import types

import jsonschema
import pytest

from tp_jax.server.constraints import Tool
from tp_jax.server.handlers import Handler
from tp_jax.server.protocol import ChatCompletionRequest
from tp_jax.server.tools import HermesParser, Llama3JsonParser, ToolMode, ToolStream, required_schema

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [Tool(**WEATHER), Tool(**TIME)]
HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", ' \
        '"parameters": {"zone": "CET"}}'
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]

QWEN_STYLE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{%- if m.tool_calls %}{%- for tc in m.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{%- endfor %}{%- else %}
{{ m.content }}{%- endif %}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_parsers_read_their_family_s_calls():
    content, calls = HermesParser().parse(HERMES)
    assert content == "Let me check." and _calls(calls) == CALLS
    content, calls = Llama3JsonParser().parse(LLAMA)
    assert content is None and _calls(calls) == CALLS
    for parser in (HermesParser(), Llama3JsonParser()):
        assert parser.parse("Paris is sunny.") == ("Paris is sunny.", [])
    broken = 'Hm <tool_call>{"name": "get_weather", "arguments": {"city"'
    assert HermesParser().parse(broken) == (broken, [])                # not a call: the text is the answer
    assert Llama3JsonParser().parse('{"city": "Paris"}') == ('{"city": "Paris"}', [])   # no name


def _stream(mode: ToolMode, text: str, step: int = 3, finish: str = "stop"):
    s, deltas = ToolStream(mode), []
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for k, p in enumerate(pieces):
        deltas.append(s.delta(p, finish if k == len(pieces) - 1 else None))
    return deltas


@pytest.mark.parametrize("parser,text", [("hermes", HERMES), ("llama3_json", LLAMA)])
def test_auto_streams_content_then_the_calls(parser, text):
    deltas = _stream(ToolMode("auto", TOOLS, parser=parser), text)
    content = "".join(d.get("content", "") for d, _ in deltas)
    calls = [c for d, _ in deltas for c in d.get("tool_calls", ())]
    assert content == ("Let me check.\n" if parser == "hermes" else "")    # nothing of a call leaks as text
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(i, n, a) for i, (n, a) in enumerate(CALLS)]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert [r for _, r in deltas] == [None] * (len(deltas) - 1) + ["tool_calls"]


def test_auto_streams_plain_text_whole_including_a_false_start():
    text = "I would say <tool no, just text."
    deltas = _stream(ToolMode("auto", TOOLS, parser="hermes"), text, step=2, finish="length")
    assert "".join(d.get("content", "") for d, _ in deltas) == text
    assert deltas[-1][1] == "length" and not any("tool_calls" in d for d, _ in deltas)


def test_named_streams_arguments_as_sampled_and_required_at_the_end():
    args = '{"zone": "UTC"}'
    deltas = _stream(ToolMode("named", TOOLS, name="get_time"), args)
    first = deltas[0][0]["tool_calls"][0]
    assert first["function"]["name"] == "get_time" and first["id"].startswith("call_")
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d, _ in deltas if d) == args
    assert deltas[-1][1] == "tool_calls"
    out = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    deltas = _stream(ToolMode("required", TOOLS), out)
    assert all(d == {} for d, _ in deltas[:-1])
    (call,) = deltas[-1][0]["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_weather", {"city": "Oslo"})
    msg, reason = ToolMode("required", TOOLS).message(out[:20], "length")     # cut short: text, no calls
    assert msg["content"] == out[:20] and "tool_calls" not in msg and reason == "length"


def test_required_schema_takes_calls_of_the_tools_only():
    schema = required_schema(TOOLS)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "x"}},
                         {"name": "get_time", "parameters": {"zone": "y"}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"zone": "y"}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"zone": "y"}}] * 2, required_schema(TOOLS, False))


def test_tools_and_earlier_calls_reach_the_chat_template(tiny_path):
    from tp_jax.serving.llm import LLM
    llm = LLM(tiny_path, max_model_len=256, max_num_seqs=2, progress=False)
    tok = copy.deepcopy(llm.get_tokenizer())       # the loaded tokenizer is shared (lru_cache): change a copy
    tok.chat_template = QWEN_STYLE
    handler = Handler(types.SimpleNamespace(engine=llm.engine), tok, ["tiny"], 256, None, tool_parser="hermes")
    body = dict(messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}], tools=[WEATHER, TIME])
    req = ChatCompletionRequest(**body)
    job = handler.chat_job(req)
    text = tok.decode(job.prompts[0])
    assert json.dumps(WEATHER) in text and json.dumps(TIME) in text                 # tools= rendered
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text         # a dict, not a JSON string
    assert job.tools.choice == "auto" and job.params.structured_outputs is None
    named = handler.chat_job(ChatCompletionRequest(**body, tool_choice={"type": "function",
                                                                         "function": {"name": "get_time"}}))
    assert named.params.structured_outputs.json == TIME["function"]["parameters"]
