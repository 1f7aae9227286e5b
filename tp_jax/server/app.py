"""The OpenAI-compatible HTTP app (FastAPI): routes, authentication and OpenAI-style errors.

    app = create_app(AsyncLLMEngine(llm.engine), llm.get_tokenizer(), model_names=["SmolLM2"],
                     max_model_len=llm.max_model_len, api_key=None)
    uvicorn.run(app, host="127.0.0.1", port=8000)

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both stream with `stream: true`),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text), and vLLM's `POST /tokenize`,
`POST /detokenize`, `GET /version`, `GET|POST /ping` (tokenization.py); the Responses API,
`POST /v1/responses`, `GET|DELETE /v1/responses/{id}`, `.../cancel` (responses_api.py). With
`api_key`, every `/v1/` route needs `Authorization: Bearer <api_key>` (401 otherwise); the others stay open,
as in vLLM. Every error is OpenAI's body, `{"error": {"message", "type", "param",
"code"}}`: a bad request is refused with 400 naming the field and the fix, before the engine
sees it. A client that disconnects stops its request (streaming or not): its KV blocks are
freed. When the server stops, the engine is shut down (in-flight requests aborted).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tp_jax.server.handlers import APIError, Handler
from tp_jax.server.metrics import ServerMetrics
from tp_jax.server.openapi import install_openapi
from tp_jax.server.protocol import (ChatCompletionRequest, CompletionRequest, LoadLoRAAdapterRequest,
                                   UnloadLoRAAdapterRequest)
from tp_jax.server.responses_api import ResponsesAPI, responses_router
from tp_jax.server.tokenization import add_routes as add_tokenization_routes

log = logging.getLogger("tp_jax.server")

# fields whose type is a union: say what they accept instead of one member's complaint
_EXPECTED = {"prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
             "stop": "a string or a list of strings",
             "content": "a string or a list of {\"type\": \"text\", \"text\": ...} parts"}


def create_app(aengine, tokenizer, *, model_names: list[str], max_model_len: int, api_key: str | None = None,
               model_root: str | None = None, shutdown_timeout_s: float = 5.0,
               tool_parser: str | None = None, lora_modules: dict | None = None,
               runtime_lora: bool = False, reasoning_parser: str | None = None) -> FastAPI:
    """The app over a running AsyncLLMEngine; it shuts the engine down when the server stops.
    `tool_parser`, `reasoning_parser`: how tool_choice "auto" reads the model's calls (tool_parsers.py PARSERS) and
    which thoughts move to `reasoning_content` (reasoning.py); None: chosen from the chat template. The engine's
    structured-output defaults (EngineArgs.structured_outputs_config) are applied by the engine itself.
    `lora_modules`: adapter name -> LoRARequest, served as models of their own; `runtime_lora`: adapters may be
    loaded and unloaded while serving (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`)."""
    metrics = ServerMetrics(aengine)
    handler = Handler(aengine, tokenizer, model_names, max_model_len, metrics, tool_parser, lora_modules,
                      reasoning_parser)
    if tokenizer is not None:
        log.info("chat: %s", handler.format.describe())
        for warning in handler.format.warnings:
            log.warning("%s", warning)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        log.info("stopping: aborting in-flight requests, shutting down the engine")
        await asyncio.to_thread(aengine.shutdown, shutdown_timeout_s)

    app = FastAPI(title="tp_jax OpenAI-compatible server", lifespan=lifespan)
    app.state.handler, app.state.metrics = handler, metrics
    _add_error_handlers(app)
    install_openapi(app, authenticated=bool(api_key))        # 400 / 401 / 500 with OpenAI's body, no 422
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health():
        if aengine.error is not None:
            return JSONResponse(APIError(503, f"the engine failed: {aengine.error}",
                                         type="internal_server_error").body(), status_code=503)
        return {"status": "ok"}

    add_tokenization_routes(app, handler, health)          # /tokenize, /detokenize, /version, /ping

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(await metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = lambda name, root, parent: {"id": name, "object": "model", "created": created, "owned_by": "tp_jax",
                                           "root": root, "parent": parent, "max_model_len": max_model_len,
                                           "permission": [model_permission(created)]}
        return {"object": "list", "data": [card(name, model_root or name, None) for name in model_names] +
                [card(name, lora.lora_path, model_names[0]) for name, lora in handler.loras.items()]}

    def runtime_updates() -> None:
        if not runtime_lora:
            raise APIError(400, "loading LoRA adapters at run time is off: start the server with "
                                "--allow-runtime-lora-updating (and --enable-lora)")
        if aengine.engine.core.lora is None:
            raise APIError(400, "this server was started without --enable-lora: it serves no adapters")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        runtime_updates()
        return PlainTextResponse(await asyncio.to_thread(handler.load_adapter, body.lora_name, body.lora_path))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        runtime_updates()
        return PlainTextResponse(handler.unload_adapter(body.lora_name))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _answer(request, handler, handler.completion_job(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _answer(request, handler, handler.chat_job(body))

    app.include_router(responses_router(ResponsesAPI(handler), _unless_disconnected))     # /v1/responses...
    return app


def model_permission(created: int) -> dict:
    """vLLM's ModelPermission entry of a /v1/models card (clients that read it find vLLM's values)."""
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}


async def _answer(request: Request, handler: Handler, job):
    if job.request.stream:
        return StreamingResponse(handler.stream(job), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return JSONResponse(await _unless_disconnected(request, handler.full(job)))


async def _unless_disconnected(request: Request, coro):
    """Await coro; if the client disconnects first, cancel it (which aborts its engine requests)."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(coro), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise APIError(499, "the client disconnected")
    return work.result()


# --- errors -------------------------------------------------------------------------------------------
def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, e: RequestValidationError):
        message, param = describe_validation(e.errors())
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        message = f"{e.detail}: {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, message, type=kind).body(), status_code=e.status_code)

    @app.exception_handler(ValueError)
    async def value_error(_request, e: ValueError):     # the engine refused a request after all
        return JSONResponse(APIError(400, str(e)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):    # a bug or a failed engine: still OpenAI's body
        log.error("%s %s failed: %r", request.method, request.url.path, e)
        return JSONResponse(APIError(500, f"the request failed: {e}", type="internal_server_error").body(),
                            status_code=500)


def describe_validation(errors) -> tuple[str, str | None]:
    """One message for pydantic's errors: the first problem, naming the field, what it accepts and the fix."""
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    kind, field = e.get("type", ""), ".".join(loc)
    param = loc[0] if loc else None
    got = e.get("input")
    if kind == "json_invalid":
        return (f"malformed JSON in the request body ({e.get('ctx', {}).get('error', 'JSON decode error')} at "
                f"position {loc[0] if loc else '?'}); send one JSON object"), None
    if kind == "missing" and not loc:
        return "the request body is missing; send a JSON object with the request's fields", None
    if kind in ("model_attributes_type", "dict_type") and not loc:
        return f"the request body must be a JSON object, got {type(got).__name__}", None
    if kind == "extra_forbidden":
        return f"unknown field {field!r}: it has no meaning here; remove it", param
    if kind == "missing":
        return f"{field} is required", param
    if kind == "value_error" and not loc:                   # a model's own check: protocol.FieldError names the field
        message = str(e.get("msg", "")).removeprefix("Value error, ")
        return message, getattr(e.get("ctx", {}).get("error"), "param", None)
    union = next((f for f in loc if f in _EXPECTED), None)
    if union is not None:
        path = ".".join(loc[:loc.index(union) + 1])
        return f"{path} must be {_EXPECTED[union]}; got {got!r}", param
    return f"{field}: {e.get('msg', 'invalid value')} (got {got!r})", param


# --- authentication ------------------------------------------------------------------------------------
class APIKeyMiddleware:
    """Plain ASGI middleware (streams and disconnects pass through untouched): `/v1/...` needs the key."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            given = dict(scope.get("headers", ())).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                what = "no API key was given" if not given else "the API key is wrong"
                error = APIError(401, f"{what}: send the header `Authorization: Bearer <key>` with the key this "
                                      f"server was started with (--api-key)", type="authentication_error",
                                 code="invalid_api_key")
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
