"""Reasoning parsers: a thinking model's thoughts moved out of `content` into `reasoning_content` (vLLM's names).

* `deepseek_r1` — the text before `</think>` is reasoning, with or without an opening `<think>`
  (DeepSeek-R1 and QwQ templates open the block in the prompt); no `</think>` yet: all reasoning.
* `qwen3` — only a `<think>...</think>` block the answer opens with is reasoning (Qwen3 writes
  its own `<think>`; with `enable_thinking=False` its template closes an empty block in the prompt).
* `openai_gptoss` — gpt-oss's harmony `analysis` channel (tp_jax/server/harmony.py); its content keeps the
  `to=functions.*` calls for the `openai` tool parser.

`ReasoningStream(name).feed(new_text, done) -> (reasoning, content)` splits a streamed answer, holding
back what may be the start of a tag; `split(name, text)` is the same reading of a whole answer, so the
streamed pieces always join up to the whole answer's fields.
"""

from __future__ import annotations

from tp_jax.server.harmony import HarmonyStream
from tp_jax.server.tool_parsers import partial_suffix

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")


class ReasoningStream:
    def __init__(self, name: str):
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
        self.name, self.buf, self.phase = name, "", "start"
        self.harmony = HarmonyStream() if name == "openai_gptoss" else None

    def feed(self, new: str, done: bool) -> tuple[str, str]:
        """(reasoning, content) newly certain after `new`; `done`: the answer ended (nothing held back)."""
        if self.harmony is not None:
            return self.harmony.feed(new, done)
        self.buf += new
        reasoning = content = ""
        if self.phase == "start":
            body = self.buf.lstrip()
            if body.startswith(START):
                self.phase, self.buf = "reasoning", body[len(START):]
            elif START.startswith(body) and not done:
                return "", ""                   # blank or a partial <think>: wait
            else:
                self.phase = "reasoning" if self.name == "deepseek_r1" else "content"
        if self.phase == "reasoning":
            at = self.buf.find(END)
            if at >= 0:
                reasoning, self.buf, self.phase = self.buf[:at], self.buf[at + len(END):], "content"
            else:
                keep = 0 if done else partial_suffix(self.buf, END)
                cut = len(self.buf) - keep
                reasoning, self.buf = self.buf[:cut], self.buf[cut:]
        if self.phase == "content":
            content, self.buf = self.buf, ""
        return reasoning, content


def split(name: str, text: str) -> tuple[str | None, str | None]:
    """A whole answer's (reasoning_content, content), None for an empty one."""
    reasoning, content = ReasoningStream(name).feed(text, True)
    return reasoning or None, content or None


def wanted(name: str | None, template_kwargs: dict | None, constrained: bool) -> str | None:
    """The parser a request is read with: none when the template was told not to think (`enable_thinking` /
    `thinking` false; gpt-oss's template has no such switch, its answers are harmony still) or when the answer
    is constrained (a grammar from its first token leaves no room for thoughts)."""
    kwargs = template_kwargs or {}
    told_not_to = kwargs.get("enable_thinking", True) is False or kwargs.get("thinking") is False
    if name is None or constrained or (told_not_to and name != "openai_gptoss"):
        return None
    return name
