"""vLLM's extra endpoints beside the OpenAI API: `/tokenize`, `/detokenize`, `/version`, `/ping`.

    POST /tokenize    {"prompt": "Hi"}                        -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /tokenize    {"messages": [...], "tools"?, ...}      -> the chat completion's prompt ids, same shape
    POST /detokenize  {"tokens": [...]}                        -> {"prompt": text}
    GET  /version                                             -> {"version": tp_jax's version}
    GET|POST /ping                                            -> 200 (SageMaker's health check; 503: engine failed)

`/tokenize` takes vLLM's two bodies as one object: the completion form (`prompt`; `add_special_tokens`
defaults to true) or the chat form (`messages`; `add_special_tokens` defaults to false, the template adds
them). The chat form goes through `Handler.chat_prompt`, the very path a chat completion takes, so its ids
are what the engine would be fed. `token_strs` (with `return_token_strs`) are the tokenizer's token
strings (`convert_ids_to_tokens`), as vLLM returns them. Like vLLM, these routes sit outside `/v1`, so an
API key does not guard them. An unknown `model` is 404 `model_not_found`, as on the completion routes.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, model_validator

from tp_jax.server.constraints import Tool
from tp_jax.server.handlers import APIError, Handler
from tp_jax.server.protocol import ChatMessage, RequestBody
from tp_jax.server.responses import tp_jax_version

_CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")


class TokenizeRequest(RequestBody):
    """`POST /tokenize`: vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None          # None: true with prompt, false with messages (vLLM's defaults)
    return_token_strs: bool | None = False
    # the chat form's, as /v1/chat/completions takes them
    add_generation_prompt: bool | None = None       # None: true unless continue_final_message
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None

    @model_validator(mode="after")
    def _one_form(self):
        if (self.prompt is None) == (self.messages is None):
            got = "both prompt and messages" if self.prompt is not None else "neither prompt nor messages"
            raise ValueError(f"/tokenize got {got}: send one, `prompt` (text) or `messages` (a chat, tokenized "
                             f"through the chat template)")
        if self.prompt is not None:
            extra = [f for f in _CHAT_ONLY if f in self.model_fields_set]
            if extra:
                one = len(extra) == 1
                raise ValueError(f"{', '.join(extra)} {'applies' if one else 'apply'} to the chat form only "
                                 f"(messages); remove {'it' if one else 'them'} or send messages instead of prompt")
            if self.add_special_tokens is None:
                self.add_special_tokens = True
            return self
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the first "
                             "leaves the last message open, the second starts a new assistant turn; set one")
        if self.add_generation_prompt is None:
            self.add_generation_prompt = not self.continue_final_message
        if self.add_special_tokens is None:
            self.add_special_tokens = False
        return self

    def conversation(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler) -> dict:
        """The document shows vLLM's two bodies (anyOf), each derived from this model's fields: a generated
        client or fuzzer then sends one form or the other, as the server wants."""
        props = handler.resolve_ref_schema(handler(core_schema))["properties"]
        required = lambda p: next(s for s in p.get("anyOf", [p]) if s.get("type") != "null")
        form = lambda title, fields, key: {
            "title": title, "type": "object", "additionalProperties": False, "required": [key],
            "properties": {f: required(props[f]) if f == key else props[f] for f in fields}}
        return {"title": "TokenizeRequest", "description": cls.__doc__, "anyOf": [
            form("TokenizeCompletionRequest", ("model", "prompt", "add_special_tokens", "return_token_strs"), "prompt"),
            form("TokenizeChatRequest", [f for f in props if f != "prompt"], "messages")]}


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestBody):
    """`POST /detokenize`: token ids -> text."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def tokenize(handler: Handler, req: TokenizeRequest) -> TokenizeResponse:
    handler.served(req.model)
    tokenizer = _tokenizer(handler, "messages" if req.messages is not None else "prompt")
    if req.messages is not None:
        ids = handler.chat_prompt(req)
    else:
        ids = list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    strs = list(tokenizer.convert_ids_to_tokens(ids)) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=handler.max_model_len, tokens=ids, token_strs=strs)


def detokenize(handler: Handler, req: DetokenizeRequest) -> DetokenizeResponse:
    handler.served(req.model)
    tokenizer = _tokenizer(handler, "tokens")
    vocab = len(tokenizer)
    bad = [(i, t) for i, t in enumerate(req.tokens) if t >= vocab]
    if bad:
        where = ", ".join(f"tokens[{i}]={t}" for i, t in bad[:5]) + (" ..." if len(bad) > 5 else "")
        one = len(bad) == 1
        raise APIError(400, f"{where} {'is not a token id' if one else 'are not token ids'} of this model's tokenizer: "
                            f"ids run from 0 to {vocab - 1}; remove or replace {'it' if one else 'them'}",
                       param="tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(req.tokens))


def _tokenizer(handler: Handler, param: str):
    if handler.tokenizer is None:
        raise APIError(400, "this model has no tokenizer files, so the server cannot tokenize or detokenize; serve "
                            "a checkpoint that has them", param=param)
    return handler.tokenizer


def add_routes(app: FastAPI, handler: Handler, health) -> None:
    """Register the module's routes; `health()` is the app's /health answer (reused by /ping)."""

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        return tokenize(handler, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        return detokenize(handler, body)

    @app.get("/version")
    async def version_route() -> VersionResponse:
        return VersionResponse(version=tp_jax_version())

    async def ping() -> Response:
        answer = await health()
        return answer if isinstance(answer, JSONResponse) else Response(status_code=200)

    app.get("/ping", operation_id="ping_get")(ping)
    app.post("/ping", operation_id="ping_post")(ping)


__all__ = ["TokenizeRequest", "TokenizeResponse", "DetokenizeRequest", "DetokenizeResponse", "add_routes",
           "tokenize", "detokenize", "tp_jax_version"]
