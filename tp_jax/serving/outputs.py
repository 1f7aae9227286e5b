"""vLLM-shaped results: RequestOutput with one CompletionOutput per sample."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None     # per token: {token_id: logprob} (chosen + top-N)
    finish_reason: str | None                   # "stop" | "length" | None while running
    stop_reason: int | str | None = None        # the stop token id or stop string that ended it


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclasses.dataclass
class StreamEvent:
    """One step of one request while streaming."""
    index: int                  # which prompt
    token_id: int
    text: str                   # new text since the previous event of this request
    finished: bool
    finish_reason: str | None = None
