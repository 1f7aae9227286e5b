"""Engine outputs -> RequestOutputs (vLLM v1's OutputProcessor): text, stop strings, n samples.

The engine core produces token ids; here they become text. A request with stop strings (or
one that streams) is detokenized incrementally, a few tokens at a time (`Detokenizer`); its
text is checked for stop strings after every token, and a hit ends the sample: its text is
cut at the stop string (kept with `include_stop_str_in_output`) and the core is told to abort
it. Other requests are decoded once, when they finish. A request with n > 1 runs as n child
requests in the core; its RequestOutput gathers them and finishes with the last.

Logprobs become vLLM's: each `Logprob`'s `decoded_token` is its token decoded alone (`tokenizer.decode([id])`,
as vLLM's `convert_ids_list_to_tokens`), and `cumulative_logprob` is the sampled tokens' sum, None for a request
that did not ask for logprobs (vLLM's LogprobsProcessor).

Special tokens are left out of the text unless a request says `skip_special_tokens=False` (vLLM's option;
gpt-oss's harmony answers need their markers). Either way the token that ended a sample — a stop token id,
or an end-of-sequence token — is left out of the text unless `include_stop_str_in_output`, as in vLLM.
"""

from __future__ import annotations

import dataclasses
import time

from tp_jax.serving.engine import EngineOutput
from tp_jax.serving.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput, SampleLogprobs
from tp_jax.serving.sampling import SamplingParams


class Detokenizer:
    """Incremental text of a growing list of token ids (the prefix-window method of vLLM and TGI).

    Decodes only a window of recent tokens per step, and holds text back while it ends in an
    incomplete UTF-8 character. `finish()` reconciles with a full decode of all the ids.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip, self.ids, self.text = tokenizer, skip_special_tokens, [], ""
        self.prefix = self.read = 0

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        delta = now[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        full = _whole_characters(self._decode(self.ids))
        if full.startswith(self.text):
            delta, self.text = full[len(self.text):], full
            return delta
        return ""


@dataclasses.dataclass
class _Sample:
    params: SamplingParams
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative: float | None = None             # with logprobs only, as vLLM's
    detok: Detokenizer | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: object | None = None

    def output(self, index: int) -> CompletionOutput:
        return CompletionOutput(index, self.text, list(self.tokens), self.cumulative,
                                None if self.logprobs is None else list(self.logprobs),
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason,
                                lora_request=self.lora_request)


@dataclasses.dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    lora_request: object | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.prompt_logprobs,
                             [s.output(i) for i, s in enumerate(self.samples)], self.finished,
                             dataclasses.replace(self.metrics), self.lora_request,
                             num_cached_tokens=self.num_cached_tokens)


def _whole_characters(text: str) -> str:
    """`text` without the U+FFFD that a decode ends with when the last tokens stop inside a multi-byte character
    (max_tokens cut it): vLLM's detokenizer never emits that partial character either."""
    return text.rstrip("\ufffd")


def _hidden_stop_token(s: _Sample, finish_reason: str | None, stop_reason, special: frozenset[int]) -> int:
    """1 when a sample that ended with (`finish_reason`, `stop_reason`) ended on a token whose text stays out of
    the output, else 0 (vLLM's rule: kept only with include_stop_str_in_output; the token itself stays in
    token_ids). That token is a stop token id (`stop_reason` is its id) or an end-of-sequence token ("stop"
    with no stop_reason, on a special token: the other such end, a grammar complete, ends on its own text);
    the latter matters only with skip_special_tokens=False, where its text would otherwise show."""
    if s.params.include_stop_str_in_output:
        return 0
    eos = finish_reason == "stop" and stop_reason is None and bool(s.tokens) and s.tokens[-1] in special
    return int(isinstance(stop_reason, int) or eos)


def special_token_ids(tokenizer) -> frozenset[int]:
    """The ids a decode with skip_special_tokens=True leaves out: the named special tokens and the added tokens
    marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return frozenset(getattr(tokenizer, "all_special_ids", ()) or ()) | \
        frozenset(i for i, t in added.items() if getattr(t, "special", False))


class OutputProcessor:
    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.special = frozenset() if tokenizer is None else special_token_ids(tokenizer)
        self.states: dict[str, RequestState] = {}
        self.decoded: dict[int, str] = {}                            # token id -> its text alone (Logprob)
        self.children: dict[str, tuple[RequestState, int]] = {}      # core request id -> (parent, sample)

    def add(self, state: RequestState, child_ids: list[str], stream: bool) -> None:
        self.states[state.request_id] = state
        for i, cid in enumerate(child_ids):
            s = state.samples[i]
            s.lora_request = state.lora_request
            if s.params.logprobs is not None:
                s.logprobs, s.cumulative = [], 0.0
            if self.tokenizer is not None and (stream or s.params.stop):
                s.detok = Detokenizer(self.tokenizer, s.params.skip_special_tokens)
            self.children[cid] = (state, i)

    def child_ids(self, request_id: str) -> list[str]:
        return [cid for cid, (st, _) in self.children.items() if st.request_id == request_id]

    def process(self, outputs: list[EngineOutput]) -> tuple[list[RequestOutput], list[str]]:
        """(the updated RequestOutputs, core ids to abort because a stop string ended them)."""
        now, touched, abort = time.monotonic(), {}, []
        for out in outputs:
            if out.request_id not in self.children:
                continue                  # a stop string ended it at an earlier token of this step
            state, i = self.children[out.request_id]
            s = state.samples[i]
            if out.num_draft_tokens:
                state.metrics.spec_drafts += 1
                state.metrics.spec_draft_tokens += out.num_draft_tokens
                state.metrics.spec_accepted_tokens += out.num_accepted_tokens
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if out.prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs = self._decoded(out.prompt_logprobs)
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
            s.tokens += out.new_token_ids
            if s.logprobs is not None:
                s.cumulative += sum(out.new_logprobs)
                s.logprobs += self._decoded(out.new_top_logprobs)
            if s.detok is not None:
                before = len(s.text)
                hidden = _hidden_stop_token(s, out.finish_reason, out.stop_reason, self.special) if out.finished else 0
                s.text += s.detok.push(out.new_token_ids[:len(out.new_token_ids) - hidden])
                if out.finished:
                    s.text += s.detok.finish()
                if s.params.stop and len(s.tokens) > s.params.min_tokens and self._stop_string(s, before):
                    if not out.finished:
                        abort.append(out.request_id)
                    out = dataclasses.replace(out, finish_reason="stop", stop_reason=s.stop_reason)
            if out.finished:
                self._finish_sample(state, s, out.request_id, out.finish_reason, out.stop_reason, now)
            touched[state.request_id] = state
        return [st.output() for st in touched.values()], abort

    def _decoded(self, positions: list) -> list:
        """`positions` (dicts of Logprob, or None) with each Logprob's decoded_token filled in."""
        if self.tokenizer is None:
            return positions
        for entries in positions:
            for t, lp in (entries or {}).items():
                if t not in self.decoded:
                    self.decoded[t] = self.tokenizer.decode([t])
                lp.decoded_token = self.decoded[t]
        return positions

    def _stop_string(self, s: _Sample, before: int) -> bool:
        """Cut s.text at the first stop string that the new text completes."""
        p = s.params
        start = max(0, before - max(len(x) for x in p.stop) + 1)
        hits = [(s.text.find(x, start), x) for x in p.stop if x in s.text[start:]]
        if not hits:
            return False
        pos, stop = min(hits)
        s.text = s.text[:pos + len(stop) if p.include_stop_str_in_output else pos]
        s.stop_reason = stop
        return True

    def _finish_sample(self, state: RequestState, s: _Sample, child_id: str, reason: str, stop_reason,
                       now: float) -> None:
        s.finish_reason, s.stop_reason = reason, stop_reason
        if s.detok is None and self.tokenizer is not None:
            hidden = _hidden_stop_token(s, reason, stop_reason, self.special)
            text = self.tokenizer.decode(s.tokens[:len(s.tokens) - hidden],
                                         skip_special_tokens=s.params.skip_special_tokens)
            s.text = _whole_characters(text)
        del self.children[child_id]
        if state.finished:
            state.metrics.finished_time = now
            del self.states[state.request_id]

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish every running sample of a request as aborted; its final output (None if unknown)."""
        state = self.states.get(request_id)
        if state is None:
            return None
        for cid in self.child_ids(request_id):
            _, i = self.children[cid]
            self._finish_sample(state, state.samples[i], cid, "abort", None, time.monotonic())
        return state.output()
