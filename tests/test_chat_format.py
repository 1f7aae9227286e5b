"""Choosing the tool-call and reasoning parsers from real published chat templates (tests/data/chat_templates,
their sources in its README), the tools described for a template that renders none, and the reasoning
parsers on text, whole and streamed a few characters at a time."""

import json
import os

import pytest

from tp_jax.server.chat_format import choose
from tp_jax.server.chat_output import ChoiceStream, message
from tp_jax.server.constraints import Tool
from tp_jax.server.reasoning import ReasoningStream, split, wanted
from tp_jax.server.tools import ToolMode, for_template, with_tools_described

TEMPLATES = os.path.join(os.path.dirname(__file__), "data", "chat_templates")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def tokenizer(template: str | None):
    """A tokenizer with only the special tokens templates name: enough to render (tokenize=False)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                  bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = template
    return tok


def template(name: str) -> str:
    with open(os.path.join(TEMPLATES, name)) as f:
        return f.read()


@pytest.mark.parametrize("name,tools,inject,reasoning", [
    ("qwen2.5-instruct.jinja", "hermes", False, None),
    ("qwen3.jinja", "hermes", False, "qwen3"),
    ("qwen3-coder.jinja", "qwen3_coder", False, None),
    ("llama-3.1-instruct.jinja", "llama3_json", False, None),
    ("mistral-7b-instruct-v0.3.jinja", "mistral", False, None),
    ("deepseek-r1-distill-qwen.jinja", "hermes", True, "deepseek_r1"),
    ("smollm2-instruct.jinja", "hermes", True, None),
])
def test_the_parsers_are_chosen_from_the_template(name, tools, inject, reasoning):
    fmt = choose(tokenizer(template(name)))
    assert (fmt.tool_parser, fmt.inject_tools, fmt.reasoning_parser) == (tools, inject, reasoning)
    assert f"tool calls: {tools} (" in fmt.describe() and f"reasoning parser: {reasoning or 'off'} (" in fmt.describe()


def test_the_flags_win_and_a_mismatch_is_said():
    tok = tokenizer(template("smollm2-instruct.jinja"))
    fmt = choose(tok, "llama3_json", "deepseek_r1")
    assert (fmt.tool_parser, fmt.inject_tools, fmt.reasoning_parser) == ("llama3_json", False, "deepseek_r1")
    assert "--tool-call-parser" in fmt.tool_reason and "never mentions </think>" in fmt.warnings[0]
    with pytest.raises(ValueError, match="choose one of hermes, llama3_json, mistral, openai, qwen3_coder"):
        choose(tok, "pythonic")
    with pytest.raises(ValueError, match="choose one of deepseek_r1, qwen3, openai_gptoss"):
        choose(tok, None, "granite")
    assert choose(tokenizer(None)).tool_reason == "no chat template"


def test_a_template_without_tools_gets_them_described_in_hermes_form():
    tok = tokenizer(template("smollm2-instruct.jinja"))
    conv = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    text = tok.apply_chat_template([for_template(m) for m in with_tools_described(conv, [WEATHER])],
                                   tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n") and json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           '</tool_call><|im_end|>' in text                     # the earlier call, as the model would write it
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in text
    system = with_tools_described([{"role": "system", "content": "Be brief."}, conv[0]], [WEATHER])
    assert system[0]["content"].startswith("Be brief.\n\n# Tools") and len(system) == 2


THOUGHTS = "<think>\nPlan: look it up.\n</think>\n\nParis is sunny."


@pytest.mark.parametrize("parser,text,expected", [
    ("deepseek_r1", THOUGHTS, ("\nPlan: look it up.\n", "\n\nParis is sunny.")),
    ("deepseek_r1", THOUGHTS.removeprefix("<think>"), ("\nPlan: look it up.\n", "\n\nParis is sunny.")),  # in prompt
    ("deepseek_r1", "still thinking", ("still thinking", None)),      # cut short: all thoughts
    ("qwen3", THOUGHTS, ("\nPlan: look it up.\n", "\n\nParis is sunny.")),
    ("qwen3", "Paris is sunny.</think>", (None, "Paris is sunny.</think>")),   # no opening <think>: content
    ("qwen3", "<think>still", ("still", None)),
])
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_reasoning_parsers_whole_and_streamed(parser, text, expected, step):
    assert split(parser, text) == expected
    stream, thoughts, content = ReasoningStream(parser), "", ""
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for k, p in enumerate(pieces):
        r, c = stream.feed(p, k == len(pieces) - 1)
        thoughts, content = thoughts + r, content + c
    assert (thoughts or None, content or None) == expected


def test_thoughts_then_a_call_and_when_the_parser_is_off():
    mode = ToolMode("auto", [Tool(**WEATHER)], parser="hermes")
    text = ('Need the weather.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>')
    msg, reason = message(text, "stop", mode, "deepseek_r1")
    assert msg["reasoning_content"] == "Need the weather." and msg["content"] is None and reason == "tool_calls"
    stream = ChoiceStream(mode, "deepseek_r1")
    deltas = [stream.delta(text[i:i + 5], "stop" if i + 5 >= len(text) else None) for i in range(0, len(text), 5)]
    assert "".join(d.get("reasoning_content", "") for d, _ in deltas) == "Need the weather."
    args = "".join(c["function"]["arguments"] for d, _ in deltas for c in d.get("tool_calls", ()))
    assert args == msg["tool_calls"][0]["function"]["arguments"] and deltas[-1][1] == "tool_calls"
    assert message("a</think>b", "stop", None, None) == ({"role": "assistant", "content": "a</think>b"}, "stop")
    assert wanted("qwen3", {"enable_thinking": False}, False) is None
    assert wanted("deepseek_r1", None, True) is None and wanted("deepseek_r1", {}, False) == "deepseek_r1"


@pytest.mark.parametrize("flag,choices", [
    ("--tool-call-parser", "'hermes', 'llama3_json', 'mistral', 'openai', 'qwen3_coder'"),
    ("--reasoning-parser", "'deepseek_r1', 'qwen3', 'openai_gptoss'")])
def test_an_unknown_parser_flag_exits_2_listing_the_choices(flag, choices, capsys):
    from tp_jax.server.cli import build_parser
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", flag, "foo"])
    assert e.value.code == 2 and f"invalid choice: 'foo' (choose from {choices})" in capsys.readouterr().err
