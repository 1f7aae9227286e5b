"""gpt-oss's harmony format: the parsers chosen from its published chat template (tests/data/chat_templates,
source in its README), a conversation with tools rendered through that template, and answers read whole and
streamed (1, 3, 1000 characters at a time) into `reasoning_content`, `content` and `tool_calls`; malformed
answers are content, never an exception. A chat request's job (the server's handler) keeps the special tokens
and stops at `<|call|>`, and a sampled answer's token ids go through the engine's output processor to its
message."""

import json
import os
import random
import types

import pytest

from tp_jax.server.chat_format import choose
from tp_jax.server.chat_output import ChoiceStream, message
from tp_jax.server.constraints import Tool
from tp_jax.server.harmony import read
from tp_jax.server.reasoning import split, wanted
from tp_jax.server.tool_parsers import PARSERS
from tp_jax.server.tools import ToolMode, for_template

TEMPLATE = os.path.join(os.path.dirname(__file__), "data", "chat_templates", "gpt-oss.jinja")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time in a zone",
                                         "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
TOOLS = [Tool(**WEATHER), Tool(**TIME)]

THINK = "<|channel|>analysis<|message|>User asks the weather. Use the tool.<|end|>"
FINAL = THINK + "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris, 18 C."
ONE_CALL = THINK + ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                    '{"city":"Paris"}')                             # <|call|>: the stop token, not in the text
TWO_CALLS = (THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
             '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
             '{"city": "Paris"}<|call|>'
             "<|start|>assistant<|channel|>analysis<|message|>Now the time.<|end|>"
             '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "CET"}')
FIRST_IS_A_CALL = ' to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC"}'


def tokenizer(template: str):
    """A tokenizer with only the special tokens templates name: enough to render (tokenize=False)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                  unk_token="<unk>")
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def gpt_oss():
    with open(TEMPLATE) as f:
        return tokenizer(f.read())


def test_the_harmony_parsers_are_chosen_from_the_template(gpt_oss):
    fmt = choose(gpt_oss)
    assert (fmt.tool_parser, fmt.inject_tools, fmt.reasoning_parser, fmt.warnings) == \
        ("openai", False, "openai_gptoss", ())
    assert "harmony" in fmt.tool_reason and "analysis channel" in fmt.reasoning_reason
    assert choose(gpt_oss, None, "openai_gptoss").warnings == ()              # the flag, rightly: no warning
    assert "no harmony" in choose(tokenizer("{{ messages[0].content }}"), None, "openai_gptoss").warnings[0]
    assert wanted("openai_gptoss", {"enable_thinking": False}, False) == "openai_gptoss"   # no switch in harmony
    assert wanted("openai_gptoss", None, True) is None                      # a grammar from the first token


def test_a_conversation_with_tools_renders_as_harmony(gpt_oss):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    text = gpt_oss.apply_chat_template([for_template(m) for m in conv], tools=[WEATHER, TIME], tokenize=False,
                                       add_generation_prompt=True)
    assert text.startswith("<|start|>system<|message|>You are ChatGPT") and "Reasoning: medium\n\n" in text
    assert "Calls to these tools must go to the commentary channel: 'functions'.<|end|>" in text
    assert ("<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
            "namespace functions {\n\n// Current weather in a city\ntype get_weather = (_: {\ncity: string,\n"
            "}) => any;\n\n") in text and "type get_time = (_: {\nzone?: string,\n}) => any;" in text
    assert ('<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant to=functions.get_weather'
            '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>') in text   # the earlier call
    assert text.endswith('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18 C"<|end|>'
                         "<|start|>assistant")
    # the model's own reading of that history: the call is a call
    (call,) = read(text[text.rfind("<|start|>assistant to="):text.rfind("<|start|>functions")], True)
    assert (call.kind, call.name, call.channel, call.body) == ("call", "get_weather", "commentary", '{"city": "Paris"}')
    assert gpt_oss.apply_chat_template(conv[:2], tokenize=False, add_generation_prompt=True,
                                       reasoning_effort="high").count("Reasoning: high") == 1
    with pytest.raises(Exception, match="description"):                    # the template needs one per tool
        gpt_oss.apply_chat_template(conv[:2], tools=[{"type": "function", "function": {"name": "f"}}],
                                    tokenize=False, add_generation_prompt=True)


def _stream(tools, text: str, step: int, finish: str = "stop"):
    s, out = ChoiceStream(tools, "openai_gptoss"), []
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    for k, p in enumerate(pieces):
        out.append(s.delta(p, finish if k == len(pieces) - 1 else None))
    return out


def _joined(deltas) -> tuple[str, str, list[tuple[str, str]], str]:
    """(reasoning, content, [(name, arguments)], finish_reason) of a streamed choice, checking call delta shapes."""
    calls = []
    for d, _ in deltas:
        for c in d.get("tool_calls", ()):
            if c["index"] == len(calls):
                assert c["id"].startswith("call_") and c["type"] == "function"
                calls.append((c["function"]["name"], c["function"]["arguments"]))
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                calls[c["index"]] = (calls[c["index"]][0], calls[c["index"]][1] + c["function"]["arguments"])
    return ("".join(d.get("reasoning_content", "") for d, _ in deltas),
            "".join(d.get("content", "") for d, _ in deltas), calls, deltas[-1][1])


@pytest.mark.parametrize("text,reasoning,content,calls", [
    (FINAL, "User asks the weather. Use the tool.", "It is sunny in Paris, 18 C.", []),
    (ONE_CALL, "User asks the weather. Use the tool.", None, [("get_weather", {"city": "Paris"})]),
    (TWO_CALLS, "User asks the weather. Use the tool.\nNow the time.", "Checking both.",
     [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
    (FIRST_IS_A_CALL, None, None, [("get_time", {"zone": "UTC"})]),
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_answers_whole_and_streamed(text, reasoning, content, calls, step):
    mode = ToolMode("auto", TOOLS, parser="openai")
    msg, reason = message(text, "stop", mode, "openai_gptoss")
    assert (msg["reasoning_content"], msg["content"]) == (reasoning, content)
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", ())]
    assert got == calls and reason == ("tool_calls" if calls else "stop")
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in msg.get("tool_calls", ()))
    thoughts, streamed, streamed_calls, finish = _joined(_stream(mode, text, step))
    assert (thoughts or None, streamed or None, finish) == (reasoning, content, reason)
    assert streamed_calls == [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", ())]
    if step == 1 and calls:                     # arguments arrive in pieces, before the answer ends
        assert sum(1 for d, _ in _stream(mode, text, 1)[:-1] for c in d.get("tool_calls", ()) if "id" not in c) > 2


def test_the_arguments_are_the_call_s_text_as_sampled():
    mode = ToolMode("auto", TOOLS, parser="openai")
    msg, _ = message(ONE_CALL, "stop", mode, "openai_gptoss")
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"city":"Paris"}'
    ended = message(ONE_CALL + "<|call|>", "stop", mode, "openai_gptoss")[0]   # the stop token kept in the text
    assert ended["tool_calls"][0]["function"]["arguments"] == '{"city":"Paris"}'
    assert PARSERS["openai"]().parse("Just text.") == ("Just text.", [])


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_without_tools_the_answer_is_reasoning_and_content(step):
    text = FINAL + "<|return|>"
    assert split("openai_gptoss", text) == ("User asks the weather. Use the tool.", "It is sunny in Paris, 18 C.")
    msg, reason = message(text, "stop", None, "openai_gptoss")
    assert msg == {"role": "assistant", "content": "It is sunny in Paris, 18 C.",
                   "reasoning_content": "User asks the weather. Use the tool."} and reason == "stop"
    assert _joined(_stream(None, text, step))[:2] == (msg["reasoning_content"], msg["content"])


TRUNCATED_CALL = THINK + ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
                          '<|message|>{"city": "Pa')


@pytest.mark.parametrize("text,reasoning,content", [
    (TRUNCATED_CALL, "User asks the weather. Use the tool.",
     TRUNCATED_CALL.removeprefix(THINK)),                                  # not a call: its message as text
    (THINK + "<|start|>assistant<|channel|>weird<|message|>Hello.", "User asks the weather. Use the tool.",
     "Hello."),                                                                         # unknown channel: content
    ("analysisUser asks.assistantfinalSunny.", None, "analysisUser asks.assistantfinalSunny."),  # markers dropped
    (THINK + "<|start|>assistant<|channel|>commentary to=functions.get_wea", "User asks the weather. Use the tool.",
     None),                                                                             # a header cut short
    ("<|channel|>analysis<|message|>Still thinking", "Still thinking", None),           # cut short in thought
    (FINAL + "<|end|><|start|>user<|message|>Thanks!<|end|>", "User asks the weather. Use the tool.",
     "It is sunny in Paris, 18 C."),                                                    # another author: dropped
    ("<|channel|>final<|message|>A<|start|><|start|><|end|><|channel|>final<|message|>B", None, "A\nB"),
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_malformed_answers_are_content_never_an_exception(text, reasoning, content, step):
    mode = ToolMode("auto", TOOLS, parser="openai")
    msg, reason = message(text, "length", mode, "openai_gptoss")
    assert (msg["reasoning_content"], msg["content"], "tool_calls" in msg, reason) == \
        (reasoning, content, False, "length")
    thoughts, streamed, _, finish = _joined(_stream(mode, text, step, "length"))
    assert (thoughts or None, finish) == (reasoning, "length")
    if not text.startswith(TRUNCATED_CALL):     # a cut-short call was announced as it streamed (as hermes's is)
        assert (streamed or None) == content


def test_every_prefix_of_an_answer_reads_without_error_and_streams_as_it_reads():
    rng = random.Random(0)
    for text in (FINAL, ONE_CALL, TWO_CALLS, FIRST_IS_A_CALL):
        for cut in range(len(text) + 1):
            piece = text[:cut]
            whole = split("openai_gptoss", piece)
            step = rng.choice([1, 2, 5, 17])
            thoughts, content, _, _ = _joined(_stream(None, piece, step, "length"))
            assert (thoughts or None, content or None) == whole, piece


# --- the server's side: the chat job and the engine's detokenizer -------------------------------------------
MARKERS = ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|call|>", "<|constrain|>", "<|return|>"]


def byte_tokenizer(template: str, eos: str = "<|return|>"):
    """A byte-level tokenizer (any text round-trips) with harmony's markers as special tokens and `eos` its EOS
    (gpt-oss's is <|return|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    t = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False), decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=t)
    tok.add_special_tokens({"eos_token": eos, "additional_special_tokens": [m for m in MARKERS if m != eos]})
    tok.chat_template = template
    return tok


def handler(tok):
    """The server's Handler over an engine that only records what it is asked to prepare."""
    from tp_jax.server.handlers import Handler
    engine = types.SimpleNamespace(prepare=lambda ids, params, where, lora: (ids, params))
    return Handler(types.SimpleNamespace(engine=engine), tok, ["gpt-oss"], 4096, None)


def chat(**kw):
    from tp_jax.server.protocol import ChatCompletionRequest
    return ChatCompletionRequest(messages=[{"role": "user", "content": "Weather in Paris?"}], **kw)


@pytest.fixture(scope="module")
def harmony_tok():
    with open(TEMPLATE) as f:
        return byte_tokenizer(f.read())


def test_a_harmony_chat_job_keeps_the_markers_and_stops_at_call(harmony_tok):
    tok, h = harmony_tok, handler(harmony_tok)
    call, ret, eos = tok.convert_tokens_to_ids(["<|call|>", "<|return|>"]) + [tok.eos_token_id]
    assert ret == eos                                   # <|return|> ends every request already (stop_reason null)
    job = h.chat_job(chat(stop_token_ids=[7], skip_special_tokens=True))
    assert job.params.skip_special_tokens is False and job.params.stop_token_ids == (7, call)
    assert (job.tools, job.reasoning) == (None, "openai_gptoss")
    assert h.chat_job(chat(stop_token_ids=[call])).params.stop_token_ids == (call,)     # not twice
    with open(TEMPLATE) as f:                           # a harmony tokenizer whose EOS is another token: both added
        other = handler(byte_tokenizer(f.read(), eos="<|endoftext|>"))
    ends = tuple(other.tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"]))
    assert other.chat_job(chat()).params.stop_token_ids == other.harmony_stops == ends
    plain = handler(byte_tokenizer("{% for m in messages %}{{ m.content }}{% endfor %}"))   # another format
    assert not plain.harmony and plain.chat_job(chat()).params.skip_special_tokens is True
    assert plain.chat_job(chat()).params.stop_token_ids == ()


def test_a_harmony_prompt_takes_tools_without_description_and_the_reasoning_effort(harmony_tok):
    tok, h = harmony_tok, handler(harmony_tok)
    bare = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
    job = h.chat_job(chat(tools=[bare, WEATHER], reasoning_effort="high"))
    text = tok.decode(job.prompts[0], skip_special_tokens=False)
    assert "// \ntype ping = () => any;" in text and "// Current weather in a city\ntype get_weather" in text
    assert "Reasoning: high\n" in text and job.tools.parser == "openai"
    assert "Reasoning: medium\n" in tok.decode(h.chat_job(chat()).prompts[0])                  # the default
    low = h.chat_job(chat(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"}))
    assert "Reasoning: low\n" in tok.decode(low.prompts[0])                                  # the kwargs win


def _processed(tok, params, ids: list[int], stop_reason, stream: bool):
    """The CompletionOutput the engine's output processor makes of a sample that ended with `ids[-1]`."""
    from tp_jax.serving.engine import EngineOutput
    from tp_jax.serving.outputs import RequestMetrics
    from tp_jax.serving.processor import OutputProcessor, RequestState, _Sample
    proc = OutputProcessor(tok)
    proc.add(RequestState("r", None, [0], [_Sample(params)], RequestMetrics(0.0)), ["r"], stream)
    for k, t in enumerate(ids):
        end = k == len(ids) - 1
        outs, _ = proc.process([EngineOutput("r", [t], [0.0], None, "stop" if end else None,
                                             stop_reason if end else None)])
    return outs[0].outputs[0]


@pytest.mark.parametrize("stream", [False, True])
def test_a_sampled_harmony_answer_reads_from_its_token_ids(harmony_tok, stream):
    tok, h = harmony_tok, handler(harmony_tok)
    call = tok.convert_tokens_to_ids("<|call|>")
    job = h.chat_job(chat(tools=[WEATHER, TIME]))
    ids = tok.encode(TWO_CALLS + "<|call|>", add_special_tokens=False)
    out = _processed(tok, job.params, ids, call, stream)             # ended by the stop token id <|call|>
    assert out.text == TWO_CALLS and (out.finish_reason, out.stop_reason) == ("stop", call)
    msg, reason = message(out.text, out.finish_reason, job.tools, job.reasoning)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "get_time"] and reason == "tool_calls"
    assert (msg["reasoning_content"], msg["content"]) == ("User asks the weather. Use the tool.\nNow the time.",
                                                          "Checking both.")
    final = _processed(tok, job.params, tok.encode(FINAL + "<|return|>", add_special_tokens=False), None, stream)
    assert final.text == FINAL and final.stop_reason is None             # ended by the EOS <|return|>: left out
    msg, reason = message(final.text, final.finish_reason, job.tools, job.reasoning)
    assert (msg["content"], "tool_calls" in msg, reason) == ("It is sunny in Paris, 18 C.", False, "stop")
    skipped = _processed(tok, handler(byte_tokenizer("{{ 1 }}")).chat_job(chat()).params,
                         tok.encode(FINAL, add_special_tokens=False), None, stream)
    assert skipped.text == "analysisUser asks the weather. Use the tool.assistantfinalIt is sunny in Paris, 18 C."
