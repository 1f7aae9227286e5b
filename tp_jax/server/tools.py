"""Tool calling on the chat endpoint: what a tool_choice constrains, the model's calls parsed, streamed.

* `ToolMode` — a request's tools and choice: `auto` (the model decides; its own format is parsed
  with a `--tool-call-parser`), `required` (constrained to a JSON array of calls, vLLM's schema)
  or a named function (constrained to that function's `parameters` schema).
* `PARSERS` — per family: `hermes` (`<tool_call>{"name", "arguments"}</tool_call>`, Qwen2.5 / Qwen3,
  Hermes) and `llama3_json` (`{"name", "parameters"}` objects, `;`-separated, Llama 3.x).
* `ToolStream` — one streaming choice: content deltas until a call starts, then `tool_calls`
  deltas as OpenAI streams them (named calls stream their arguments as they are sampled).
* `for_template` — a message for the chat template (a previous call's JSON `arguments` as a dict).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str                              # JSON text

    def openai(self, index: int | None = None) -> dict:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class HermesParser:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Qwen2.5, Qwen3, Hermes 2/3)."""
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.start not in text:
            return text, []
        calls = []
        for body in self._block.findall(text):
            try:
                call = _call(json.loads(body), "arguments")
            except ValueError:
                call = None
            if call is None:
                return text, []                  # not a well-formed call: the text is the answer
            calls.append(call)
        content = text[:text.index(self.start)].strip()
        return content or None, calls


class Llama3JsonParser:
    """Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}`, several joined by `;` (an optional
    `<|python_tag|>` first)."""
    start = "{"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls, dec, i = [], json.JSONDecoder(), 0
        while i < len(body):
            try:
                obj, i = dec.raw_decode(body, i)
            except ValueError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return None, calls


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def required_schema(tools, parallel: bool = True) -> dict:
    """vLLM's schema for tool_choice "required": a non-empty array of {"name", "parameters"} calls
    (one call when `parallel` is False: OpenAI's parallel_tool_calls=false)."""
    most = {} if parallel else {"maxItems": 1}
    return {"type": "array", "minItems": 1, **most, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": [t.function.name]},
                        "parameters": t.function.parameters or {"type": "object"}},
         "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}}


@dataclasses.dataclass
class ToolMode:
    choice: str                                 # "auto" | "required" | "named"
    tools: list
    name: str | None = None                     # the named function
    parser: str | None = None                   # auto: a PARSERS key
    parallel: bool = True                       # False: at most one call (parallel_tool_calls=false)

    def constraint(self):
        """The StructuredOutputsParams that required / named calls are sampled under (auto: None)."""
        from tp_jax.serving.structured import StructuredOutputsParams
        if self.choice == "required":
            return StructuredOutputsParams(json=required_schema(self.tools, self.parallel))
        if self.choice == "named":
            fn = next(t.function for t in self.tools if t.function.name == self.name)
            return StructuredOutputsParams(json=fn.parameters or {"type": "object"})
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished answer."""
        if self.choice == "named":
            return None, [ToolCall(self.name, text)]
        if self.choice == "required":
            try:
                calls = [_call(c, "parameters") for c in json.loads(text)]
            except (ValueError, TypeError):
                calls = [None]                  # cut short (max_tokens): not a whole array
            return (text, []) if None in calls else (None, calls)
        return PARSERS[self.parser]().parse(text)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(the chat message, its finish_reason: "tool_calls" when it made calls and ended by itself)."""
        content, calls = self.parse(text)
        msg = {"role": "assistant", "content": content}
        if not calls:
            return {**msg, "content": text}, finish_reason
        msg["tool_calls"] = [c.openai() for c in calls]
        return msg, "tool_calls" if finish_reason == "stop" else finish_reason


class ToolStream:
    """The unsent part of one streaming choice with tools: `delta(text, finished)` -> the chunk's delta."""

    def __init__(self, mode: ToolMode):
        self.mode, self.text, self.sent, self.calls_started = mode, "", 0, False
        self.marker = None if mode.choice != "auto" else PARSERS[mode.parser].start

    def delta(self, new_text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        self.text += new_text
        done = finish_reason is not None
        if self.mode.choice == "named":
            out = {}
            if not self.calls_started:
                self.calls_started = True
                out = {"tool_calls": [{**ToolCall(self.mode.name, "").openai(0)}]}
                out["tool_calls"][0]["function"]["arguments"] = new_text
            elif new_text:
                out = {"tool_calls": [{"index": 0, "function": {"arguments": new_text}}]}
            return out, ("tool_calls" if finish_reason == "stop" else finish_reason)
        if not done:
            return self._content_so_far(), None
        if self.calls_started or self.mode.choice == "required":
            msg, reason = self.mode.message(self.text, finish_reason)
            if "tool_calls" in msg:
                return {"tool_calls": [{"index": i, **c} for i, c in enumerate(msg["tool_calls"])]}, reason
            rest, self.sent = self.text[self.sent:], len(self.text)       # not calls after all: the text
            return ({"content": rest} if rest else {}), finish_reason
        rest, self.sent = self.text[self.sent:], len(self.text)
        return ({"content": rest} if rest else {}), finish_reason

    def _content_so_far(self) -> dict:
        """Auto: content up to a call's start (holding back what may begin one); required: nothing yet."""
        if self.mode.choice == "required" or self.calls_started:
            return {}
        text = self.text
        at = _marker_at(text, self.marker, self.mode.parser)
        if at is not None:
            self.calls_started = True
            end = at
        else:
            end = len(text) - _partial_suffix(text, self.marker)
        if self.mode.parser == "llama3_json" and "<|python_tag|>".startswith(text[:end].strip()):
            end = self.sent                     # whitespace or a partial <|python_tag|>: a call may still start
        chunk, self.sent = text[self.sent:end], max(self.sent, end)
        return {"content": chunk} if chunk else {}


def _marker_at(text: str, marker: str, parser: str) -> int | None:
    if parser == "llama3_json":                 # a call is the whole answer: only at the start
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith(("{", "<|python_tag|>")) else None
    i = text.find(marker)
    return None if i < 0 else i


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def for_template(message: dict) -> dict:
    """A message for the chat template: an assistant's earlier calls with `arguments` as dicts (what
    Hugging Face templates index and `tojson`), OpenAI's `function` wrapper kept."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for c in calls:
        c = dict(c)
        fn = dict(c.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass
        c["function"] = fn
        out.append(c)
    return {**message, "tool_calls": out}
