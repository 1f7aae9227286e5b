"""Speculative decoding (vLLM's `speculative_config`): n-gram or draft-model proposals, verified in one step.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    LLM(model, speculative_config={"model": "path/to/draft", "num_speculative_tokens": 4})

Before a step the engine asks `propose_ngram` for each running request in decode: the k tokens that
followed the earliest earlier occurrence of its longest suffix n-gram (prompt_lookup_max down
to prompt_lookup_min tokens; vLLM's rule), from its prompt and output, on the host; or, with a
draft model, k greedy tokens of the draft (tp_jax/serving/draft_model.py). The step
then carries the request as 1 + k decode rows (its newest token, then each draft, at
consecutive positions, one block table): one forward gives the target's logits after each
prefix, and every row is sampled as its own decode step would be (the same PRNG key and
output index), so the step's tokens are the ones plain decoding would draw. Verification keeps
the drafts up to the first whose sampled token differs, then that sampled token: greedy or
seeded, the output is token for token the output without speculation. For a proposal with a
one-hot q (n-gram) this is exactly rejection sampling: a draft d survives with probability
p(d), and a rejected position's token is drawn from p restricted to tokens other than d, the
normalized residual (p - q)+. The rejected drafts' keys and values stay in their slots,
beyond the request's computed tokens, and are overwritten as it grows; blocks wholly past
its tokens are freed; only computed blocks ever enter the prefix cache.

Requests with penalties are not speculated (their device-side counts advance one token a
step); constrained ones (structured outputs) are, with drafts cut where the grammar stops
accepting them and each row's mask computed after the drafts before it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

METHODS = ("ngram", "draft_model")
_COMMON = {"method", "num_speculative_tokens", "disable_by_batch_size"}
KEYS = {"ngram": _COMMON | {"prompt_lookup_max", "prompt_lookup_min"}, "draft_model": _COMMON | {"model"}}
EXAMPLE = "{'method': 'ngram', 'num_speculative_tokens': 4, 'prompt_lookup_max': 4} or {'model': PATH, " \
          "'num_speculative_tokens': 4}"


def _positive(where: str, name: str, x, optional: bool = False):
    if optional and x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
        raise ValueError(f"{where}: {name}={x!r} must be an int >= 1" + (" or absent" if optional else ""))
    return int(x)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str                                  # "ngram" | "draft_model"
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None         # ngram
    prompt_lookup_min: int | None = None         # ngram
    disable_by_batch_size: int | None = None     # no proposals in a step when more requests run
    model: str | None = None                     # draft_model: its checkpoint (tp_jax/serving/draft_model.py)

    @classmethod
    def parse(cls, value: dict | str | None, where: str = "speculative_config") -> SpeculativeConfig | None:
        """vLLM's dict (or its JSON text); None stays None. ValueError naming the key and the fix. A `model`
        without a method is a draft model (vLLM's inference)."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"{where}: not JSON ({e}); e.g. {EXAMPLE}") from None
        if not isinstance(value, dict):
            raise ValueError(f"{where}={value!r} must be a dict, e.g. {EXAMPLE}")
        v = dict(value)
        method = v.get("method", "draft_model" if "model" in v else None)
        if method not in METHODS:
            raise ValueError(f"{where}: method={method!r} is not supported; choose one of {list(METHODS)} "
                             f"(EAGLE and MTP are not built yet), e.g. {EXAMPLE}")
        if "draft_tensor_parallel_size" in v:
            raise ValueError(f"{where}: draft_tensor_parallel_size is not read: the draft model runs on the "
                             f"target's mesh (its dp, pp and tp); remove the key")
        unknown = sorted(set(v) - KEYS[method])
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown} for method {method!r}; it reads "
                             f"{sorted(KEYS[method])}")
        k = _positive(where, "num_speculative_tokens", v.get("num_speculative_tokens"))
        off = _positive(where, "disable_by_batch_size", v.get("disable_by_batch_size"), optional=True)
        if method == "draft_model":
            model = v.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError(f"{where}: model={model!r} must be the draft model's checkpoint (a path or a "
                                 f"Hugging Face repo id)")
            return cls(method, k, disable_by_batch_size=off, model=model)
        hi, lo = v.get("prompt_lookup_max"), v.get("prompt_lookup_min")
        if hi is None and lo is None:
            hi = lo = 5                                            # vLLM's default
        hi = _positive(where, "prompt_lookup_max", lo if hi is None else hi)
        lo = _positive(where, "prompt_lookup_min", hi if lo is None else lo)
        if lo > hi:
            raise ValueError(f"{where}: prompt_lookup_min={lo} exceeds prompt_lookup_max={hi}")
        return cls(method, k, hi, lo, off)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return json.dumps({k: v for k, v in self.to_dict().items() if v is not None})


def propose_ngram(tokens, k: int, lookup_max: int, lookup_min: int) -> list[int]:
    """At most k tokens: those after the earliest earlier occurrence of the longest suffix of `tokens`
    of lookup_max down to lookup_min tokens (vLLM's ngram proposer); [] when none occurs."""
    t = np.asarray(tokens, np.int64)
    n_all = len(t)
    for n in range(min(lookup_max, n_all - 1), lookup_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(t[:-1], n)        # occurrences ending before the end
        hits = np.flatnonzero((windows == t[n_all - n:]).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return t[start:start + k].tolist()
    return []


@dataclasses.dataclass
class SpecCounters:
    """What verification did (vLLM's spec-decode series): proposals, their tokens, the accepted ones,
    and the accepted ones by draft position."""
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    def add(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        self.accepted_per_pos += [0] * (proposed - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verified step yields per request: 1 + the accepted drafts (vLLM's definition)."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 0.0


def accepted_count(draft: list[int], sampled) -> int:
    """How many leading drafts the sampled tokens confirm: sampled[i] is the target's token after the
    prefix + draft[:i]; draft[i] stands while it equals sampled[i]."""
    a = 0
    while a < len(draft) and int(sampled[a]) == draft[a]:
        a += 1
    return a
