"""gpt-oss's chat format, harmony: an answer read as its messages, thoughts, text and tool calls apart.

The model answers in messages `<|start|>HEADER<|message|>BODY<|end|>`; the prompt ends with `<|start|>assistant`,
so the first message's header opens the text. A header names the channel and, for a tool call, the recipient —
in the channel part or in the role part:

    <|channel|>analysis<|message|>THOUGHTS<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}<|call|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Rome"}<|call|>

* `read(text, done)` — the messages (`Message`), the last one perhaps still open; `done` False holds back
  a body's trailing characters that may begin a marker. Text that is no harmony at all is one message of
  text; a header cut short is dropped; nothing raises.
* `HarmonyStream` — the reasoning parser `openai_gptoss` (reasoning.py): `feed(new, done) -> (reasoning,
  content)`, the `analysis` bodies as reasoning (several joined by a newline, as vLLM joins them), `final`,
  preamble (`commentary` to no one) and unknown channels as content, and each `to=functions.NAME` message
  passed on to the tool parser as the model wrote it (`<|start|>assistant...<|message|>ARGS<|call|>`).
  Messages addressed to another recipient (built-in tools, a tool's reply) are dropped.
* `HarmonyCalls` — the tool parser `openai` (tool_parsers.py) over that content: the calls start at the
  first `<|start|>`; each call's arguments are its body as sampled, so streamed pieces join up to them.

Harmony's markers are special tokens: the text must be decoded with them kept (skip_special_tokens=False).
The end of the answer (`<|return|>`, `<|call|>`) is a stop token left out of the text, so the last message
may end with the text.
"""

from __future__ import annotations

import dataclasses
import json
import re

START, MESSAGE, CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
CLOSERS = (END, CALL, RETURN)                   # end a message
OPENERS = (START, CHANNEL)                      # begin the next one (a body cut off without its end)
MARKERS = CLOSERS + OPENERS
HEADER_BREAKS = CLOSERS + (START,)              # cannot be inside a header (its <|channel|> can)
HEADER_HEADS = ("<|", " to=")                   # how the first message's header (no <|start|>) may begin
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"([^\s<]+)")


@dataclasses.dataclass
class Message:
    header: str | None                          # None: text outside any header (not harmony)
    body: str
    closed: bool

    @property
    def role(self) -> str:
        return _role(self.header or "") or "assistant"

    @property
    def recipient(self) -> str | None:
        m = _RECIPIENT.search(self.header or "")
        return m.group(1) if m else None

    @property
    def channel(self) -> str | None:
        m = _CHANNEL.search(self.header or "")
        return m.group(1) if m else None

    @property
    def kind(self) -> str | None:
        """"call", "reasoning", "content", or None (dropped: another author, another recipient)."""
        if self.role != "assistant":
            return None
        recipient = self.recipient
        if recipient is not None and recipient.startswith("functions."):
            return "call" if recipient != "functions." else None
        if self.channel == "analysis":
            return "reasoning"
        return "content" if recipient is None else None

    @property
    def name(self) -> str:
        return self.recipient.removeprefix("functions.")


def read(text: str, done: bool) -> list[Message]:
    """The messages of `text`, an answer so far (`done`: the whole answer)."""
    out, pos = [], 0
    while pos < len(text):
        rest = text[pos:]
        if rest.startswith(START):
            pos, rest, header_next = pos + len(START), rest[len(START):], True
        else:
            header_next = rest.startswith(HEADER_HEADS)
            if not done and not header_next and any(h.startswith(rest) for h in HEADER_HEADS + (START,)):
                break                           # a marker or a header may be starting: wait
        if not header_next:                     # plain text: no harmony, or text between messages
            body, end, closer = _body(rest, done)
            out.append(Message(None, body, closer is not None))
            pos += end
            continue
        m = rest.find(MESSAGE)
        cut = _first(rest, HEADER_BREAKS)
        if cut is not None and (m < 0 or cut[0] < m):   # a marker before the header ends: drop the header
            pos += cut[0] + (len(cut[1]) if cut[1] in CLOSERS else 0)
            continue
        if m < 0:
            break                               # the header is still arriving (or was cut short: dropped)
        body, end, closer = _body(rest[m + len(MESSAGE):], done)
        out.append(Message(rest[:m], body, closer is not None))
        pos += m + len(MESSAGE) + end
    return out


def _role(header: str) -> str:
    """The author a header names ("" for the first message's, which the prompt's `<|start|>assistant` named)."""
    return header.partition(CHANNEL)[0].partition(" to=")[0].strip()


def _first(text: str, markers) -> tuple[int, str] | None:
    hits = [(i, mk) for mk in markers if (i := text.find(mk)) >= 0]
    return min(hits) if hits else None


def _body(text: str, done: bool) -> tuple[str, int, str | None]:
    """(body, characters used, the marker that ended it or None): a closer is used up, an opener is not."""
    cut = _first(text, MARKERS)
    if cut is not None:
        i, marker = cut
        return text[:i], i + (len(marker) if marker in CLOSERS else 0), marker
    keep = 0 if done else max(_partial(text, mk) for mk in MARKERS)
    return text[:len(text) - keep], len(text) - keep, None


def _partial(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)


def cook(messages: list[Message]) -> tuple[str, str]:
    """(reasoning, content) of an answer's messages; calls stay in the content as harmony for `HarmonyCalls`."""
    thoughts, content, after_text = [], "", False
    for msg in messages:
        kind = msg.kind
        if kind == "reasoning":
            thoughts.append(msg.body)
        elif kind == "content":
            content += ("\n" if after_text else "") + msg.body
            after_text = True
        elif kind == "call":
            header = msg.header if _role(msg.header) else "assistant" + msg.header
            content += f"{START}{header}{MESSAGE}{msg.body}" + (CALL if msg.closed else "")
            after_text = False
    return "\n".join(thoughts), content


class HarmonyStream:
    """The reasoning parser `openai_gptoss`, fed the answer piece by piece: `feed(new, done) -> (reasoning,
    content)` newly certain. Each feed reads the answer so far again; what it yields only grows."""

    def __init__(self):
        self.text, self.sent = "", (0, 0)

    def feed(self, new: str, done: bool) -> tuple[str, str]:
        self.text += new
        reasoning, content = cook(read(self.text, done))
        (r, c), self.sent = self.sent, (len(reasoning), len(content))
        return reasoning[r:], content[c:]


class HarmonyCalls:
    """The tool parser `openai` over `HarmonyStream`'s content: text, then calls from the first `<|start|>`."""

    def __init__(self, tools=()):
        pass

    def calls_start(self, text: str) -> int | None:
        i = text.find(START)
        return None if i < 0 else i

    def holdback(self, text: str) -> int:
        return _partial(text, START)

    def progress(self, region: str, done: bool) -> list[tuple[str | None, str]]:
        return [(m.name, m.body) for m in read(region, done) if m.kind == "call"]

    def parse_calls(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        """(content, [(name, arguments)]) of a whole answer; a call whose arguments are no JSON (cut short):
        no calls, the text is the answer."""
        at = self.calls_start(text)
        if at is None:
            return text, []
        calls = self.progress(text[at:], True)
        if not calls or not all(_is_json(args) for _, args in calls):
            return text, []
        return text[:at] or None, calls


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
