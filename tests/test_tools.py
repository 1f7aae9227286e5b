"""Tool calling's front-door pieces: the four parsers (hermes, llama3_json, mistral, qwen3_coder), the streamed
deltas of each tool_choice (fed a few characters at a time, as tokens arrive: a call's argument pieces join
up to the whole answer's arguments), the `required` schema, and the chat template receiving `tools=` and an
earlier call's arguments as a dict (a Qwen2.5-style template)."""

import copy
import json
import types

import jsonschema
import pytest

from tp_jax.server.constraints import Tool
from tp_jax.server.handlers import Handler
from tp_jax.server.protocol import ChatCompletionRequest
from tp_jax.server.tool_parsers import MistralParser, Qwen3CoderParser
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
MISTRAL = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", ' \
          '"arguments": {"zone": "CET"}}]'
CODER = ('Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n'
         '</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n'
         '</tool_call>')
REQUIRED = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{"zone":"CET"}}]'
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
    content, calls = MistralParser().parse(MISTRAL)
    assert content is None and _calls(calls) == CALLS
    assert _calls(MistralParser().parse(MISTRAL.removeprefix("[TOOL_CALLS]"))[1]) == CALLS   # the marker skipped
    content, calls = Qwen3CoderParser(TOOLS).parse(CODER)
    assert content == "Let me check." and _calls(calls) == CALLS
    broken = 'Hm <tool_call>{"name": "get_weather", "arguments": {"city"'
    assert HermesParser().parse(broken) == (broken, [])                # not a call: the text is the answer
    assert Llama3JsonParser().parse('{"city": "Paris"}') == ('{"city": "Paris"}', [])   # no name


def _stream(mode: ToolMode, text: str, step: int = 3, finish: str = "stop"):
    s, deltas = ToolStream(mode), []
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for k, p in enumerate(pieces):
        deltas.append(s.delta(p, finish if k == len(pieces) - 1 else None))
    return deltas


def _joined(deltas) -> dict[int, tuple[str, str]]:
    """Each streamed call as (name, its argument pieces joined), checking vLLM's delta shapes on the way."""
    calls = {}
    for d, _ in deltas:
        for c in d.get("tool_calls", ()):
            if c["index"] not in calls:          # the first delta of a call: index, id, type, function.name
                assert c["id"].startswith("call_") and c["type"] == "function" and c["function"]["name"]
                calls[c["index"]] = (c["function"]["name"], c["function"]["arguments"])
            else:                                # later ones: arguments only
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                calls[c["index"]] = (calls[c["index"]][0], calls[c["index"]][1] + c["function"]["arguments"])
    return calls


@pytest.mark.parametrize("choice,parser,text", [("auto", "hermes", HERMES), ("auto", "llama3_json", LLAMA),
                                                ("auto", "mistral", MISTRAL), ("auto", "qwen3_coder", CODER),
                                                ("required", None, REQUIRED)])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_calls_stream_their_arguments_as_sampled_and_join_up_to_the_whole_answer(choice, parser, text, step):
    mode = ToolMode(choice, TOOLS, parser=parser)
    deltas = _stream(mode, text, step)
    content = "".join(d.get("content", "") for d, _ in deltas)
    whole, reason = mode.message(text, "stop")
    assert content.strip() == (whole["content"] or "")           # nothing of a call leaks as text
    assert _joined(deltas) == {i: (c["function"]["name"], c["function"]["arguments"])
                               for i, c in enumerate(whole["tool_calls"])}
    assert [(n, json.loads(a)) for n, a in _joined(deltas).values()] == CALLS
    assert [r for _, r in deltas] == [None] * (len(deltas) - 1) + ["tool_calls"] and reason == "tool_calls"
    if step == 1:                                # arguments arrive in pieces, before the answer ends
        pieces = [d for d, _ in deltas[:-1] if any("id" not in c for c in d.get("tool_calls", ()))]
        assert len(pieces) >= 2


def test_qwen3_coder_values_take_the_type_of_their_parameter():
    tools = [Tool(type="function", function={"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "s": {"type": "string"}, "o": {"type": "object"}, "b": {"type": "boolean"}}}})]
    text = ("<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n<parameter=s>\n42\n</parameter>\n"
            "<parameter=o>\n{\"k\": [1]}\n</parameter>\n<parameter=b>\ntrue\n</parameter>\n</function>\n</tool_call>")
    (call,) = Qwen3CoderParser(tools).parse(text)[1]
    assert json.loads(call.arguments) == {"n": 42, "s": "42", "o": {"k": [1]}, "b": True}


def test_auto_streams_plain_text_whole_including_a_false_start():
    text = "I would say <tool no, just text."
    deltas = _stream(ToolMode("auto", TOOLS, parser="hermes"), text, step=2, finish="length")
    assert "".join(d.get("content", "") for d, _ in deltas) == text
    assert deltas[-1][1] == "length" and not any("tool_calls" in d for d, _ in deltas)


def test_named_streams_arguments_as_sampled_and_a_cut_short_required_answer_is_text():
    args = '{"zone": "UTC"}'
    deltas = _stream(ToolMode("named", TOOLS, name="get_time"), args)
    first = deltas[0][0]["tool_calls"][0]
    assert first["function"]["name"] == "get_time" and first["id"].startswith("call_")
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d, _ in deltas if d) == args
    assert deltas[-1][1] == "tool_calls"                 # vLLM's stream: tools streamed end with tool_calls
    msg, reason = ToolMode("named", TOOLS, name="get_time").message(args, "stop")
    assert msg["tool_calls"][0]["function"] == {"name": "get_time", "arguments": args}
    assert reason == "stop"                              # vLLM's (and OpenAI's) whole answer to a named choice
    out = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    msg, reason = ToolMode("required", TOOLS).message(out[:20], "length")     # cut short: text, no calls
    assert msg["content"] == out[:20] and "tool_calls" not in msg and reason == "length"
    deltas = _stream(ToolMode("required", TOOLS), out[:12], finish="length")  # before a name: the text
    assert "".join(d.get("content", "") for d, _ in deltas) == out[:12] and deltas[-1][1] == "length"


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
