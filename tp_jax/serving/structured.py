"""Structured outputs: vLLM's `StructuredOutputsParams`, compiled by llguidance into token matchers.

* `StructuredOutputsParams` — what a request constrains its output to: a JSON schema (`json`),
  any JSON object (`json_object`), a regex, one of a list of strings (`choice`) or a Lark /
  GBNF grammar (`grammar`); exactly one of them (vLLM's names and options).
* `GrammarCompiler` — the front door's half (it has the tokenizer): builds llguidance's token
  table once, turns params into a checked grammar (cached; a grammar llguidance refuses is a
  ValueError naming the problem) and makes one `Matcher` per sequence.
* `Matcher` — the engine's half, on token ids only: `fill(row)` writes the allowed-token
  bitmask of the next step (int32 words, bit `t % 32` of word `t // 32` for token t),
  `consume(token)` advances it, `done` says the grammar can take nothing more;
  `fill_bitmasks` fills a step's rows at once on llguidance's thread pool.
* `apply_bitmask` — the jitted device op: logits[..., V] -> -inf where the bit is 0.

The matcher lives on the engine's Request, so it survives preemption: a preempted request
keeps its outputs, which the matcher has already consumed, and only its KV is recomputed.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: set exactly one of json / regex / choice / grammar / json_object.

    `json` is a JSON schema (a dict or its JSON text); `grammar` a Lark grammar (llguidance's
    dialect) or a GBNF one; `disable_any_whitespace` emits compact JSON (no whitespace between
    tokens); `disable_additional_properties` treats objects as `additionalProperties: false`
    unless the schema says otherwise; `whitespace_pattern` is a regex for JSON's whitespace."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self):
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams: set exactly one of {', '.join(_KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"StructuredOutputsParams: json must be a JSON schema (a dict or JSON text), got "
                             f"{type(self.json).__name__}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("StructuredOutputsParams: regex must be a string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("StructuredOutputsParams: grammar must be a non-empty Lark or GBNF grammar string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"StructuredOutputsParams: choice must be a non-empty list of strings, got "
                                 f"{self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object not in (None, True, False):
            raise ValueError("StructuredOutputsParams: json_object must be a bool")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A stable text key (the compiled-grammar cache's)."""
        d = dataclasses.asdict(self)
        return json.dumps(d, sort_keys=True, default=list)

    def to_grammar(self) -> str:
        """llguidance's grammar text for these params (not yet checked)."""
        import llguidance
        from llguidance import LLMatcher
        kind = self.kind
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured outputs: json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured outputs: json must be a JSON schema object, got {schema!r:.80}")
            return LLMatcher.grammar_from_json_schema(schema, defaults=self._json_options())
        if kind == "regex":
            return LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", list(self.choice))
        return llguidance.grammar_from("grammar", self.grammar)

    def _json_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"whitespace_flexible": not self.disable_any_whitespace}
        if self.disable_any_whitespace:
            opts.update(item_separator=",", key_separator=":")
        if self.whitespace_pattern is not None:
            opts["whitespace_pattern"] = self.whitespace_pattern
        return opts


def no_additional_properties(schema):
    """A copy of a JSON schema where every object without `additionalProperties` gets `false`."""
    if isinstance(schema, list):
        return [no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: no_additional_properties(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


class Matcher:
    """One sequence's grammar state (an llguidance LLMatcher) on token ids."""

    def __init__(self, ll_matcher):
        self._m = ll_matcher

    def fill(self, row: np.ndarray) -> None:
        """Write the next step's allowed-token bitmask into `row` (int32[ceil(V / 32)], contiguous)."""
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)

    def consume(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar refused it (the matcher is then in error)."""
        return self._m.consume_token(int(token))

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar accepts from here (nothing consumed)."""
        return self._m.validate_tokens([int(t) for t in tokens]) if tokens else 0

    def fill_rows(self, draft: list[int], rows: np.ndarray) -> None:
        """A speculative row's masks: rows[i] the bitmask after draft[:i] (len(rows) == len(draft) + 1);
        the drafts, which `valid_prefix` accepted, are consumed and rolled back."""
        for i, token in enumerate(draft):
            self.fill(rows[i])
            self._m.consume_token(int(token))
        self.fill(rows[len(draft)])
        if draft:
            self._m.rollback(len(draft))

    @property
    def done(self) -> bool:
        """The grammar is complete and can take nothing more (but an end-of-sequence token)."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()

    def error(self) -> str:
        return self._m.get_error()


class GrammarCompiler:
    """Compiles StructuredOutputsParams against one tokenizer; thread-safe, grammars cached."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = 256):
        self.tokenizer, self.vocab_size = tokenizer, int(vocab_size)
        self.eos = sorted(int(t) for t in eos_token_ids)
        self._ll = None
        self._lock, self._cache_lock = threading.Lock(), threading.Lock()
        self._cache: dict[str, str] = {}
        self.cache_size = cache_size
        self.compile_seconds = 0.0

    @property
    def ll_tokenizer(self):
        """llguidance's token table (built once: its cost is in docs/performance.md)."""
        with self._lock:
            if self._ll is None:
                import llguidance.hf
                try:
                    self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                            eos_token=self.eos or None)
                except Exception as e:
                    raise ValueError(f"structured outputs need a fast (Rust) Hugging Face tokenizer; this "
                                     f"model's ({type(self.tokenizer).__name__}) cannot be used: {e}") from None
            return self._ll

    def grammar(self, params: StructuredOutputsParams) -> str:
        """The checked llguidance grammar for `params` (cached); ValueError naming what is wrong."""
        key = params.key()
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        from llguidance import LLMatcher
        t = time.perf_counter()
        if params.disable_additional_properties and params.json is not None:
            schema = params.json if isinstance(params.json, dict) else _loads(params.json)
            params = dataclasses.replace(params, json=no_additional_properties(schema),
                                         disable_additional_properties=False)
        try:
            grammar = params.to_grammar()
        except ValueError as e:
            raise ValueError(str(e) if str(e).startswith("structured outputs") else
                             f"structured outputs: the {params.kind} cannot be compiled: {e}") from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        self.compile_seconds += time.perf_counter() - t
        if is_error:
            raise ValueError(f"structured outputs: the {params.kind} cannot be compiled: {messages[0]}")
        with self._cache_lock:                           # the server's loop and the engine thread both compile
            if len(self._cache) >= self.cache_size:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = grammar
        return grammar

    def matcher(self, params: StructuredOutputsParams) -> Matcher:
        from llguidance import LLMatcher
        m = LLMatcher(self.ll_tokenizer, self.grammar(params), log_level=0)
        if m.is_error():
            raise ValueError(f"structured outputs: the {params.kind} cannot be compiled: {m.get_error()}")
        return Matcher(m)


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"structured outputs: json is not valid JSON: {e}") from None


_executor = None


def fill_bitmasks(rows: list[tuple[Matcher, int]], mask: np.ndarray) -> None:
    """Fill row `k` of mask[N, W] (int32, contiguous) for each (matcher, k): one row inline, several on
    llguidance's thread pool (it releases the GIL)."""
    global _executor
    if not rows:
        return
    if len(rows) == 1:
        m, k = rows[0]
        m.fill(mask[k])
        return
    if _executor is None:
        import llguidance
        _executor = llguidance.LLExecutor()
    from llguidance.numpy import fill_next_token_bitmask_par
    fill_next_token_bitmask_par(_executor, [(m._m, k) for m, k in rows], mask)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@jax.jit
def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits[..., V] with -inf where bit t of bitmask[..., ceil(V / 32)] is 0 (an all-ones row changes nothing)."""
    v = logits.shape[-1]
    bits = (bitmask[..., :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1       # [..., W, 32]
    allowed = bits.reshape(*bitmask.shape[:-1], -1)[..., :v].astype(bool)      # [..., V]
    return jnp.where(allowed, logits, jnp.asarray(-jnp.inf, logits.dtype))
