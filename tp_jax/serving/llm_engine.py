"""The request-level engine for servers (vLLM's LLMEngine): prompts in, RequestOutputs out.

    engine = LLMEngine(core, tokenizer)
    engine.add_request("req-1", "Hello", SamplingParams(max_tokens=16), stream=True)
    engine.add_request("req-2", engine.prepare([1, 2, 3], None, "prompt 0"))   # validated ahead, queued later
    while engine.has_unfinished():
        for out in engine.step(): ...        # cumulative RequestOutput of each request that progressed
    engine.abort("req-1")

It is the one place a request is prepared (`prepare`: the prompt normalized and tokenized by
tp_jax/serving/prompts.py, the SamplingParams type, the engine's limits, the grammar compiled);
the core only queues prepared requests. It fans n > 1 out into child requests of the core (a
seeded request's sample i uses seed + i, as vLLM), and turns the core's tokens into text
(tp_jax/serving/processor.py). Not thread-safe: one thread drives it (see async_engine.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import time

from tp_jax.serving.engine import EngineCore
from tp_jax.serving.outputs import RequestMetrics, RequestOutput
from tp_jax.serving.processor import OutputProcessor, RequestState, _Sample
from tp_jax.serving.prompts import parse_prompt
from tp_jax.serving.sampling import SamplingParams
from tp_jax.serving.structured import GrammarCompiler


@dataclasses.dataclass(frozen=True)
class PreparedRequest:
    """A request the front door has normalized, tokenized and validated (`LLMEngine.prepare`): queueing
    it (`add_request`) checks nothing but its id."""
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SamplingParams]            # one per sample (n > 1 fans out; sample i seeded seed + i)
    where: str
    lora_request: object | None = None       # its adapter (tp_jax/serving/lora.py LoRARequest), None: the base


class LLMEngine:
    def __init__(self, core: EngineCore, tokenizer=None, structured_defaults: dict | None = None):
        """`structured_defaults`: StructuredOutputsParams options (EngineArgs.structured_outputs_config)
        switched on in every constrained request that left them off."""
        self.core, self.tokenizer = core, tokenizer
        self.structured_defaults = {k: True for k, v in (structured_defaults or {}).items() if v}
        self.processor = OutputProcessor(tokenizer)
        self._ids = itertools.count()
        self.grammars = None if tokenizer is None else GrammarCompiler(tokenizer, core.vocab_size, core.eos)

    def prepare(self, prompt, params: SamplingParams | None, where: str, lora_request=None) -> PreparedRequest:
        """The request `prompt` + `params` prepared for `add_request`, or the ValueError / TypeError (naming
        `where`) it would raise; nothing is queued. The front doors prepare every prompt of a call before
        they queue any."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"{where}: sampling params must be a SamplingParams, got {type(params).__name__}")
        so = params.structured_outputs                  # the engine's option defaults, on where a request left them off
        on = {k: True for k, v in self.structured_defaults.items() if v and so is not None and not getattr(so, k)}
        if on:
            params = dataclasses.replace(params, structured_outputs=dataclasses.replace(so, **on))
        text, ids = parse_prompt(prompt, self.tokenizer, where)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"{where}: stop strings need a tokenizer, and this model has none; use stop_token_ids")
        samples = [dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
                   for i in range(params.n)]
        self.core.check(ids, samples[0], where)
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError(f"{where}: structured outputs need a tokenizer, and this model has none")
            try:
                self.grammars.grammar(params.structured_outputs)      # compiled (and cached) before anything runs
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        self.core.check_lora(lora_request, where)
        return PreparedRequest(text, ids, samples, where, lora_request)

    def _matcher(self, params: SamplingParams):
        so = params.structured_outputs
        return None if so is None else self.grammars.matcher(so)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, *,
                    arrival_time: float | None = None, stream: bool = False, lora_request=None) -> None:
        """Queue a request: `prompt` + `params` (prepared here; errors start with "request <id>"), or a
        PreparedRequest from `prepare` (then `params` is None). `stream`: keep its text current every step
        (otherwise text is decoded when it finishes, or per token for stop strings). `lora_request`: the
        request's LoRA adapter (a PreparedRequest carries its own)."""
        if not isinstance(request_id, str) or request_id in self.processor.states:
            raise ValueError(f"request id {request_id!r} is already in use (or not a string); give a new one")
        if isinstance(prompt, PreparedRequest):
            if params is not None or lora_request is not None:
                raise TypeError("add_request: a PreparedRequest carries its own sampling params and adapter; pass "
                                "params=None and lora_request=None")
            prepared = prompt
        else:
            prepared = self.prepare(prompt, params, f"request {request_id}", lora_request)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        core_ids = [f"{request_id}#{next(self._ids)}" for _ in prepared.samples]
        state = RequestState(request_id, prepared.prompt, prepared.prompt_token_ids,
                             [_Sample(p) for p in prepared.samples], RequestMetrics(arrival),
                             lora_request=prepared.lora_request)
        self.processor.add(state, core_ids, stream)
        for cid, p in zip(core_ids, prepared.samples):             # n > 1: a matcher per sample
            self.core.add(cid, prepared.prompt_token_ids, p, arrival, matcher=self._matcher(p),
                          lora_request=prepared.lora_request)

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
