"""Tool calling on the chat endpoint: what a tool_choice constrains, the model's calls parsed, streamed.

* `ToolMode` — a request's tools and choice: `auto` (the model decides; its own format is read by
  the template's parser, tp_jax/server/tool_parsers.py), `required` (constrained to a JSON array of
  calls, vLLM's schema) or a named function (constrained to that function's `parameters` schema).
* `ToolStream` — one streaming choice: content deltas until a call starts, then `tool_calls`
  deltas as vLLM streams them: a call's first delta has `index`, `id`, `type` and `function.name`
  (arguments so far), later ones `function.arguments` pieces as they are sampled; a call's pieces
  join up to the whole answer's `arguments`.
* `with_tools_described` — for a template that renders no tools: the tools in a system message (the
  `<tool_call>` format, in Qwen2.5's words), earlier calls and results in the same format.
* `for_template` — a message for the chat template (a previous call's JSON `arguments` as a dict).
"""

from __future__ import annotations

import dataclasses
import json

from tp_jax.server.tool_parsers import (PARSERS, HermesParser, JsonCallReader, Llama3JsonParser, ToolCall,
                                        new_call_id, parse_call_array)

__all__ = ["PARSERS", "HermesParser", "Llama3JsonParser", "ToolCall", "ToolMode", "ToolStream", "for_template",
           "required_schema", "with_tools_described"]


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

    def reader(self):
        """A fresh parser of this mode's format (auto: the model's own)."""
        return PARSERS[self.parser](self.tools)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished answer."""
        if self.choice == "named":
            return None, [ToolCall(self.name, text)]
        if self.choice == "required":
            calls = parse_call_array(text)      # None: cut short (max_tokens), not a whole array
            return (text, []) if calls is None else (None, calls)
        return self.reader().parse(text)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(the chat message, its finish_reason: "tool_calls" when it made calls and ended by itself, but for a
        named tool_choice "stop", as vLLM and OpenAI answer one (vLLM's streams end a named call with
        "tool_calls", and so do ours: `ToolStream`))."""
        content, calls = self.parse(text)
        msg = {"role": "assistant", "content": content}
        if not calls:
            return {**msg, "content": text}, finish_reason
        msg["tool_calls"] = [c.openai() for c in calls]
        return msg, "tool_calls" if finish_reason == "stop" and self.choice != "named" else finish_reason


class ToolStream:
    """The unsent part of one streaming choice with tools: `delta(text, finish_reason)` -> the chunk's delta."""

    def __init__(self, mode: ToolMode):
        self.mode, self.text, self.sent = mode, "", 0
        self.start = 0 if mode.choice == "required" else None       # where the calls begin in the text
        self.parser = mode.reader() if mode.choice == "auto" else None
        self.array = JsonCallReader(array=True) if mode.choice == "required" else None
        self.announced: list[int] = []          # per call started: how much of its arguments was sent

    def delta(self, new_text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        self.text += new_text
        done = finish_reason is not None
        if self.mode.choice == "named":
            return self._named(new_text), ("tool_calls" if finish_reason == "stop" else finish_reason)
        out, content_end = {}, None
        if self.start is None:
            self.start = self.parser.calls_start(self.text)
            content_end = self.start if self.start is not None else \
                len(self.text) - (0 if done else self.parser.holdback(self.text))
        elif self.mode.choice == "auto":
            content_end = self.sent
        if content_end is not None and content_end > self.sent:
            out["content"], self.sent = self.text[self.sent:content_end], content_end
        if self.start is not None:
            calls = self._call_deltas(self._progress(done))
            if calls:
                out["tool_calls"] = calls
        if done:
            return self._finish(out, finish_reason)
        return out, None

    def _progress(self, done: bool) -> list[tuple[str | None, str]]:
        if self.array is not None:
            self.array.feed(self.text[len(self.array.text):])
            return self.array.calls()
        return self.parser.progress(self.text[self.start:], done)

    def _call_deltas(self, calls: list[tuple[str | None, str]]) -> list[dict]:
        out = []
        for i, (name, args) in enumerate(calls):
            if name is None:
                break                           # calls are announced in order, each once its name is known
            if i == len(self.announced):
                self.announced.append(len(args))
                out.append({"index": i, "id": new_call_id(), "type": "function",
                            "function": {"name": name, "arguments": args}})
            elif len(args) > self.announced[i]:
                out.append({"index": i, "function": {"arguments": args[self.announced[i]:]}})
                self.announced[i] = len(args)
        return out

    def _finish(self, out: dict, finish_reason: str) -> tuple[dict, str]:
        if self.announced:
            return out, "tool_calls" if finish_reason == "stop" else finish_reason
        rest, self.sent = self.text[self.sent:], len(self.text)     # no call after all: the text is the answer
        if rest:
            out["content"] = out.get("content", "") + rest
        return out, finish_reason

    def _named(self, new_text: str) -> dict:
        if not self.announced:
            self.announced.append(0)
            return {"tool_calls": [ToolCall(self.mode.name, new_text).openai(0)]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": new_text}}]} if new_text else {}


# --- tools for a template that renders none ------------------------------------------------------------
TOOLS_PROMPT = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                "with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each "
                "function call, return a json object with function name and arguments within <tool_call></tool_call> "
                "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
                "</tool_call>")


def with_tools_described(messages: list[dict], tools: list[dict]) -> list[dict]:
    """`messages` for a template that renders no tools: the tools described in the system message (added to
    one the conversation has, or a new one first), earlier calls as `<tool_call>` blocks in the assistant's
    content, tool results as `<tool_response>` blocks in a user turn (Qwen2.5's layout)."""
    block = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{block}".lstrip()
    else:
        out.insert(0, {"role": "system", "content": block})
    for m in out:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "\n".join(f"<tool_call>\n{json.dumps(_name_and_arguments(c), ensure_ascii=False)}\n</tool_call>"
                              for c in m.pop("tool_calls"))
            m["content"] = f"{m.get('content') or ''}\n{calls}".lstrip("\n")
        elif m.get("role") == "tool":
            m.update(role="user", content=f"<tool_response>\n{m.get('content') or ''}\n</tool_response>")
    return out


def _name_and_arguments(call: dict) -> dict:
    fn = call.get("function") or call
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return {"name": fn.get("name"), "arguments": args}


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
