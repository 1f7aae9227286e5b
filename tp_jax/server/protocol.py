"""The OpenAI request and response shapes the server speaks (pydantic), and their sampling options.

* `CompletionRequest`, `ChatCompletionRequest` — what a client POSTs to `/v1/completions` and
  `/v1/chat/completions`: OpenAI's fields plus vLLM's extra fields (`top_k`, `min_p`, `min_tokens`,
  `repetition_penalty`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
  `prompt_logprobs`, `return_tokens_as_token_ids`, `skip_special_tokens`, `continue_final_message`, ...);
  completions' `echo` and `max_tokens: 0` as OpenAI and vLLM define them; chat's deprecated `functions` /
  `function_call`.
  Ranges are declared on the fields (OpenAI's and vLLM's limits), so a bad value is refused (400)
  before anything runs. Unknown fields are accepted and not used, as vLLM does (logged once per
  name); vLLM's fields that would change the answer and are not implemented here are accepted only
  at their neutral value (`use_beam_search=false`, `suffix`, ...).
* `sampling_params(request, max_tokens)` — the engine's `SamplingParams` for a request.
* `response_format`, `structured_outputs`, `tools`, `tool_choice` — see tp_jax/server/constraints.py.
* The error body is tp_jax/server/openapi.py `ErrorResponse`.

Responses are built as plain dicts in OpenAI's layout (see tp_jax/server/responses.py).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tp_jax.server.constraints import (FunctionDefinition, FunctionName, NamedToolChoice, ResponseFormat,
                                       StructuredOutputsRequest, Tool)
from tp_jax.serving.engine_args import default
from tp_jax.serving.sampling import SamplingParams
from tp_jax.serving.structured import StructuredOutputsParams

log = logging.getLogger("tp_jax.server")

MAX_LOGPROBS = default("max_logprobs")    # EngineArgs' (the server's engines keep the default: no flag)
MAX_STOP = 4                # stop strings per request (OpenAI's limit)

class FieldError(ValueError):
    """A request refused for one field: `param` names it in the error body (app.describe_validation)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


_Prob = Annotated[float, Field(gt=0.0, le=1.0)]
_Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False           # vLLM: usage in every chunk too


# vLLM's request fields that change the answer and that this server does not implement: accepted at their neutral
# value only (a request vLLM serves differently is refused rather than answered otherwise)
NEUTRAL = {"use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True,
           "truncate_prompt_tokens": None, "allowed_token_ids": None, "bad_words": [], "logits_processors": None,
           "priority": 0, "guided_json": None, "guided_regex": None,
           "guided_choice": None, "guided_grammar": None, "structural_tag": None, "chat_template": None,
           "logprob_token_ids": None, "repetition_detection": None, "return_token_ids": None,
           "return_prompt_text": None, "return_token_offsets": None, "return_mm_kwargs": None,
           "thinking_token_budget": None, "truncation_side": None, "prompt_embeds": None, "watermarking": None,
           "mm_payload": None, "media_io_kwargs": None, "include_reasoning": True}
# fields OpenAI or vLLM define that cannot change the answer: accepted and not used
IGNORED = ("user", "store", "metadata", "service_tier", "request_id", "cache_salt", "kv_transfer_params",
           "vllm_xargs", "mm_processor_kwargs", "guided_decoding_backend", "guided_whitespace_pattern",
           "prediction", "modalities", "audio", "web_search_options", "safety_identifier", "prompt_cache_key",
           "verbosity", "session_id", "routed_experts_prompt_start", "ec_transfer_params", "stream_interval")
_logged: set[str] = set()


def log_ignored_once(names) -> None:
    """Say once per field name that a request field is accepted and not used (vLLM logs them per request)."""
    new = sorted(set(names) - _logged)
    if new:
        _logged.update(new)
        log.warning("request fields accepted and not used by this server (said once): %s", ", ".join(new))


class RequestBody(BaseModel):
    """vLLM's rule for fields it does not know: accepted and not used (logged), never refused; its own fields
    that would change the answer are refused unless at their neutral value (`NEUTRAL`)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _extras(self):
        extra = dict(self.model_extra or {})
        for name, neutral in NEUTRAL.items():
            value = extra.get(name)
            if name in extra and value not in (neutral, None) and (neutral not in (None, False, []) or value):
                raise FieldError(name, f"{name}={extra.pop(name)!r} is not supported by this server; leave it out "
                                 f"(or send {neutral!r})")
        log_ignored_once(extra)
        return self


class _Sampling(RequestBody):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras."""

    model: str | None = None                      # None: the served model
    n: Annotated[int, Field(ge=1, le=128)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None       # None: 1.0 (OpenAI's default)
    top_p: _Prob | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: _Penalty = 0.0
    frequency_penalty: _Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None   # token id -> bias
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None     # sample best_of, answer the n most likely
    # vLLM's extra sampling fields
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None    # per prompt token, + top-N
    return_tokens_as_token_ids: bool | None = None     # logprobs name tokens "token_id:<id>"
    skip_special_tokens: bool = True               # False: the text keeps the special tokens the model wrote
    # structured outputs (tp_jax/server/constraints.py): OpenAI's response_format, vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    @model_validator(mode="after")
    def _limits(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed with stream=true")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise FieldError("stop", f"stop has {len(self.stop)} strings; at most {MAX_STOP} are allowed "
                                     f"(OpenAI's limit)")
        if self.best_of is not None and self.best_of < self.n:
            raise FieldError("best_of", f"best_of={self.best_of} is less than n={self.n}: it must be at least n")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise FieldError("best_of", f"best_of={self.best_of} > n={self.n} cannot stream (the best are known only "
                                        f"at the end); leave out stream or best_of")
        bad = [k for k in self.logit_bias or () if not k.isdigit()]
        if bad:
            raise FieldError("logit_bias", f"logit_bias keys must be token ids (strings of digits, e.g. "
                                           f"\"50256\"); got {bad[0]!r}")
        return self

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or a list of token-id lists."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16             # OpenAI's default; 0: echo / score only
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False                             # the prompt before the completion (tp_jax/server/echo.py)
    suffix: str | None = None
    add_special_tokens: bool = True                # vLLM: the tokenizer's BOS etc. around a text prompt

    @model_validator(mode="after")
    def _unsupported(self):
        if self.suffix:
            raise FieldError("suffix", "suffix is not supported by this server; leave it out")
        if isinstance(self.prompt, list) and not self.prompt:
            raise FieldError("prompt", "prompt is an empty list; give a string, token ids, or a list of them")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @property
    def top_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """What the engine scores: `prompt_logprobs`, else with echo `logprobs` (vLLM's rule); echo with
        max_tokens=0 and neither still needs a prefill-only request (0)."""
        if self.prompt_logprobs is not None:
            return max(self.prompt_logprobs, self.logprobs or 0) if self.echo else self.prompt_logprobs
        if self.echo and (self.logprobs is not None or self.max_tokens == 0):
            return self.logprobs or 0
        return None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")       # name, tool_call_id, ... pass to the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        text = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        return {**(self.model_extra or {}), "role": self.role, "content": text or ""}


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions; the prompt is the tokenizer's chat template over `messages`."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None   # None: auto with tools
    parallel_tool_calls: bool | None = None        # accepted; a model may make several calls
    reasoning_effort: Literal["low", "medium", "high"] | None = None      # a template variable (gpt-oss reads it)
    # OpenAI's deprecated form of tools: answered in its own form (message.function_call)
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | FunctionName | None = None
    # vLLM's extras
    add_generation_prompt: bool = True             # end the prompt with the assistant's turn
    continue_final_message: bool = False           # the last (assistant) message left open: the answer continues it
    add_special_tokens: bool = False               # the tokenizer's BOS etc. on top of the template's
    documents: list[dict[str, str]] | None = None  # for a template that renders them (RAG)
    chat_template_kwargs: dict[str, Any] | None = None     # the template's variables (e.g. Qwen3's enable_thinking)
    echo: bool = False                             # the last message, when the assistant's, before each answer

    @property
    def echo_text(self) -> str:
        """What `echo` puts before each answer (vLLM's rule): the last message's text when it is the assistant's
        (the answer's own role), else nothing."""
        last = self.messages[-1]
        return last.for_template()["content"] if self.echo and last.role == "assistant" else ""

    @model_validator(mode="before")
    @classmethod
    def _legacy_functions(cls, data):
        """`functions` / `function_call` as `tools` / `tool_choice` (the answer keeps the legacy form)."""
        if not isinstance(data, dict) or data.get("functions") is None:
            return data
        if data.get("tools") is not None:
            raise ValueError("send either tools or the deprecated functions, not both")
        call = data.get("function_call")
        choice = {"type": "function", "function": call} if isinstance(call, dict) else call
        return {**data, "tools": [{"type": "function", "function": f} for f in data["functions"]],
                "tool_choice": choice}

    @model_validator(mode="after")
    def _unsupported(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message", "continue_final_message=true continues the last message, so "
                             "it cannot take add_generation_prompt=true (the default) too: send "
                             "add_generation_prompt=false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise FieldError("continue_final_message", f"continue_final_message=true continues the last message, "
                             f"which must be the assistant's; it is the {self.messages[-1].role}'s")
        names = [t.function.name for t in self.tools or ()]
        if self.tool_choice not in (None, "none") and not names:
            raise FieldError("tool_choice", f"tool_choice={self.tool_choice_name!r} needs tools; send tools or leave "
                                            f"tool_choice out")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise FieldError("tool_choice", f"tool_choice names the function {self.tool_choice.function.name!r}, "
                                            f"which is not among the tools ({', '.join(map(repr, names))})")
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs=true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise FieldError("max_completion_tokens", f"max_tokens={self.max_tokens} and max_completion_tokens="
                                                      f"{self.max_completion_tokens} disagree; send only "
                                                      f"max_completion_tokens")
        return self

    @property
    def tool_choice_name(self) -> str:
        """ "none", "auto", "required" or "named" (tools with no tool_choice: "auto", as OpenAI)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]


def requested_logprobs(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    """Top-N logprobs per token the engine must return (None: no logprobs)."""
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs


def _engine_logprobs(r: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The logprobs the engine computes: the requested ones, or 0 for best_of > n, which ranks its samples by
    cumulative_logprob (None without logprobs, as in vLLM); the answer shows only the requested ones."""
    n = requested_logprobs(r)
    return 0 if n is None and (r.best_of or 0) > r.n else n


def sampling_params(request: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                    structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    """The engine's SamplingParams (ValueError naming the field if the engine refuses a value);
    `structured_outputs`: the answer's constraint (constraints.request_constraint)."""
    r = request
    return SamplingParams(
        n=max(r.n, r.best_of or 0), max_tokens=max_tokens, temperature=1.0 if r.temperature is None else r.temperature,
        top_p=1.0 if r.top_p is None else r.top_p, top_k=r.top_k or 0, min_p=r.min_p or 0.0,
        repetition_penalty=1.0 if r.repetition_penalty is None else r.repetition_penalty,
        presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty, seed=r.seed,
        stop=r.stop, stop_token_ids=r.stop_token_ids, ignore_eos=r.ignore_eos,
        logprobs=_engine_logprobs(r), include_stop_str_in_output=r.include_stop_str_in_output,
        prompt_logprobs=r.engine_prompt_logprobs if isinstance(r, CompletionRequest) else r.prompt_logprobs,
        structured_outputs=structured_outputs, min_tokens=r.min_tokens,
        logit_bias={int(k): v for k, v in (r.logit_bias or {}).items()}, skip_special_tokens=r.skip_special_tokens)


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's `POST /v1/load_lora_adapter` body (a server started with --allow-runtime-lora-updating)."""
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's `POST /v1/unload_lora_adapter` body."""
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None
