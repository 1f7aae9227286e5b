"""vLLM-shaped results: RequestOutput with one CompletionOutput per sample, their `Logprob`s, and stream events.

The fields, their order and their meaning are vLLM's (`vllm/outputs.py`, `vllm/logprobs.py`); docs/vllm_map.md
lists the few that differ. Logprobs are vLLM's too: per position a dict {token id: Logprob}, the chosen (sampled
or prompt) token first with its rank in the whole distribution, then the top N with ranks 1..N (the chosen token
keeps one entry, the top N's, when it is among them).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Logprob:
    """One token's entry at one position (vLLM's `Logprob`): its raw logprob (log-softmax of the unpenalized,
    untempered logits), its rank in the vocabulary (1: the most likely; the number of tokens at least as
    likely), and its text decoded alone (`tokenizer.decode([id])`)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LogprobsOnePosition = dict[int, Logprob]
SampleLogprobs = list[LogprobsOnePosition]                  # one dict per generated token
PromptLogprobs = list[LogprobsOnePosition | None]           # None for the first prompt token, then one per token


def position_logprobs(token: int, logprob: float, rank: int, top_ids, top_logprobs) -> LogprobsOnePosition:
    """One position's dict as vLLM builds it (`append_logprobs_for_next_position`): the chosen token with its
    rank, then the top N (most likely first) with ranks 1..N; a chosen token among them keeps its top-N entry.
    `decoded_token` is filled later, where the tokenizer is (tp_jax/serving/processor.py)."""
    out = {int(token): Logprob(float(logprob), int(rank))}
    out.update((int(t), Logprob(float(x), r)) for r, (t, x) in enumerate(zip(top_ids, top_logprobs), 1))
    return out


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None             # sum of the sampled tokens' logprobs; None without `logprobs`
    logprobs: SampleLogprobs | None              # with SamplingParams(logprobs=N): per token, chosen + top-N
    routed_experts: Any = None                   # vLLM's MoE routing capture: not built, always None
    finish_reason: str | None = None             # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None         # the stop token id or stop string that ended it
    lora_request: Any = None                     # the request's LoRARequest, None for the base model
    kv_transfer_params: dict[str, Any] | None = None     # disaggregated prefill: not built, always None

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
    prompt_logprobs: PromptLogprobs | None       # with SamplingParams(prompt_logprobs=k): None, then own + top-k
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: RequestMetrics | None = None        # ours, not vLLM's RequestStateStats (docs/vllm_map.md)
    lora_request: Any = None
    encoder_prompt: str | None = None            # decoder-only models: always None, as in vLLM
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int = 0                   # prompt tokens found in the prefix cache

    @property
    def kv_transfer_params(self) -> None:
        return None

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output of the same request into this one (vLLM's `RequestOutput.add`): a sample's
        text, tokens and logprobs appended when `aggregate` (delta outputs), else replaced."""
        self.finished |= next_output.finished
        mine = {c.index: i for i, c in enumerate(self.outputs)}
        for nxt in next_output.outputs:
            if nxt.index not in mine:
                self.outputs.append(nxt)
            elif not aggregate:
                self.outputs[mine[nxt.index]] = nxt
            else:
                c = self.outputs[mine[nxt.index]]
                c.text += nxt.text
                c.token_ids = list(c.token_ids) + list(nxt.token_ids)
                if nxt.logprobs:
                    c.logprobs = (c.logprobs or []) + list(nxt.logprobs)
                c.cumulative_logprob, c.finish_reason, c.stop_reason = (nxt.cumulative_logprob, nxt.finish_reason,
                                                                       nxt.stop_reason)


@dataclasses.dataclass
class StreamEvent:
    """One new token of one request while streaming."""
    index: int                  # which prompt
    token_id: int
    text: str                   # new text since the previous event of this request (and sample)
    finished: bool
    finish_reason: str | None = None
    sample: int = 0             # which of the prompt's n samples
