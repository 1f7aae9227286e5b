"""The OpenAPI document of the server, as it really answers (for generated clients and API fuzzers).

FastAPI documents a 422 validation error for every route with a body; this server answers
every bad request with 400 and OpenAI's error body (`app.py`), and 401 on `/v1/` routes when
started with an API key. `install_openapi(app, authenticated=...)` replaces `app.openapi` with a
document that drops the 422s and the validation-error schemas, and lists per route the statuses
of `RESPONSES`, each error with the `ErrorResponse` schema; with a key, the `/v1/` routes
declare bearer authentication. Streaming routes also list `text/event-stream` for 200,
`/metrics` answers `text/plain` (Prometheus' format) and `/ping`'s 200 has no body.
"""

from __future__ import annotations

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""
    error: ErrorDetail


BAD_REQUEST = "the request is invalid (a field, its type or value, a prompt too long): " \
              "the message names the field and the fix"
NOT_FOUND = "the `model` is neither the served model nor a served LoRA adapter (code model_not_found)"
INTERNAL = "the request failed inside the server (a failed engine); OpenAI's error body"
UNAUTHORIZED = "no API key, or the wrong one: send `Authorization: Bearer <key>`"
STREAM = "with `stream: true`, server-sent events: `data: {chunk}` lines, then `data: [DONE]`"
EVENTS = "with `stream: true`, server-sent events: `event: <type>` and `data: {event}` per event, " \
         "`response.created` first, `response.completed` (or `.incomplete`, `.failed`) last"
NO_RESPONSE = "no stored response has this id (stored with store=false, deleted, or dropped: the server keeps " \
              "the last 1000)"

# path -> method -> {status: description}; statuses other than 200 carry ErrorResponse
RESPONSES = {
    "/v1/completions": {"post": {400: BAD_REQUEST, 404: NOT_FOUND, 500: INTERNAL}},
    "/v1/chat/completions": {"post": {400: BAD_REQUEST, 404: NOT_FOUND, 500: INTERNAL}},
    "/v1/models": {"get": {}},
    "/v1/load_lora_adapter": {"post": {400: "runtime LoRA updating is off, the name is taken, or the adapter is "
                                            "refused (its message names why)", 500: INTERNAL}},
    "/v1/unload_lora_adapter": {"post": {400: "runtime LoRA updating is off", 404: "no adapter of that name is "
                                         "served", 500: INTERNAL}},
    "/v1/responses": {"post": {400: BAD_REQUEST, 404: f"{NOT_FOUND}, or `previous_response_id` names no stored "
                                                     f"response", 500: INTERNAL}},
    "/v1/responses/{response_id}": {"get": {404: NO_RESPONSE}, "delete": {404: NO_RESPONSE}},
    "/v1/responses/{response_id}/cancel": {"post": {400: "the response is not running in the background (this "
                                                         "server runs none: it answers when a response is done)",
                                                    404: NO_RESPONSE}},
    "/health": {"get": {503: "the engine failed; OpenAI's error body"}},
    "/metrics": {"get": {}},
    # vLLM's extras (tokenization.py), outside /v1
    "/tokenize": {"post": {400: "a bad body (prompt and messages, neither, a chat-only field with prompt), a chat "
                                "the template refuses, or a model without a tokenizer", 404: NOT_FOUND, 500: INTERNAL}},
    "/detokenize": {"post": {400: "a bad body, or a token id outside the tokenizer's vocabulary (named)",
                             404: NOT_FOUND, 500: INTERNAL}},
    "/version": {"get": {}},
    "/ping": {"get": {503: "the engine failed; OpenAI's error body"},
              "post": {503: "the engine failed; OpenAI's error body"}},
}
STREAMING = {"/v1/completions": STREAM, "/v1/chat/completions": STREAM, "/v1/responses": EVENTS}
PLAIN_TEXT = ("/metrics", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")     # Prometheus text; vLLM's "Success: ..."
EMPTY = ("/ping",)                                  # 200 with no body, as vLLM's
VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")
ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


def install_openapi(app, *, authenticated: bool) -> None:
    """Make `app.openapi()` return the document described in the module docstring (built once)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = truthful_document(app, authenticated)
        return app.openapi_schema
    app.openapi = openapi


def truthful_document(app, authenticated: bool) -> dict:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in VALIDATION_SCHEMAS:
        schemas.pop(name, None)
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(error_schema.pop("$defs", {}))
    schemas["ErrorResponse"] = error_schema
    for path, methods in doc.get("paths", {}).items():
        for method, op in methods.items():
            op.get("responses", {}).pop("422", None)
            statuses = dict(RESPONSES.get(path, {}).get(method, {}))
            if authenticated and (path == "/v1" or path.startswith("/v1/")):
                statuses[401] = UNAUTHORIZED
                op["security"] = [{"bearerAuth": []}]
            for status, description in statuses.items():
                op["responses"][str(status)] = {"description": description,
                                                "content": {"application/json": {"schema": ERROR_REF}}}
            if path in PLAIN_TEXT:
                op["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
            if path in EMPTY:
                op["responses"]["200"].pop("content", None)
            if path in STREAMING:
                ok = op["responses"]["200"]
                ok["description"] = f"{ok.get('description', 'Successful Response')}; {STREAMING[path]}"
                ok.setdefault("content", {})["text/event-stream"] = {"schema": {"type": "string"}}
    if authenticated:
        doc["components"]["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
    return doc


__all__ = ["install_openapi", "truthful_document", "ErrorResponse", "RESPONSES"]
