"""A chat choice's answer in OpenAI's shape: reasoning first (reasoning.py), then tool calls (tools.py) or content.

    msg, finish = message(text, finish_reason, tools, "deepseek_r1")     # the whole answer's message
    s = ChoiceStream(tools, "deepseek_r1"); delta, finish = s.delta(new_text, finish_reason)   # streamed

`reasoning_content` is present when the request is read with a reasoning parser (None if the answer had no
thoughts); the tool calls are read from the content after the thoughts.
"""

from __future__ import annotations

from tp_jax.server.reasoning import ReasoningStream, split as split_reasoning
from tp_jax.server.tools import ToolMode, ToolStream


def message(text: str, finish_reason: str | None, tools: ToolMode | None,
            reasoning: str | None) -> tuple[dict, str | None]:
    thoughts, content = (None, text) if reasoning is None else split_reasoning(reasoning, text)
    if tools is None:
        msg = {"role": "assistant", "content": content}
    else:
        msg, finish_reason = tools.message(content or "", finish_reason)
        if content is None:                     # all thoughts: no content, no calls
            msg["content"] = None
    if reasoning is not None:
        msg["reasoning_content"] = thoughts
    return msg, finish_reason


class ChoiceStream:
    """One streaming chat choice with tools and / or a reasoning parser: `delta(new_text, finish_reason)`."""

    def __init__(self, tools: ToolMode | None, reasoning: str | None):
        self.tools = None if tools is None else ToolStream(tools)
        self.reasoning = None if reasoning is None else ReasoningStream(reasoning)

    def delta(self, new_text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        thoughts, content = ("", new_text) if self.reasoning is None else \
            self.reasoning.feed(new_text, finish_reason is not None)
        out = {"reasoning_content": thoughts} if thoughts else {}
        if self.tools is not None:
            d, finish_reason = self.tools.delta(content, finish_reason)
            out.update(d)
        elif content:
            out["content"] = content
        return out, finish_reason
