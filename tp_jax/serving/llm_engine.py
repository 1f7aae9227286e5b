"""The request-level engine for servers (vLLM's LLMEngine): prompts in, RequestOutputs out.

    engine = LLMEngine(core, tokenizer)
    engine.add_request("req-1", "Hello", SamplingParams(max_tokens=16), stream=True)
    while engine.has_unfinished():
        for out in engine.step(): ...        # cumulative RequestOutput of each request that progressed
    engine.abort("req-1")

It tokenizes prompts (`parse_prompt`), fans n > 1 out into child requests of the core (a
seeded request's sample i uses seed + i, as vLLM), and turns the core's tokens into text
(tp_jax/serving/processor.py). Not thread-safe: one thread drives it (see async_engine.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import time

import numpy as np

from tp_jax.serving.engine import EngineCore
from tp_jax.serving.outputs import RequestMetrics, RequestOutput
from tp_jax.serving.processor import OutputProcessor, RequestState, _Sample
from tp_jax.serving.sampling import SamplingParams
from tp_jax.serving.structured import GrammarCompiler


def parse_prompt(prompt, tokenizer, where: str = "prompt") -> tuple[str | None, list[int]]:
    """(text or None, token ids) of one prompt: a string, a sequence of int token ids, or a dict
    with "prompt" or "prompt_token_ids". TypeError / ValueError name what is wrong."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return parse_prompt(list(prompt["prompt_token_ids"]), tokenizer, where)
        if "prompt" in prompt:
            return parse_prompt(prompt["prompt"], tokenizer, where)
        raise ValueError(f"{where}: a dict prompt needs a 'prompt' or 'prompt_token_ids' key, got {sorted(prompt)}")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{where} is an empty string")
        if tokenizer is None:
            raise ValueError(f"{where} is text, but this model has no tokenizer files; pass token-id lists instead")
        return prompt, list(tokenizer.encode(prompt))
    if isinstance(prompt, (bytes, bytearray)):
        raise TypeError(f"{where} is {type(prompt).__name__}; pass a str (decode it first) or a list of token ids")
    if isinstance(prompt, np.ndarray) and prompt.ndim != 1:
        raise ValueError(f"{where} is an array of shape {prompt.shape}; one prompt is a 1-D list of token ids")
    try:
        items = list(prompt)
    except TypeError:
        raise TypeError(f"{where} must be a string or a list of token ids, got {type(prompt).__name__}") from None
    for j, t in enumerate(items):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{where}: token {j} is {t!r} ({type(t).__name__}); token ids must be integers")
    return None, [int(t) for t in items]


class LLMEngine:
    def __init__(self, core: EngineCore, tokenizer=None):
        self.core, self.tokenizer = core, tokenizer
        self.processor = OutputProcessor(tokenizer)
        self._ids = itertools.count()
        self.grammars = None if tokenizer is None else GrammarCompiler(tokenizer, core.vocab_size, core.eos)

    def check(self, prompt, params: SamplingParams | None, where: str):
        """(text, token ids, per-sample params) of a request, or the ValueError / TypeError it would
        raise; nothing is queued."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"{where}: sampling params must be a SamplingParams, got {type(params).__name__}")
        text, ids = parse_prompt(prompt, self.tokenizer, where)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"{where}: stop strings need a tokenizer, and this model has none; use stop_token_ids")
        children = [dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
                    for i in range(params.n)]
        self.core.check(ids, children[0], where)
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError(f"{where}: structured outputs need a tokenizer, and this model has none")
            try:
                self.grammars.grammar(params.structured_outputs)      # compiled (and cached) before anything runs
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        return text, ids, children

    def _matcher(self, params: SamplingParams):
        so = params.structured_outputs
        return None if so is None else self.grammars.matcher(so)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, *,
                    arrival_time: float | None = None, stream: bool = False, where: str | None = None) -> None:
        """Queue a request (validated before anything is queued). `stream`: keep its text current
        every step (otherwise text is decoded when it finishes, or per token for stop strings).
        Errors start with `where` (default "request <id>")."""
        if not isinstance(request_id, str) or request_id in self.processor.states:
            raise ValueError(f"request id {request_id!r} is already in use (or not a string); give a new one")
        text, ids, children = self.check(prompt, params, where or f"request {request_id}")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        core_ids = [f"{request_id}#{next(self._ids)}" for _ in children]
        reqs = [self.core.make_request(cid, ids, p, arrival, where=where, matcher=self._matcher(p))
                for cid, p in zip(core_ids, children)]         # n > 1: a matcher per sample
        state = RequestState(request_id, text, ids, [_Sample(p) for p in children], RequestMetrics(arrival))
        self.processor.add(state, core_ids, stream)
        for r in reqs:
            self.core.submit(r)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now (all its samples); its final output, or None if unknown or finished."""
        for cid in self.processor.child_ids(request_id):
            self.core.abort(cid)
        return self.processor.abort(request_id)

    def step(self) -> list[RequestOutput]:
        outs, stopped = self.processor.process(self.core.step())
        for cid in stopped:
            self.core.abort(cid)
        return outs

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    @property
    def num_requests(self) -> int:
        return len(self.processor.states)
