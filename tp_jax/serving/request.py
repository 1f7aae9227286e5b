"""One request as the engine tracks it (vLLM v1's `Request`): tokens, progress, blocks' hashes.

`token_ids` is the prompt followed by every generated token; `num_computed_tokens` counts
the leading tokens whose keys and values are in the KV pool. A running request always has
at least one token left to compute: the rest of its prompt, or its newest sampled token.
When it is preempted its blocks are freed and `num_computed_tokens` drops to 0; it keeps its
outputs and recomputes prompt + outputs when it runs again.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib

import numpy as np

from tp_jax.serving.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_len: int
    token_ids: list[int]             # prompt + outputs
    params: SamplingParams
    max_tokens: int                  # resolved: at most max_model_len - prompt_len
    key_words: tuple[int, int, int]  # the PRNG key's seed words (sampling.row_key_words)
    arrival_time: float = 0.0
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1      # prompt tokens found in the prefix cache when first scheduled
    num_preemptions: int = 0
    replica: int = -1                # the dp replica whose pool holds its blocks while it runs
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)
    sample_floats: tuple[float, ...] = ()   # the sampler's per-row floats (sampling.row_floats), set once
    prompt_logprobs: list = dataclasses.field(default_factory=lambda: [None])   # scored so far (prompt_logprobs.py)
    matcher: object | None = None    # structured outputs: its grammar's state (serving/structured.py Matcher)
    draft: list[int] = dataclasses.field(default_factory=list)   # speculative tokens for the next step
    lora: object | None = None       # its LoRARequest (tp_jax/serving/lora.py), None: the base model
    lora_slot: int = -1              # the device slot its adapter holds while it runs

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def scoring_prompt(self) -> bool:
        """It asks for prompt logprobs and does not have them all yet (tp_jax/serving/prompt_logprobs.py)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.prompt_len

    def cache_salt(self) -> bytes:
        """The first block's parent hash: a prefix computed under an adapter is that adapter's alone."""
        return b"" if self.lora is None else f"lora:{self.lora.lora_int_id}".encode()

    def hashes_upto(self, num_blocks: int, block_size: int) -> list[bytes]:
        """The content hashes of the first `num_blocks` full blocks (computed once, on demand).

        hash_i = sha256(hash_{i-1} || token ids of block i as int32): a block's hash names its
        whole prefix, so equal hashes mean equal keys and values.
        """
        num_blocks = min(num_blocks, self.num_tokens // block_size)
        while len(self.block_hashes) < num_blocks:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if i else self.cache_salt()
            chunk = np.asarray(self.token_ids[i * block_size:(i + 1) * block_size], np.int32).tobytes()
            self.block_hashes.append(hashlib.sha256(parent + chunk).digest())
        return self.block_hashes[:num_blocks]
