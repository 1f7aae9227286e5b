"""A step plan: everything the devices need for one step, built by the driver, run by every process.

With many hosts the driver (process 0) schedules and every process executes the same jitted
step; the others receive the plan as bytes (numpy arrays + a small JSON header). A plan
carries the step's token batch, the per-row sampling inputs, the static flags that pick the
sampler program, the penalty rows to load for requests that start running, and the prompt
positions to score for requests that ask for prompt logprobs.
"""

from __future__ import annotations

import dataclasses
import io
import json

import numpy as np

from tp_jax.serving.batch import StepBatch, StepShape
from tp_jax.serving.prompt_logprobs import PromptPlan


@dataclasses.dataclass(kw_only=True)
class StepPlan:
    """Built by keyword (EngineCore._plan), rebuilt from bytes (`from_bytes`) on the other processes."""
    batch: StepBatch
    floats: np.ndarray                     # f32[G, R, 6]  sampling.ROW_FLOATS
    top_k: np.ndarray                      # i32[G, R]
    words: np.ndarray                      # u32[G, R, 3]  PRNG key words
    steps: np.ndarray                      # i32[G, R]     output index of the token drawn
    penalty_rows: np.ndarray               # i32[G, R]     penalty row (penalties.py; the scratch row when unused)
    num_logprobs: int
    penalties: bool
    all_greedy: bool
    penalty_inits: list[tuple[int, list[int], list[int]]]     # (row, prompt ids, output ids) to load
    prompt: PromptPlan | None = None       # prompt positions to score (prompt_logprobs.py)
    bitmask: np.ndarray | None = None      # i32[G, R, ceil(V/32)] allowed tokens (structured outputs), or None
    bias: np.ndarray | None = None         # f32[G, R, V] added to the logits (logit_bias), or None

    SAMPLE_ARRAYS = ("floats", "top_k", "words", "steps", "penalty_rows")

    def sample_ints(self) -> np.ndarray:
        """i32[G, R, 6]: top_k, step, penalty row, then the three key words (bit-cast)."""
        return np.concatenate([self.top_k[..., None], self.steps[..., None], self.penalty_rows[..., None],
                               self.words.view(np.int32)], axis=-1)

    def to_bytes(self) -> bytes:
        arrays = {**self.batch.arrays(), **{k: getattr(self, k) for k in self.SAMPLE_ARRAYS}}
        assert len(arrays) == len(StepBatch.ARRAYS) + len(self.SAMPLE_ARRAYS), "array names must not collide"
        for name in ("bitmask", "bias"):
            if getattr(self, name) is not None:
                arrays[name] = getattr(self, name)
        header = {"shape": dataclasses.astuple(self.batch.shape), "num_logprobs": self.num_logprobs,
                  "penalties": self.penalties, "all_greedy": self.all_greedy, "penalty_inits": self.penalty_inits}
        if self.prompt is not None:
            arrays.update(prompt_index=self.prompt.index, prompt_target=self.prompt.target)
            header["prompt_k"] = self.prompt.k
        buf = io.BytesIO()
        np.savez(buf, header=np.frombuffer(json.dumps(header).encode(), np.uint8), **arrays)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> StepPlan:
        with np.load(io.BytesIO(data)) as z:
            a = {k: z[k] for k in z.files}
        header = json.loads(a.pop("header").tobytes())
        batch = StepBatch(StepShape(*header["shape"]), *(a[k] for k in StepBatch.ARRAYS), rows=[])
        prompt = PromptPlan(a["prompt_index"], a["prompt_target"], header["prompt_k"]) if "prompt_k" in header else None
        return cls(batch=batch, **{k: a[k] for k in cls.SAMPLE_ARRAYS}, num_logprobs=header["num_logprobs"],
                   penalties=header["penalties"], all_greedy=header["all_greedy"],
                   penalty_inits=[tuple(x) for x in header["penalty_inits"]], prompt=prompt, bitmask=a.get("bitmask"),
                   bias=a.get("bias"))
