"""vLLM-shaped results: RequestOutput with one CompletionOutput per sample, and stream events."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None     # per token: {token_id: logprob} (chosen + top-N)
    finish_reason: str | None                   # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None        # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic) of one request, and what speculative decoding did for it."""
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    spec_drafts: int = 0                 # its verified speculative steps
    spec_draft_tokens: int = 0           # draft tokens proposed for it
    spec_accepted_tokens: int = 0        # of which accepted

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens per speculative step: 1 + the accepted drafts (vLLM's definition)."""
        return 1 + self.spec_accepted_tokens / self.spec_drafts if self.spec_drafts else None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0                  # prompt tokens found in the prefix cache
    metrics: RequestMetrics | None = None
    # SamplingParams(prompt_logprobs=k): [None, then per prompt token {token_id: logprob} (its own + top-k)]
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclasses.dataclass
class StreamEvent:
    """One new token of one request while streaming."""
    index: int                  # which prompt
    token_id: int
    text: str                   # new text since the previous event of this request (and sample)
    finished: bool
    finish_reason: str | None = None
    sample: int = 0             # which of the prompt's n samples
