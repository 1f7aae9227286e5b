"""Which tool-call parser and reasoning parser a model's chat template calls for, and why.

    fmt = choose(tokenizer)                      # or choose(tokenizer, "llama3_json", "deepseek_r1") from the flags
    log.info(fmt.describe())                     # the start-up line: each choice and its reason

Tools: the template's own call format, read from the markers it writes — gpt-oss's harmony messages
`<|channel|>...<|message|>` (`openai`), Qwen3-Coder's `<function=...><parameter=...>` (`qwen3_coder`),
`<tool_call>` (`hermes`: Qwen2.5, Qwen3, Hermes), `[TOOL_CALLS]` (`mistral`), Llama 3.x's `<|python_tag|>` /
`"parameters"` under `ipython` (`llama3_json`).
A template that renders no tools at all (SmolLM2's) gets `hermes`, and for tool_choice "auto" the server
describes the tools in a system message itself (`inject_tools`), in Qwen2.5's words, so the model sees them.

Reasoning: `openai_gptoss` for harmony (its `analysis` channel), `deepseek_r1` when the generation prompt
opens a `<think>` block (DeepSeek-R1 distills, QwQ, Qwen3 thinking-2507), `qwen3` when the template knows
`</think>` but leaves the opening to the model (Qwen3's `enable_thinking` switch), off otherwise.
"""

from __future__ import annotations

import dataclasses

from tp_jax.server.reasoning import END, REASONING_PARSERS, START
from tp_jax.server.tool_parsers import PARSERS

HARMONY = ("<|channel|>", "<|message|>")        # gpt-oss's chat format: tp_jax/server/harmony.py

_PROBE_USER = "probe-user-4d1c"
_PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_fn_4d1c", "description": "probe",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    tool_parser: str                            # tool_parsers.PARSERS key, for tool_choice "auto"
    tool_reason: str
    inject_tools: bool                          # the template renders no tools: the server describes them
    reasoning_parser: str | None                # reasoning.REASONING_PARSERS key, or None (off)
    reasoning_reason: str
    warnings: tuple[str, ...] = ()

    def describe(self) -> str:
        reasoning = self.reasoning_parser or "off"
        return (f"tool calls: {self.tool_parser} ({self.tool_reason}); reasoning parser: {reasoning} "
                f"({self.reasoning_reason})")


def choose(tokenizer, tool_parser: str | None = None, reasoning_parser: str | None = None) -> ChatFormat:
    """The parsers for `tokenizer`'s chat template; a flag's choice wins (its reason: the flag)."""
    if tool_parser is not None and tool_parser not in PARSERS:
        raise ValueError(f"--tool-call-parser {tool_parser!r} is unknown; choose one of {', '.join(sorted(PARSERS))}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {reasoning_parser!r} is unknown; choose one of "
                         f"{', '.join(REASONING_PARSERS)}")
    source = _template(tokenizer)
    if source is None:
        return ChatFormat(tool_parser or "hermes", "no chat template" if tool_parser is None else "--tool-call-parser",
                          False, reasoning_parser, "no chat template" if reasoning_parser is None else
                          "--reasoning-parser")
    renders = _renders_tools(tokenizer)
    if tool_parser is None:
        tool_parser, tool_reason = tool_format(source, renders)
    else:
        tool_reason = "--tool-call-parser"
    inject = not renders and tool_parser == "hermes"
    if inject:
        tool_reason += "; the template renders no tools, so the server describes them in a system message"
    warnings = []
    if reasoning_parser is None:
        reasoning_parser, reasoning_reason = reasoning_format(source, _generation_prompt(tokenizer))
    else:
        reasoning_reason = "--reasoning-parser"
        if reasoning_parser == "openai_gptoss" and not _harmony(source):
            warnings.append(f"--reasoning-parser {reasoning_parser}: this model's chat template writes no harmony "
                            f"messages ({' / '.join(HARMONY)}), so answers are likely read as plain content")
        elif reasoning_parser != "openai_gptoss" and END not in source:
            warnings.append(f"--reasoning-parser {reasoning_parser}: this model's chat template never mentions "
                            f"{END}, so it is likely not a thinking model; answers without {END} are read as "
                            + ("all reasoning" if reasoning_parser == "deepseek_r1" else "plain content"))
    return ChatFormat(tool_parser, tool_reason, inject, reasoning_parser, reasoning_reason, tuple(warnings))


def tool_format(source: str, renders_tools: bool) -> tuple[str, str]:
    """(parser, reason) from the markers a template's source writes."""
    if _harmony(source):
        return "openai", "the chat template writes harmony messages, calls to=functions.NAME (gpt-oss)"
    if "<function=" in source and "<parameter=" in source:
        return "qwen3_coder", "the chat template writes <function=...><parameter=...> calls (Qwen3-Coder)"
    if "<tool_call>" in source:
        return "hermes", "the chat template writes <tool_call> JSON calls (Qwen2.5 / Qwen3 / Hermes)"
    if "[TOOL_CALLS]" in source:
        return "mistral", "the chat template writes [TOOL_CALLS] JSON arrays (Mistral)"
    if "<|python_tag|>" in source or ('"parameters"' in source and "ipython" in source):
        return "llama3_json", "the chat template writes {\"name\", \"parameters\"} JSON calls (Llama 3.x)"
    if renders_tools:
        return "hermes", ("the chat template renders tools in a format none of the parsers reads; hermes assumed "
                          "(--tool-call-parser chooses another)")
    return "hermes", "the chat template has no tool-call format"


def reasoning_format(source: str, generation_prompt: str) -> tuple[str | None, str]:
    """(parser or None, reason) from a template's source and the prompt's end it renders for the answer."""
    if _harmony(source):
        return "openai_gptoss", "the chat template writes harmony messages; thoughts are the analysis channel"
    opened = generation_prompt.rfind(START)
    if opened >= 0 and END not in generation_prompt[opened:]:
        return "deepseek_r1", f"the chat template opens {START} in the prompt, so the answer's thoughts end at {END}"
    if END in source and "enable_thinking" in source:
        return "qwen3", f"the chat template has Qwen3's enable_thinking switch; the model opens its own {START}"
    if END in source:
        return "qwen3", f"the chat template strips {START}...{END} blocks; the model opens its own"
    return None, f"the chat template has no {START} blocks"


def _harmony(source: str) -> bool:
    return all(marker in source for marker in HARMONY)


def _template(tokenizer) -> str | None:
    source = getattr(tokenizer, "chat_template", None)
    if isinstance(source, dict):                # named templates: the default one
        source = source.get("default") or next(iter(source.values()), None)
    return source if isinstance(source, str) else None


def _render(tokenizer, **kw) -> str:
    try:
        return tokenizer.apply_chat_template([{"role": "user", "content": _PROBE_USER}], tokenize=False,
                                             add_generation_prompt=True, **kw)
    except Exception:                           # the template refuses the probe: read it as rendering nothing
        return ""


def _renders_tools(tokenizer) -> bool:
    return _PROBE_TOOL["function"]["name"] in _render(tokenizer, tools=[_PROBE_TOOL])


def _generation_prompt(tokenizer) -> str:
    text = _render(tokenizer)
    return text[text.rfind(_PROBE_USER) + len(_PROBE_USER):] if _PROBE_USER in text else ""
