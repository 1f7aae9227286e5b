"""OpenAI response bodies from the engine's RequestOutputs: choices, usage, logprobs, stream chunks.

* `Tokens` — token id -> the text the client sees for it (logprobs name tokens by text).
* `completion_logprobs`, `chat_logprobs` — OpenAI's two logprobs layouts for a run of tokens.
* `ChoiceDelta` — what one choice of a stream has not sent yet: new token ids and new text.
  While a choice with stop strings runs, its last `len(longest stop) - 1` characters are held
  back: they may be the start of a stop string that the next token completes, and the engine
  then cuts them from the text (text once sent cannot be taken back).
* `usage` — `{"prompt_tokens", "completion_tokens", "total_tokens"}`.
"""

from __future__ import annotations

import dataclasses
from importlib.metadata import PackageNotFoundError, version

from tp_jax.serving.outputs import CompletionOutput, Logprob, SampleLogprobs


class Tokens:
    """Decoded text of single tokens, cached (a server sees the same tokens again and again)."""

    def __init__(self, tokenizer):
        self.tokenizer, self._cache = tokenizer, {}

    def text(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"
            self._cache[token_id] = s
        return s


def tp_jax_version() -> str:
    """The installed package's version (`/version`, the answers' system_fingerprint)."""
    try:
        return version("tp-jax")
    except PackageNotFoundError:                   # a source tree that was never installed
        return "unknown"


FINGERPRINT = f"tp_jax-{tp_jax_version()}"          # every answer's system_fingerprint (vLLM's: "vllm-<version>-...")
TOKEN_IDS = Tokens(None)               # names every token "token_id:<id>" (vLLM's return_tokens_as_token_ids)


def _top(entries: dict[int, Logprob], n: int) -> list[tuple[int, float]]:
    """The n most likely (id, logprob) of a position's {id: Logprob} (the engine adds the chosen token to its
    top-N)."""
    return sorted(((t, e.logprob) for t, e in entries.items()), key=lambda kv: -kv[1])[:n]


def _finite(x: float) -> float:
    return max(x, -9999.0)            # -inf is not valid JSON; OpenAI clients expect a number


def completion_logprobs(token_ids: list[int], logprobs: SampleLogprobs, n: int, tokens: Tokens,
                        offset: int) -> dict:
    """Completions' layout: tokens, token_logprobs, top_logprobs (text -> logprob), text_offset."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, entries in zip(token_ids, logprobs):
        text = tokens.text(t)
        out["tokens"].append(text)
        out["token_logprobs"].append(_finite(entries[t].logprob))
        out["top_logprobs"].append({tokens.text(i): _finite(lp) for i, lp in _top(entries, n)})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(token_ids: list[int], logprobs: SampleLogprobs, n: int, tokens: Tokens) -> dict:
    """Chat's layout: content = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
    def entry(t: int, lp: float) -> dict:
        text = tokens.text(t)
        return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode())}
    content = [{**entry(t, entries[t].logprob), "top_logprobs": [entry(i, lp) for i, lp in _top(entries, n)]}
               for t, entries in zip(token_ids, logprobs)]
    return {"content": content, "refusal": None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclasses.dataclass
class Delta:
    token_ids: list[int]
    logprobs: SampleLogprobs | None
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    text_offset: int                  # characters of this choice sent before `text`
    first: bool = False               # the choice's first chunk


class ChoiceDelta:
    """The unsent part of one streaming choice, from its cumulative CompletionOutputs."""

    def __init__(self, stop: tuple[str, ...]):
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.tokens = self.chars = 0
        self.done = self.sent = False

    def update(self, c: CompletionOutput) -> Delta | None:
        """The delta since the last call, or None when there is nothing new to send."""
        if self.done:
            return None
        visible = c.text if c.finished() else c.text[:max(0, len(c.text) - self.holdback)]
        text = visible[self.chars:] if len(visible) > self.chars else ""
        new = c.token_ids[self.tokens:]
        if not new and not text and not c.finished():
            return None
        lps = None if c.logprobs is None else c.logprobs[self.tokens:len(c.token_ids)]
        delta = Delta(list(new), lps, text, c.finish_reason, c.stop_reason, self.chars, not self.sent)
        self.tokens, self.chars, self.done, self.sent = len(c.token_ids), self.chars + len(text), c.finished(), True
        return delta
