"""The OpenAI request and response shapes the server speaks (pydantic), and their sampling options.

* `CompletionRequest`, `ChatCompletionRequest` — what a client POSTs to `/v1/completions` and
  `/v1/chat/completions`: OpenAI's fields plus vLLM's extra sampling fields (`top_k`, `min_p`,
  `repetition_penalty`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
  `prompt_logprobs`); completions' `echo` and `max_tokens: 0` as OpenAI and vLLM define them.
  Ranges are declared on the fields, so a bad value is refused (400) before anything runs;
  unknown fields are refused too, naming the field. OpenAI fields this server does not
  implement are accepted only at their neutral value (`logit_bias={}`, `suffix`, ...).
* `sampling_params(request, max_tokens)` — the engine's `SamplingParams` for a request.
* `response_format`, `structured_outputs`, `tools`, `tool_choice` — see tp_jax/server/constraints.py.
* The error body is tp_jax/server/openapi.py `ErrorResponse`.

Responses are built as plain dicts in OpenAI's layout (see tp_jax/server/responses.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tp_jax.server.constraints import NamedToolChoice, ResponseFormat, StructuredOutputsRequest, Tool
from tp_jax.serving.sampling import SamplingParams
from tp_jax.serving.structured import StructuredOutputsParams

MAX_LOGPROBS = 20           # the engine's max_logprobs (EngineConfig)

_Prob = Annotated[float, Field(gt=0.0, le=1.0)]
_Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None                      # None: the served model
    n: Annotated[int, Field(ge=1, le=128)] = 1
    temperature: Annotated[float, Field(ge=0.0)] | None = None       # None: 1.0 (OpenAI's default)
    top_p: _Prob | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: _Penalty = 0.0
    frequency_penalty: _Penalty = 0.0
    user: str | None = None                        # accepted, not used
    logit_bias: dict[str, float] | None = None     # only empty: refused otherwise
    # vLLM's extra sampling fields
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None    # per prompt token, + top-N
    # structured outputs (tp_jax/server/constraints.py): OpenAI's response_format, vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    @model_validator(mode="after")
    def _neutral_only(self):
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server; remove it")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise ValueError(f"stop has {len(self.stop)} strings; at most 16 are allowed")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or a list of token-id lists."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16             # OpenAI's default; 0: echo / score only
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False                             # the prompt before the completion (tp_jax/server/echo.py)
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _unsupported(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported (only best_of = n); leave it out")
        if self.suffix:
            raise ValueError("suffix is not supported by this server; leave it out")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is an empty list; give a string, token ids, or a list of them")
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
    add_generation_prompt: bool = True             # vLLM's extra: end with the assistant's turn

    @model_validator(mode="after")
    def _unsupported(self):
        names = [t.function.name for t in self.tools or ()]
        if self.tool_choice not in (None, "none") and not names:
            raise ValueError(f"tool_choice={self.tool_choice_name!r} needs tools; send tools or leave tool_choice out")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {self.tool_choice.function.name!r}, which is not "
                             f"among the tools ({', '.join(map(repr, names))})")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError(f"max_tokens={self.max_tokens} and max_completion_tokens={self.max_completion_tokens} "
                             f"disagree; send only max_completion_tokens")
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


def sampling_params(request: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                    structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    """The engine's SamplingParams (ValueError naming the field if the engine refuses a value);
    `structured_outputs`: the answer's constraint (constraints.request_constraint)."""
    r = request
    return SamplingParams(
        n=r.n, max_tokens=max_tokens, temperature=1.0 if r.temperature is None else r.temperature,
        top_p=1.0 if r.top_p is None else r.top_p, top_k=r.top_k or 0, min_p=r.min_p or 0.0,
        repetition_penalty=1.0 if r.repetition_penalty is None else r.repetition_penalty,
        presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty, seed=r.seed,
        stop=r.stop, stop_token_ids=r.stop_token_ids, ignore_eos=r.ignore_eos,
        logprobs=requested_logprobs(r), include_stop_str_in_output=r.include_stop_str_in_output,
        prompt_logprobs=r.engine_prompt_logprobs if isinstance(r, CompletionRequest) else r.prompt_logprobs,
        structured_outputs=structured_outputs)


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
