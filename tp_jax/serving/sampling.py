"""Sampling: vLLM's SamplingParams and a jittable, per-row sampler.

* `SamplingParams` — vLLM's request options (vllm/sampling_params.py), validated.
* `SamplingTensors` — a batch of params packed as [B] arrays plus one PRNG key per row.
* `apply_penalties` — repetition / frequency / presence, exactly as vLLM's
  `model_executor/layers/utils.py::apply_penalties`.
* `process_logits` — temperature, then top-k, top-p, min-p (vLLM v0's sampler order);
  excluded tokens get -inf, i.e. probability exactly 0.
* `sample` — greedy or random per row; returns tokens and `TokenLogprobs`.

Logprobs follow vLLM v1's default (`logprobs_mode="raw_logprobs"`): the log-softmax of the
raw logits, before penalties, temperature and filtering. Padded vocab entries (logits at the
dtype's minimum, see layers/vocab.py) are masked to -inf first: never drawn, logprob -inf.

A row's draw depends only on its logits, its settings, its key and its step
(`fold_in(key, step)`), never on the other rows of the batch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tp_jax.parallel.invariant import row_log_softmax, row_softmax
from tp_jax.serving.structured import StructuredOutputsParams

SAMPLING_EPS = 1e-5   # vLLM's _SAMPLING_EPS: temperature below it means greedy

# field: (integer?, predicate, allowed range as said in the error)
_RULES = {
    "n": (True, lambda v: v >= 1, ">= 1"),
    "max_tokens": (True, lambda v: v >= 0, ">= 1 (0 only with prompt_logprobs: score the prompt, generate nothing)"),
    "temperature": (False, lambda v: v >= 0, ">= 0 (0 = greedy)"),
    "top_p": (False, lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (True, lambda v: v >= -1, ">= -1 (0 or -1 = off)"),
    "min_p": (False, lambda v: 0 <= v <= 1, "in [0, 1]"),
    "repetition_penalty": (False, lambda v: v > 0, "> 0"),
    "presence_penalty": (False, lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "frequency_penalty": (False, lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "seed": (True, lambda v: True, "an int or None"),
    "min_tokens": (True, lambda v: v >= 0, ">= 0"),
    "logprobs": (True, lambda v: v >= 0, ">= 0"),
    "prompt_logprobs": (True, lambda v: v >= 0, ">= 0"),
}
_OPTIONAL = {"max_tokens", "seed", "logprobs", "prompt_logprobs"}


def _checked(name: str, value, integer: bool, ok, allowed: str):
    """`value` as int/float if it is a finite number satisfying `ok`, else ValueError."""
    kind, word = (numbers.Integral, "an int") if integer else (numbers.Real, "a finite number")
    if isinstance(value, bool) or not isinstance(value, kind) or not (integer or math.isfinite(value)):
        raise ValueError(f"SamplingParams: {name}={value!r} must be {word}, {allowed}")
    if not ok(value):
        raise ValueError(f"SamplingParams: {name}={value!r} must be {allowed}")
    return int(value) if integer else float(value)


def _stop_strings(stop) -> tuple[str, ...]:
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"SamplingParams: stop={stop!r} must be a string or a list of strings")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise ValueError(f"SamplingParams: stop[{i}]={s!r} must be a non-empty string")
    return tuple(stop)


def _logit_bias(bias) -> dict[int, float] | None:
    """{token id: bias in [-100, 100]} (OpenAI's range; vLLM clamps to it, here it is refused outside)."""
    if bias is None or not bias:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"SamplingParams: logit_bias={bias!r} must be a dict of token id -> bias")
    return {_checked(f"logit_bias key {t!r}", t, True, lambda v: v >= 0, ">= 0 (a token id)"):
            _checked(f"logit_bias[{t}]", b, False, lambda v: -100 <= v <= 100, "in [-100, 100]")
            for t, b in bias.items()}


def _stop_ids(ids) -> tuple[int, ...]:
    ids = () if ids is None else ids
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"SamplingParams: stop_token_ids={ids!r} must be a list of ints >= 0")
    return tuple(_checked(f"stop_token_ids[{i}]", t, True, lambda v: v >= 0, ">= 0")
                 for i, t in enumerate(ids))


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """vLLM's per-request sampling options. `stop` and `stop_token_ids` become tuples (None -> ())."""

    n: int = 1
    max_tokens: int | None = 16           # None: up to the model's context length
    temperature: float = 1.0              # < 1e-5: greedy
    top_p: float = 1.0
    top_k: int = 0                        # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None           # top-N logprobs per generated token
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None    # per prompt token: its logprob + the top-N (prompt_logprobs.py)
    structured_outputs: StructuredOutputsParams | None = None   # a JSON schema / regex / choice / grammar
    min_tokens: int = 0                   # EOS, stop token ids and stop strings cannot end it before this many
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit before sampling (not to logprobs)
    skip_special_tokens: bool = True      # False: the text keeps special tokens (gpt-oss's harmony markers)

    def __post_init__(self):
        for name, (integer, ok, allowed) in _RULES.items():
            value = getattr(self, name)
            if not (value is None and name in _OPTIONAL):
                object.__setattr__(self, name, _checked(name, value, integer, ok, allowed))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams: {name}={getattr(self, name)!r} must be a bool")
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", _stop_ids(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams: min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}; "
                             f"lower min_tokens or raise max_tokens")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("SamplingParams: max_tokens=0 generates nothing; it is allowed only with "
                             "prompt_logprobs (score the prompt): set prompt_logprobs=0, or max_tokens >= 1")
        so = self.structured_outputs
        if isinstance(so, dict):
            object.__setattr__(self, "structured_outputs", so := StructuredOutputsParams(**so))
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"SamplingParams: structured_outputs must be a StructuredOutputsParams (or a dict of "
                             f"its fields), got {type(so).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


class SamplingTensors(NamedTuple):
    """A batch of SamplingParams as [B] arrays (a pytree: passes through jit as data)."""

    temperature: jax.Array          # f32[B], < 1e-5 = greedy
    top_p: jax.Array                # f32[B], 1 = off
    top_k: jax.Array                # i32[B], 0 = off
    min_p: jax.Array                # f32[B], 0 = off
    repetition_penalty: jax.Array   # f32[B], 1 = off
    presence_penalty: jax.Array     # f32[B], 0 = off
    frequency_penalty: jax.Array    # f32[B], 0 = off
    keys: jax.Array                 # key[B], one PRNG key per row

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], vocab_size: int, *, engine_seed: int = 0,
                    seq_ids: Sequence[int] | None = None) -> SamplingTensors:
        """Rows with a `seed` get a key from it alone; the others from (`engine_seed`, seq id).

        `seq_ids` should be stable per sequence (e.g. request ids) so an unseeded row's draws
        do not depend on its position in the batch; they default to the row index.
        """
        seq_ids = range(len(params)) if seq_ids is None else seq_ids
        words = [key_words(p.seed, (engine_seed, sid)) for p, sid in zip(params, seq_ids, strict=True)]
        return cls.from_rows(jnp.asarray([row_floats(p) for p in params], jnp.float32).reshape(-1, len(ROW_FLOATS)),
                             jnp.asarray([row_top_k(p, vocab_size) for p in params], jnp.int32),
                             jnp.asarray(np.array(words, np.uint32).reshape(-1, 3)))

    @classmethod
    def from_rows(cls, floats: jax.Array, top_k: jax.Array, words: jax.Array) -> SamplingTensors:
        """From packed rows (jittable): floats[B, 6] in ROW_FLOATS order, top_k[B], key words u32[B, 3]."""
        f = {name: floats[:, i] for i, name in enumerate(ROW_FLOATS)}
        return cls(f["temperature"], f["top_p"], top_k, f["min_p"], f["repetition_penalty"],
                   f["presence_penalty"], f["frequency_penalty"], _keys_from_words(words))


ROW_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
GREEDY_ROW = (0.0, 1.0, 0.0, 1.0, 0.0, 0.0)          # the floats of a padding row


def row_floats(p: SamplingParams) -> tuple[float, ...]:
    return tuple(float(getattr(p, name)) for name in ROW_FLOATS)


def row_top_k(p: SamplingParams, vocab_size: int) -> int:
    """top_k as the sampler takes it: 0 = off (also for -1 and k >= vocab)."""
    return p.top_k if 0 < p.top_k < vocab_size else 0


def key_words(seed: int | None, unseeded: tuple[int, int]) -> tuple[int, int, int]:
    """A row's PRNG key as three uint32 words: fold_in(fold_in(key(w0), w1), w2).

    From `seed` (all 64 bits; w2 = 0), else from the two words `unseeded` (e.g. 64 fresh
    random bits drawn per request; w2 = 1)."""
    if seed is None:
        return unseeded[0] % 2**32, unseeded[1] % 2**32, 1
    s = seed % 2**64                    # negative and 64-bit seeds keep all their bits
    return s % 2**32, s >> 32, 0


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0


@jax.jit
def _keys_from_words(words: jax.Array) -> jax.Array:
    make = lambda a, b, c: jax.random.fold_in(jax.random.fold_in(jax.random.key(a), b), c)
    return jax.vmap(make)(words[:, 0], words[:, 1], words[:, 2])


def apply_penalties(logits: jax.Array, prompt_mask: jax.Array, output_counts: jax.Array,
                    t: SamplingTensors) -> jax.Array:
    """vLLM's penalties on logits[B, V].

    repetition (tokens in the prompt or the output): logit > 0 -> logit / r, else logit * r;
    frequency: - f * count; presence: - p * (count > 0) (output tokens only).
    """
    seen = prompt_mask | (output_counts > 0)                                   # [B, V]
    rep = jnp.where(seen, t.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - t.frequency_penalty[:, None] * output_counts
    return logits - t.presence_penalty[:, None] * (output_counts > 0)


def _top_k_top_p(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """vLLM's `_apply_top_k_top_p` on x[B, V], as value thresholds (so ties are all kept).

    top-k keeps logits >= the k-th largest; top-p then drops the low tokens whose ascending
    cumulative probability is <= 1 - p, i.e. keeps the smallest top set with mass >= p.
    """
    v = x.shape[-1]
    asc = jnp.sort(x, axis=-1)                                                  # [B, V]
    k = jnp.where((top_k <= 0) | (top_k > v), v, top_k)
    kth = jnp.take_along_axis(asc, (v - k)[:, None], axis=-1)                   # [B, 1]
    asc = jnp.where(asc >= kth, asc, -jnp.inf)
    cum = jnp.cumsum(row_softmax(asc), axis=-1)
    drop = (cum <= 1 - top_p[:, None]).at[:, -1].set(False)                    # a prefix
    pth = jnp.take_along_axis(asc, drop.sum(-1)[:, None], axis=-1)             # [B, 1]
    return jnp.where(x >= jnp.maximum(kth, pth), x, -jnp.inf)


def process_logits(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Temperature, top-k, top-p, min-p on logits[B, V]; excluded tokens -> -inf.

    Greedy rows get temperature 1 and no filters (their result is unused by `sample`). The
    row maximum is subtracted before dividing, so a tiny temperature cannot overflow; the
    top token always survives, so every row keeps at least one finite entry.
    """
    greedy = t.temperature < SAMPLING_EPS
    temp = jnp.where(greedy, 1.0, t.temperature)[:, None]
    x = (logits - logits.max(-1, keepdims=True)) / temp
    top_k, top_p = jnp.where(greedy, 0, t.top_k), jnp.where(greedy, 1.0, t.top_p)
    x = jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1)), _top_k_top_p, lambda x, *_: x, x, top_k, top_p)
    probs = row_softmax(x)
    min_p = jnp.where(greedy, 0.0, t.min_p)[:, None]
    return jnp.where(probs < min_p * probs.max(-1, keepdims=True), -jnp.inf, x)


class TokenLogprobs(NamedTuple):
    """Raw logprobs (log-softmax of the unpenalized, untempered logits)."""

    logprob: jax.Array        # f32[B], of the chosen token
    rank: jax.Array           # i32[B], the chosen token's: the tokens at least as likely (vLLM's count, 1 = the top)
    top_ids: jax.Array        # i32[B, N], most likely first
    top_logprobs: jax.Array   # f32[B, N]


def argmax(x: jax.Array) -> jax.Array:
    """i32 `jnp.argmax(x, axis=-1)` (the first index of each row's maximum, or of its first NaN) as a max
    and a min: XLA:CPU's argmax reduction (value-index pairs) is slower on vocab-sized rows
    (docs/performance.md)."""
    m = x.max(-1, keepdims=True)
    hit = (x == m) | (jnp.isnan(x) & jnp.isnan(m))
    return jnp.min(jnp.where(hit, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)


def mask_padding(logits: jax.Array) -> jax.Array:
    """f32 logits with entries at the dtype's minimum (padded vocab) set to -inf."""
    pad = logits <= jnp.finfo(logits.dtype).min
    return jnp.where(pad, -jnp.inf, logits.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def sample(logits: jax.Array, tensors: SamplingTensors, step: int | jax.Array = 0,
           prompt_mask: jax.Array | None = None, output_counts: jax.Array | None = None,
           num_logprobs: int = 0, bias: jax.Array | None = None) -> tuple[jax.Array, TokenLogprobs]:
    """logits[B, V] -> (tokens i32[B], TokenLogprobs with N = num_logprobs).

    `step` (scalar or [B]) is folded into each row's key; pass each sequence's own output
    position so its draws depend only on its seed. Greedy rows take the argmax of the
    penalized logits. Penalties apply when `prompt_mask` or `output_counts` is given;
    `bias` f32[B, V] (logit_bias) is added before them, after the raw logprobs are taken.
    """
    logits = mask_padding(logits)                                              # [B, V]
    raw = row_log_softmax(logits)
    logits = logits if bias is None else logits + bias
    if prompt_mask is not None or output_counts is not None:
        prompt_mask = jnp.zeros(logits.shape, bool) if prompt_mask is None else prompt_mask
        output_counts = jnp.zeros(logits.shape, jnp.int32) if output_counts is None else output_counts
        logits = apply_penalties(logits, prompt_mask, output_counts, tensors)
    greedy = tensors.temperature < SAMPLING_EPS
    steps = jnp.broadcast_to(step, greedy.shape)
    keys = jax.vmap(jax.random.fold_in)(tensors.keys, steps)
    x = process_logits(logits, tensors)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, x.shape[-1:], x.dtype))(keys)
    drawn = argmax(x + gumbel)                  # jax.random.categorical's Gumbel-max draw: the same ids
    tokens = jnp.where(greedy, argmax(logits), drawn).astype(jnp.int32)
    return tokens, _logprobs(raw, tokens, num_logprobs)


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def greedy(logits: jax.Array, num_logprobs: int = 0, bias: jax.Array | None = None) -> tuple[jax.Array, TokenLogprobs]:
    """`sample` for a batch whose rows are all greedy and unpenalized: argmax, no PRNG, no sort."""
    logits = mask_padding(logits)
    tokens = argmax(logits if bias is None else logits + bias)
    return tokens, _logprobs(row_log_softmax(logits), tokens, num_logprobs)


def _logprobs(raw: jax.Array, tokens: jax.Array, n: int) -> TokenLogprobs:
    """The chosen tokens' raw logprobs, their ranks and the top n (n = -1: no row asked for logprobs, no ranks
    counted: a pass over the vocabulary saved on every such step)."""
    chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    rank = jnp.sum(raw >= chosen[:, None], axis=-1, dtype=jnp.int32) if n >= 0 else jnp.zeros_like(tokens)
    if n <= 0:
        b = raw.shape[0]
        return TokenLogprobs(chosen, rank, jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float32))
    top_logprobs, top_ids = jax.lax.top_k(raw, n)
    return TokenLogprobs(chosen, rank, top_ids.astype(jnp.int32), top_logprobs)
