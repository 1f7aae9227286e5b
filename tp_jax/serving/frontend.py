"""One `LLM.generate` call: prompts in, engine events through, vLLM-shaped outputs out.

Text prompts are tokenized here (the engine only sees ids); stop strings are checked on
the incrementally decoded text and end a sequence through the engine's `should_stop`.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax

from tp_jax.multihost.distributed import jsonable, is_driver, share_from_driver
from tp_jax.serving.outputs import CompletionOutput, RequestOutput, StreamEvent
from tp_jax.serving.sampling import SamplingParams


def normalize_prompts(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) or hasattr(p, "__index__") and not isinstance(p, str) for p in prompts):
        return [[int(p) for p in prompts]]
    return prompts


class Generation:
    def __init__(self, llm, prompts, sampling_params):
        self.llm = llm
        prompts, sampling_params = share_request(prompts, sampling_params)   # process 0's, on all
        self.driver = is_driver()
        raw = normalize_prompts(prompts)
        if not raw:
            raise ValueError("generate: no prompts given")
        self.texts: list[str | None] = []
        self.ids: list[list[int]] = []
        for i, p in enumerate(raw):
            text, ids = self._prompt(i, p)
            self.texts.append(text)
            self.ids.append(ids)
        self.params = self._params(sampling_params, len(raw))
        self.tok = llm._tokenizer_or_none()
        if self.tok is None and any(p.stop for p in self.params):
            raise ValueError("stop strings need a tokenizer, and this model has none; use stop_token_ids")
        self.tokens: list[list[int]] = [[] for _ in raw]
        self.logprobs: list[list[dict[int, float]]] = [[] for _ in raw]
        self.cum: list[float] = [0.0 for _ in raw]
        self.finish: list[tuple[str | None, int | str | None]] = [(None, None) for _ in raw]
        self.stop_at: dict[int, int] = {}             # request -> text cut position
        self.sent: list[str] = ["" for _ in raw]

    def _prompt(self, i: int, p) -> tuple[str | None, list[int]]:
        if isinstance(p, dict):
            p = p.get("prompt_token_ids", p.get("prompt"))
        if isinstance(p, str):
            if not p:
                raise ValueError(f"generate: prompt {i} is an empty string")
            return p, list(self.llm.get_tokenizer().encode(p))
        try:
            return None, [int(t) for t in p]
        except TypeError:
            raise TypeError(f"generate: prompt {i} must be a string or a list of token ids, got {type(p).__name__}")

    @staticmethod
    def _params(sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n or not all(isinstance(p, SamplingParams) for p in sp):
            raise ValueError(f"generate: got {len(sp)} sampling params for {n} prompts; pass one SamplingParams "
                             f"or one per prompt")
        return sp

    def _text(self, i: int) -> str:
        if self.tok is None:
            return ""
        text = self.tok.decode(self.tokens[i], skip_special_tokens=True)
        return text[:self.stop_at[i]] if i in self.stop_at else text

    def should_stop(self, i: int, tokens: list[int]) -> str | None:
        p = self.params[i]
        if not p.stop:
            return None
        text = self.tok.decode(tokens, skip_special_tokens=True)
        hits = [(text.find(s), s) for s in p.stop if s in text]
        if not hits:
            return None
        pos, s = min(hits)
        self.stop_at[i] = pos + len(s) if p.include_stop_str_in_output else pos
        return s

    def events(self, with_text: bool = True) -> Iterator[StreamEvent]:
        """A StreamEvent per token; `with_text=False` skips the per-token detokenizing (text = "")."""
        for step in self.llm.engine.run(self.ids, self.params, self.should_stop):
            for ev in step:
                i = ev.index
                self.tokens[i].append(ev.token)
                self.cum[i] += ev.logprob
                if self.params[i].logprobs is not None:
                    self.logprobs[i].append({ev.token: ev.logprob, **ev.top})
                self.finish[i] = (ev.finish_reason, ev.stop_reason)
                finished = ev.finish_reason is not None
                delta = self._delta(i, finished) if with_text else ""
                if self.driver:                  # the others run the same steps, silently
                    yield StreamEvent(i, ev.token, delta, finished, ev.finish_reason)

    def _delta(self, i: int, finished: bool) -> str:
        """New text of request i since its previous event (held back mid UTF-8 character)."""
        text = self._text(i)
        if text.endswith("\ufffd") and not finished:
            return ""
        delta, self.sent[i] = text[len(self.sent[i]):], text
        return delta

    def outputs(self) -> list[RequestOutput]:
        """The outputs on process 0 (the driver); [] on the other processes."""
        if not self.driver:
            return []
        outs = []
        for i, ids in enumerate(self.ids):
            p = self.params[i]
            comp = CompletionOutput(0, self._text(i), self.tokens[i], self.cum[i],
                                    self.logprobs[i] if p.logprobs is not None else None, *self.finish[i])
            outs.append(RequestOutput(str(i), self.texts[i], ids, [comp]))
        return outs


def share_request(prompts, sampling_params):
    """(prompts, sampling_params) as process 0 passed them, on every process."""
    if jax.process_count() == 1:
        return prompts, sampling_params
    import dataclasses

    def encode():
        sp = sampling_params
        one = sp is None or isinstance(sp, SamplingParams)
        sps = [sp] if one else list(sp)
        if not all(p is None or isinstance(p, SamplingParams) for p in sps):
            raise ValueError("generate: sampling_params must be a SamplingParams or a list of them, one per prompt")
        params = [None if p is None else dataclasses.asdict(p) for p in sps]
        return {"prompts": jsonable(prompts), "params": jsonable(params), "one": one}

    req = share_from_driver(encode)
    params = [None if p is None else SamplingParams(**p) for p in req["params"]]
    return req["prompts"], params[0] if req["one"] else params
