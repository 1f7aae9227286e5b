"""Reading a model's tool calls out of its text, whole or as it streams, one parser per format family.

* `JsonCallReader` — JSON calls `{"name": ..., "arguments" | "parameters": ...}` read as the text
  grows: in a JSON array (vLLM's tool_choice "required", Mistral) or one object after another
  (hermes bodies, Llama's `;`-joined calls). It knows a call's name once its string closes and the
  raw text of its arguments as far as it is certain, so streamed argument deltas join up to exactly
  the arguments of the whole answer.
* `PARSERS` — `hermes` (`<tool_call>{"name", "arguments"}</tool_call>`: Qwen2.5, Qwen3, Hermes),
  `llama3_json` (`{"name", "parameters"}` objects, `;`-separated, an optional `<|python_tag|>`:
  Llama 3.x), `mistral` (`[TOOL_CALLS] [{"name", "arguments"}, ...]`: Mistral 7B v0.3 and
  kin; the marker is a special token, so the array alone at the start counts too) and
  `qwen3_coder` (`<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`,
  values typed by the tool's schema: Qwen3-Coder), `openai` (gpt-oss's harmony `to=functions.NAME` messages,
  read by tp_jax/server/harmony.py from what its reasoning parser `openai_gptoss` passes on).

Each parser: `parse(text) -> (content, calls)` for a whole answer; `calls_start(text)` (where the
calls begin, or None) and `holdback(text)` (trailing characters that may begin a call) for content
streamed before them; `progress(region, done) -> [(name, arguments so far)]` over the text from the
calls' start, fed a growing region (append-only use).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from tp_jax.server.harmony import HarmonyCalls


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str                              # JSON text

    def openai(self, index: int | None = None) -> dict:
        call = {"id": new_call_id(), "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    import uuid
    return f"call_{uuid.uuid4().hex[:24]}"


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# --- JSON calls, read as they grow ----------------------------------------------------------------------
ARGS_KEYS = ("arguments", "parameters")


@dataclasses.dataclass
class _Call:
    name: str | None = None
    start: int | None = None                    # the arguments value's first character
    end: int | None = None                      # one past its last, once it has ended


class JsonCallReader:
    """Tool-call objects in JSON text fed piece by piece (`feed`); `calls()` -> [(name, arguments so far)]."""

    def __init__(self, array: bool):
        self.base = 1 if array else 0           # nesting depth of the container holding the calls
        self.text, self.stack, self._calls = "", [], []
        self.in_str = self.esc = False
        self.str_start, self.key, self.after_colon = 0, None, False

    def feed(self, new: str) -> JsonCallReader:
        for i, c in enumerate(new, start=len(self.text)):
            self.text += c
            self._char(i, c)
        return self

    def calls(self) -> list[tuple[str | None, str]]:
        return [(c.name, self._args(c)) for c in self._calls]

    def _args(self, c: _Call) -> str:
        if c.start is None:
            return ""
        head = self.text[c.start]
        if head == '"':                         # arguments sent as a JSON string: its value, once whole
            return json.loads(self.text[c.start:c.end]) if c.end is not None else ""
        if c.end is not None:
            return self.text[c.start:c.end]
        return self.text[c.start:] if head in "{[" else ""      # a number or literal: once it has ended

    def _char(self, i: int, c: str) -> None:
        depth, call_depth = len(self.stack), self.base + 1
        call = self._calls[-1] if self._calls else None
        in_args = depth == call_depth and self.after_colon and self.key in ARGS_KEYS and call and call.start is None
        if self.in_str:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
                if depth == call_depth:
                    self._string_closed(i, call)
            return
        if c == '"':
            self.in_str, self.str_start = True, i
            if in_args:
                call.start = i
        elif c in "{[":
            if depth == self.base and c == "{":
                self._calls.append(_Call())
                self.key, self.after_colon = None, False
            elif in_args:
                call.start = i
            self.stack.append(c)
        elif c in "}]":
            if self.stack:
                self.stack.pop()
            if len(self.stack) == call_depth and self.key in ARGS_KEYS and call.start is not None and call.end is None:
                call.end = i + 1                # the arguments object / array closed
            elif len(self.stack) == self.base and call is not None:
                self._end_primitive(i, call)
        elif depth == call_depth and c == ",":
            self._end_primitive(i, call)
            self.key, self.after_colon = None, False
        elif depth == call_depth and c == ":":
            self.after_colon = True
        elif in_args and not c.isspace():
            call.start = i                      # a number or a literal

    def _string_closed(self, i: int, call: _Call) -> None:
        try:
            s = json.loads(self.text[self.str_start:i + 1])
        except ValueError:
            return
        if not self.after_colon:
            self.key = s
        elif self.key == "name" and call.name is None and isinstance(s, str):
            call.name = s
        elif self.key in ARGS_KEYS and call.start == self.str_start:
            call.end = i + 1

    def _end_primitive(self, i: int, call: _Call | None) -> None:
        if call is not None and call.start is not None and call.end is None:
            call.end = len(self.text[:i].rstrip())


def _whole_calls(objs: list, reader: JsonCallReader) -> list[ToolCall] | None:
    """The calls of parsed JSON objects (None if one is not a call), arguments as the reader saw them."""
    raw = reader.calls()
    if len(raw) != len(objs):
        return None
    out = []
    for obj, (_, args) in zip(objs, raw):
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        if not any(k in obj for k in ARGS_KEYS):
            args = "{}"
        out.append(ToolCall(obj["name"], args))
    return out


def parse_call_array(text: str) -> list[ToolCall] | None:
    """A whole JSON array of calls (tool_choice "required", Mistral), None if it is not one."""
    try:
        objs = json.loads(text)
    except ValueError:
        return None
    if not isinstance(objs, list) or not objs:
        return None
    return _whole_calls(objs, JsonCallReader(array=True).feed(text))


# --- the formats ------------------------------------------------------------------------------------------
class HermesParser:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks (Qwen2.5, Qwen3, Hermes 2/3)."""
    start, end = "<tool_call>", "</tool_call>"

    def __init__(self, tools=()):
        self.reader, self.fed = JsonCallReader(array=False), 0

    def calls_start(self, text: str) -> int | None:
        i = text.find(self.start)
        return None if i < 0 else i

    def holdback(self, text: str) -> int:
        return partial_suffix(text, self.start)

    def bodies(self, region: str, done: bool) -> list[str]:
        """The text inside each block (the last one may be open: up to a possible closing tag's start)."""
        out = []
        for part in region.split(self.start)[1:]:
            body, closed, _ = part.partition(self.end)
            if not closed and not done:
                body = body[:len(body) - partial_suffix(body, self.end)]
            out.append(body)
        return out

    def progress(self, region: str, done: bool) -> list[tuple[str | None, str]]:
        joined = "\n".join(self.bodies(region, done))
        self.reader.feed(joined[self.fed:])
        self.fed = len(joined)
        return self.reader.calls()

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = self.calls_start(text)
        if at is None:
            return text, []
        bodies = self.bodies(text[at:], True)
        try:
            objs = [json.loads(b) for b in bodies]
        except ValueError:
            return text, []                     # not a well-formed call: the text is the answer
        calls = _whole_calls(objs, JsonCallReader(array=False).feed("\n".join(bodies)))
        if not calls:
            return text, []
        return text[:at].strip() or None, calls


class Llama3JsonParser:
    """Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}`, several joined by `;`, the whole answer (an
    optional `<|python_tag|>` first)."""
    tag = "<|python_tag|>"

    def __init__(self, tools=()):
        self.reader, self.fed = JsonCallReader(array=False), 0

    def calls_start(self, text: str) -> int | None:
        body = text.lstrip()
        return len(text) - len(body) if body.startswith(("{", self.tag)) else None

    def holdback(self, text: str) -> int:
        body = text.lstrip()
        return len(text) if self.tag.startswith(body) else 0   # blank or a partial tag: a call may still start

    def _body(self, region: str) -> str:
        return region.removeprefix(self.tag)

    def progress(self, region: str, done: bool) -> list[tuple[str | None, str]]:
        body = self._body(region)
        if len(body) < self.fed:                # the tag still arriving
            return []
        self.reader.feed(body[self.fed:])
        self.fed = len(body)
        return self.reader.calls()

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = self.calls_start(text)
        if at is None:
            return text, []
        body = self._body(text[at:]).strip()
        objs, dec, i = [], json.JSONDecoder(), 0
        while i < len(body):
            try:
                obj, i = dec.raw_decode(body, i)
            except ValueError:
                return text, []
            objs.append(obj)
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        calls = _whole_calls(objs, JsonCallReader(array=False).feed(body))
        return (None, calls) if calls else (text, [])


class MistralParser:
    """`[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3, Mixtral, Nemo); the marker is
    a special token the detokenizer drops, so an answer that opens with a JSON array of calls counts too."""
    marker = "[TOOL_CALLS]"

    def __init__(self, tools=()):
        self.reader, self.fed = JsonCallReader(array=True), 0

    def calls_start(self, text: str) -> int | None:
        i = text.find(self.marker)
        if i >= 0:
            return i
        body = text.lstrip()
        return len(text) - len(body) if body.startswith("[") and body[1:].lstrip()[:1] == "{" else None

    def holdback(self, text: str) -> int:
        body = text.lstrip()
        if self.marker.startswith(body) or not body[1:].strip():
            return len(text)                    # blank, "[" or a partial marker: an array of calls may be starting
        return partial_suffix(text, self.marker)

    def _body(self, region: str) -> str:
        return region.removeprefix(self.marker)

    def progress(self, region: str, done: bool) -> list[tuple[str | None, str]]:
        body = self._body(region)
        self.reader.feed(body[self.fed:])
        self.fed = len(body)
        return self.reader.calls()

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = self.calls_start(text)
        if at is None:
            return text, []
        calls = parse_call_array(self._body(text[at:]).strip())
        return (text[:at].strip() or None, calls) if calls else (text, [])


class Qwen3CoderParser:
    """Qwen3-Coder's XML calls: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n
    </function>\\n</tool_call>`; each value typed by the tool's JSON schema (strings stay strings)."""
    start = "<tool_call>"
    _function = re.compile(r"<function=([^>\n]+)>(.*?)(</function>|\Z)", re.S)
    _parameter = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)

    def __init__(self, tools=()):
        self.types = {t.function.name: (t.function.parameters or {}).get("properties", {}) for t in tools}

    def calls_start(self, text: str) -> int | None:
        i = text.find(self.start)
        if i < 0:
            i = text.find("<function=")
        return None if i < 0 else i

    def holdback(self, text: str) -> int:
        return max(partial_suffix(text, self.start), partial_suffix(text, "<function="))

    def progress(self, region: str, done: bool) -> list[tuple[str | None, str]]:
        out = []
        for m in self._function.finditer(region):
            name, body, closed = m.group(1), m.group(2), m.group(3)
            props = self.types.get(name, {})
            pieces = [f"{_json(k)}: {_json(self._value(v, props.get(k)))}" for k, v in self._parameter.findall(body)]
            args = "{" + ", ".join(pieces) + ("}" if closed or done else "")
            out.append((name, args))
        return out

    @staticmethod
    def _value(raw: str, schema: dict | None) -> Any:
        text = raw.removeprefix("\n").removesuffix("\n")
        kind = (schema or {}).get("type")
        if kind == "string":
            return text
        try:
            return json.loads(text)
        except ValueError:
            return text

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = self.calls_start(text)
        if at is None:
            return text, []
        found = [m for m in self._function.finditer(text[at:]) if m.group(3)]
        if not found:
            return text, []
        calls = [ToolCall(n, a) for n, a in self.progress(text[at:], True)]
        return text[:at].strip() or None, calls


class OpenAIParser(HarmonyCalls):
    """gpt-oss's calls (harmony): `<|start|>assistant to=functions.NAME<|message|>{...}<|call|>` messages."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = self.parse_calls(text)
        return content, [ToolCall(name, args) for name, args in calls]


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
           "qwen3_coder": Qwen3CoderParser, "openai": OpenAIParser}
