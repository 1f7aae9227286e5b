"""One `LLM.generate` call on the engine: prompts in as requests, stream events through, outputs out.

Every prompt becomes a request of the continuous-batching engine; the call steps the engine
until all of them finish. Many hosts: the driver (process 0) validates, schedules and steps;
the other processes run the same device steps (`EngineCore.follow`) and return no outputs.
If the consumer stops iterating early, its unfinished requests are aborted (blocks freed).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from tp_jax.multihost.distributed import is_driver
from tp_jax.serving.outputs import RequestOutput, StreamEvent
from tp_jax.serving.prompts import per_prompt_adapters, per_prompt_params, split_prompts

_calls = itertools.count()


class Generation:
    def __init__(self, llm, prompts, sampling_params, lora_request=None):
        self.llm = llm
        self.driver = is_driver()
        self.results: dict[int, RequestOutput] = {}
        if not self.driver:
            return
        self.prompts = split_prompts(prompts)
        self.params = per_prompt_params(sampling_params, len(self.prompts))
        self.adapters = per_prompt_adapters(lora_request, len(self.prompts))
        self.base = f"gen{next(_calls)}"

    def events(self, with_text: bool = True) -> Iterator[StreamEvent]:
        """A StreamEvent per token; `with_text=False` skips the per-token detokenizing (text = "")."""
        engine = self.llm.engine
        if not self.driver:
            engine.core.follow()
            return
        ids = [f"{self.base}-{i}" for i in range(len(self.prompts))]
        sent: dict[tuple[int, int], tuple[int, int]] = {}             # (prompt, sample) -> (tokens, chars)
        added: list[str] = []
        try:
            prepared = [engine.prepare(p, sp, f"prompt {i}", lr)      # every prompt checked before any runs
                        for i, (p, sp, lr) in enumerate(zip(self.prompts, self.params, self.adapters))]
            for rid, req in zip(ids, prepared):
                engine.add_request(rid, req, stream=with_text)
                added.append(rid)
            index = {rid: i for i, rid in enumerate(ids)}
            while len(self.results) < len(ids):
                for out in engine.step():
                    i = index[out.request_id]
                    if out.finished:
                        self.results[i] = out
                    for j, c in enumerate(out.outputs):
                        n_tok, n_chr = sent.get((i, j), (0, 0))
                        for k, tok in enumerate(c.token_ids[n_tok:]):
                            last = n_tok + k == len(c.token_ids) - 1
                            text = c.text[n_chr:] if with_text and last else ""
                            done = last and c.finished()
                            yield StreamEvent(i, tok, text, done, c.finish_reason if done else None, j)
                        sent[(i, j)] = (len(c.token_ids), len(c.text) if with_text else 0)
        except BaseException as e:
            for rid in added:
                engine.abort(rid)
            engine.core.release_followers(None if isinstance(e, GeneratorExit) else f"{e}")
            raise
        engine.core.release_followers()

    def outputs(self) -> list[RequestOutput]:
        """The outputs in prompt order on process 0 (the driver); [] on the other processes."""
        if not self.driver:
            return []
        return [self.results[i] for i in range(len(self.prompts))]
