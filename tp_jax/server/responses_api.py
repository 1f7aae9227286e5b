"""The OpenAI Responses API on the chat path: `POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`,
`POST /v1/responses/{id}/cancel`.

    app.include_router(responses_router(ResponsesAPI(handler), unless_disconnected))

* `ResponsesRequest` — what a client POSTs: `input` (a string, or message / `function_call` /
  `function_call_output` items), `instructions`, `max_output_tokens`, `temperature`, `top_p`, flat
  function `tools`, `tool_choice`, `parallel_tool_calls`, `text.format` (structured outputs),
  `include: ["message.output_text.logprobs"]` with `top_logprobs`, `store`, `previous_response_id`,
  vLLM's extra sampling fields; `metadata`, `user`, `reasoning`, `truncation`, `service_tier`, ...
  are accepted and echoed. Hosted tools, images and files, `background`, `prompt` and
  `conversation` are refused (400, naming the field).
* `to_chat(request, messages)` — the chat completion request it is: `instructions` the system
  message, the items chat messages (a `function_call` an assistant's tool call, a
  `function_call_output` a tool message), `text.format` the `response_format`. The chat handler
  templates, constrains and runs it; tp_jax/server/responses_output.py turns its answer (or its
  stream of chunks) into the Response and its events.
* `ResponseStore` — stored responses (`store`, default true, as OpenAI) in memory, the last
  STORE_SIZE (least recently used dropped first), each with its conversation: a request with
  `previous_response_id` continues it (its input after the earlier turns; the earlier
  `instructions` are not carried over, as OpenAI). An unknown id is 404.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tp_jax.server.handlers import APIError, Handler, Job
from tp_jax.server.protocol import MAX_LOGPROBS, ChatCompletionRequest, log_ignored_once
from tp_jax.server.responses_output import Events, as_messages, output_items, response_object

STORE_SIZE = 1000
LOGPROBS = "message.output_text.logprobs"
INCLUDES = (LOGPROBS, "reasoning.encrypted_content", "code_interpreter_call.outputs", "file_search_call.results",
            "computer_call_output.output.image_url", "message.input_image.image_url", "web_search_call.results",
            "web_search_call.action.sources")       # all but the first concern hosted tools or images: no effect
# chat field -> Responses field, for the chat path's errors
RENAMED = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
TEXT_PARTS = ("input_text", "output_text")


# --- the request -------------------------------------------------------------------------------------------
class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")       # output_text's annotations / logprobs, passed back
    type: Literal["input_text", "output_text"]
    text: str


class InputItem(BaseModel):
    """One `input` item: a message ({"role", "content"}, type "message" or none), a `function_call` (an
    earlier answer's), a `function_call_output` (its result) or a `reasoning` item (skipped). Fields a
    client passes back from an earlier output (id, status, annotations, ...) are ignored."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[TextPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[TextPart] | None = None

    @model_validator(mode="before")
    @classmethod
    def _skipped(cls, data):
        return {"type": "reasoning"} if isinstance(data, dict) and data.get("type") == "reasoning" else data

    @model_validator(mode="after")
    def _complete(self):
        need = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
                "function_call_output": ("call_id", "output")}.get(self.type, ())
        missing = [f for f in need if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.type} item needs {', '.join(missing)}")
        return self


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {"name": self.name or "response", "schema": self.schema_,
                                                        "description": self.description, "strict": self.strict}}


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None     # accepted, not used (the model decides)


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class ResponsesRequest(BaseModel):
    """POST /v1/responses (OpenAI's fields, then vLLM's extra sampling fields); other fields are accepted and
    logged once by name, as on the other routes and in vLLM."""
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    tools: list[FunctionTool] = []
    tool_choice: Literal["none", "auto", "required"] | NamedFunction = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    include: list[Literal[INCLUDES]] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None          # accepted, echoed: the model decides how it reasons
    truncation: Literal["auto", "disabled"] = "disabled"   # auto: a conversation too long is still refused
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None     # accepted: one turn makes its calls at once
    background: bool = False
    stream_options: dict[str, Any] | None = None     # include_obfuscation: accepted, no effect
    prompt_cache_key: str | None = None              # accepted, as vLLM (the prefix cache needs no key)
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # vLLM's extra fields
    request_id: str | None = None                    # the response's id
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data):
        """What this server cannot do, refused by name (before the field types are checked)."""
        if not isinstance(data, dict):
            return data
        for field, why in (("background", "responses run while the request waits; leave background out"),
                           ("prompt", "prompt templates are not supported (as vLLM); send input"),
                           ("conversation", "conversations are not stored; use previous_response_id")):
            if data.get(field):
                raise ValueError(f"{field}: {why}")
        for i, tool in enumerate(data.get("tools") or ()):
            if isinstance(tool, dict) and tool.get("type", "function") != "function":
                raise ValueError(f"tools[{i}]: type {tool['type']!r} is a hosted tool, which this server does not "
                                 f"run; send function tools ({{\"type\": \"function\", \"name\", \"parameters\"}})")
        choice = data.get("tool_choice", "auto")
        named = isinstance(choice, dict) and choice.get("type") == "function"
        if not (named or choice in ("none", "auto", "required")):
            raise ValueError(f"tool_choice {choice!r} is not supported; send \"none\", \"auto\", \"required\" or "
                             f"{{\"type\": \"function\", \"name\": ...}}")
        items = data.get("input")
        if "input" in data and not isinstance(items, (str, list)):
            raise ValueError(f"input must be a string or a list of items (messages {{\"role\", \"content\"}}, "
                             f"function_call, function_call_output); got {type(items).__name__}")
        for i, item in enumerate(items if isinstance(items, list) else ()):
            _check_item(i, item)
        return data

    @model_validator(mode="after")
    def _consistent(self):
        log_ignored_once(self.model_extra or {})
        if isinstance(self.tool_choice, NamedFunction) and self.tool_choice.name not in [t.name for t in self.tools]:
            raise ValueError(f"tool_choice names the function {self.tool_choice.name!r}, which is not among the "
                             f"tools ({', '.join(repr(t.name) for t in self.tools) or 'none'})")
        if self.metadata is not None and len(self.metadata) > 16:
            raise ValueError(f"metadata has {len(self.metadata)} keys; at most 16 are allowed")
        fmt = self.text and self.text.format
        if fmt and fmt.type == "json_schema" and fmt.schema_ is None:
            raise ValueError('text.format: type "json_schema" needs "name" and "schema": {"type": "json_schema", '
                             '"name": ..., "schema": {...}}')
        if fmt and fmt.type != "text" and self.structured_outputs:
            raise ValueError("text.format and structured_outputs each constrain the answer; send only one of them")
        return self

    @property
    def logprobs(self) -> bool:
        return LOGPROBS in (self.include or ())

    def text_config(self) -> dict | None:
        """The Response's `text`: the request's, or null when it sent none (as vLLM)."""
        if self.text is None or (self.text.format is None and self.text.verbosity is None):
            return None
        fmt = self.text.format
        return {"format": None if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True),
                "verbosity": self.text.verbosity}

    def tool_choice_echo(self) -> str | dict:
        return self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedFunction) else self.tool_choice


def _check_item(i: int, item) -> None:
    """An input item's problem as one message naming it (pydantic's, for a union, would name the members)."""
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if kind not in ITEM_TYPES:
        raise ValueError(f"input[{i}]: {'items of type ' + repr(kind) if kind else 'an item'} is not supported; "
                         f"send messages ({{\"role\", \"content\"}}), function_call or function_call_output items")
    for j, part in enumerate(item.get("content") if kind == "message" and isinstance(item.get("content"), list)
                             else ()):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            what = part.get("type") if isinstance(part, dict) else part
            raise ValueError(f"input[{i}].content[{j}]: {what!r} parts are not supported: this server's models read "
                             f"text; send {{\"type\": \"input_text\", \"text\": ...}} parts")
    try:
        InputItem.model_validate(item)
    except ValidationError as e:
        err = max(e.errors(), key=lambda x: len(x["loc"]))       # a union's: the member that came closest
        loc = [x for x in err["loc"] if x not in ("str", "list[TextPart]")]       # union members' names
        where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc)
        raise ValueError(f"input[{i}]{where}: {err['msg'].removeprefix('Value error, ')}") from None


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def conversation(req: ResponsesRequest, earlier: list[dict]) -> list[dict]:
    """The chat messages of a request without its instructions: the earlier turns, then `input`."""
    msgs = [dict(m) for m in earlier]
    for item in [InputItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input:
        if item.type == "message":
            msgs.append({"role": item.role, "content": _text(item.content)})
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if msgs and msgs[-1]["role"] == "assistant":          # the same turn's text, or its other calls
                msgs[-1] = {**msgs[-1], "tool_calls": [*msgs[-1].get("tool_calls", ()), call]}
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif item.type == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return msgs


def to_chat(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat completion request a Responses request is (APIError 400 if the chat path refuses it)."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    fmt = req.text.format if req.text and req.text.format and req.text.format.type != "text" else None
    fields = {"model": req.model, "messages": system + messages, "max_completion_tokens": req.max_output_tokens,
              "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
              "stream_options": {"include_usage": True} if req.stream else None, "user": req.user,
              "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                        for t in req.tools] or None,
              "tool_choice": None if not req.tools and req.tool_choice == "auto" else
              {"type": "function", "function": {"name": req.tool_choice.name}}
              if isinstance(req.tool_choice, NamedFunction) else req.tool_choice,
              "parallel_tool_calls": req.parallel_tool_calls, "response_format": fmt and fmt.response_format(),
              "logprobs": req.logprobs, "top_logprobs": req.top_logprobs if req.logprobs else None,
              **req.model_dump(include={"top_k", "min_p", "repetition_penalty", "seed", "stop", "ignore_eos",
                                        "include_stop_str_in_output", "structured_outputs"})}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise renamed(APIError(400, f"{where + ': ' if where else ''}{err['msg'].removeprefix('Value error, ')}",
                               param=str(err["loc"][0]) if err["loc"] else None)) from None


def renamed(e: APIError) -> APIError:
    """A chat-path error in the Responses API's field names."""
    message = e.message
    for chat, ours in RENAMED.items():
        message = message.replace(chat, ours)
    return APIError(e.status, message, type=e.type, param=RENAMED.get(e.param, e.param), code=e.code)


# --- running it --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    request: ResponsesRequest
    job: Job
    id: str
    created_at: int
    model: str
    messages: list[dict]            # the conversation without instructions (what a follow-up continues)


@dataclasses.dataclass
class Stored:
    response: dict
    conversation: list[dict]        # the run's messages and its answer


class ResponseStore:
    """The last `size` stored responses, least recently used dropped first."""

    def __init__(self, size: int = STORE_SIZE):
        self.size, self.items = size, collections.OrderedDict()

    def put(self, stored: Stored) -> None:
        self.items[stored.response["id"]] = stored
        self.items.move_to_end(stored.response["id"])
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> Stored:
        stored = self.items.get(response_id)
        if stored is None:
            raise APIError(404, f"Response with id '{response_id}' not found: it was never stored (store=false), "
                                f"was deleted, or is older than the last {self.size} this server keeps",
                           param=param)
        self.items.move_to_end(response_id)
        return stored

    def pop(self, response_id: str) -> Stored:
        stored = self.get(response_id)
        del self.items[response_id]
        return stored


class ResponsesAPI:
    def __init__(self, handler: Handler, store_size: int = STORE_SIZE):
        self.handler, self.store = handler, ResponseStore(store_size)

    def start(self, req: ResponsesRequest) -> Run:
        """The run of a request, checked (APIError 400 / 404 before anything is queued)."""
        earlier = [] if req.previous_response_id is None else \
            self.store.get(req.previous_response_id, "previous_response_id").conversation
        messages = conversation(req, earlier)
        try:
            job = self.handler.chat_job(to_chat(req, messages))
        except APIError as e:
            raise renamed(e) from None
        rid = req.request_id or f"resp_{job.id.removeprefix('chatcmpl-')}"
        return Run(req, job, rid, job.created, job.model, messages)

    async def full(self, run: Run) -> dict:
        body = await self.handler.full(run.job)
        choice = body["choices"][0]
        output = output_items(choice["message"], choice["finish_reason"], choice.get("logprobs"))
        return self._keep(run, response_object(run, output, choice["finish_reason"], body["usage"]))

    async def stream(self, run: Run):
        """The server-sent events; closing it early aborts the engine request."""
        events, finish, usage = Events(run), None, None
        for e in events.start():
            yield e
        async with contextlib.aclosing(self.handler.chunks(run.job)) as chunks:
            async for chunk in chunks:
                if "error" in chunk:
                    for e in events.failed(chunk["error"]):
                        yield e
                    return
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    finish = choice.get("finish_reason") or finish
                    for e in events.delta(choice):
                        yield e
        closing, response = events.finish(finish, usage)
        self._keep(run, response)
        for e in closing:
            yield e

    def _keep(self, run: Run, response: dict) -> dict:
        if run.request.store:
            self.store.put(Stored(response, run.messages + as_messages(response["output"])))
        return response

    def cancel(self, response_id: str) -> dict:
        self.store.get(response_id)
        raise APIError(400, "Cannot cancel a synchronous response: only background responses can be cancelled, "
                            "and this server runs none (it answers when the response is done)", param="response_id")


def responses_router(api: ResponsesAPI, unless_disconnected) -> APIRouter:
    """The routes; `unless_disconnected(request, coro)` awaits coro unless the client leaves first (app.py)."""
    router = APIRouter()

    @router.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        run = api.start(body)
        if body.stream:
            return StreamingResponse(api.stream(run), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(await unless_disconnected(request, api.full(run)))

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return api.store.get(response_id).response

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        api.store.pop(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return api.cancel(response_id)

    return router
