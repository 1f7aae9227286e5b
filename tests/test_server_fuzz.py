"""Schemathesis over the server's own /openapi.json: for vLLM's extra endpoints (and `/v1/responses` once the
document lists it), generated requests, valid and not, never get a 5xx and only get statuses the document
lists for the route. The app runs in process (schemathesis' ASGI transport) over the tiny tokenized Llama;
examples per operation and the answers' length are bounded so the file stays well under two minutes."""

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import status_code_conformance  # noqa: E402

MAX_TOKENS = 4                      # a generated request that asks for more (or sets none) gets 4 tokens at most
TOKEN_LIMIT = {"/v1/responses": "max_output_tokens"}       # the routes that generate: their token-limit field
EXAMPLES = 50                       # per operation and mode
REQUEST_TIMEOUT_S = 120             # a new prompt-length bucket compiles on the first request that needs it
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE


@pytest.fixture(scope="module")
def fuzzed_schema(tiny_path):
    from tp_jax.server.app import create_app
    from tp_jax.serving.async_engine import AsyncLLMEngine
    from tp_jax.serving.llm import LLM
    from tp_jax.serving.sampling import SamplingParams
    llm = LLM(tiny_path, tensor_parallel_size=2, max_model_len=256, max_num_seqs=4, progress=False)
    llm.generate("Hi", SamplingParams(max_tokens=MAX_TOKENS))         # compiled before the first timed request
    aengine = AsyncLLMEngine(llm.engine)
    app = create_app(aengine, llm.get_tokenizer(), model_names=["tiny"], max_model_len=llm.max_model_len)
    yield schemathesis.openapi.from_asgi("/openapi.json", without_lifespan(app))
    aengine.shutdown()


def without_lifespan(app):
    """The app without its lifespan: schemathesis ends an ASGI app's lifespan after every test, and the app's
    would shut the engine down; the fixture does that once, at the end of the module."""
    async def wrapped(scope, receive, send):
        if scope["type"] != "lifespan":
            return await app(scope, receive, send)
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
    return wrapped


# (path, method, with a body: also generated bodies that break the schema)
OPERATIONS = [("/tokenize", "POST", True), ("/detokenize", "POST", True), ("/version", "GET", False),
              ("/ping", "GET", False), ("/ping", "POST", False), ("/v1/models", "GET", False),
              ("/v1/responses", "POST", True), ("/v1/responses/{response_id}", "GET", False),
              ("/v1/responses/{response_id}", "DELETE", False), ("/v1/responses/{response_id}/cancel", "POST", False)]
CASES = [(p, m, mode) for p, m, body in OPERATIONS for mode in ((POSITIVE, NEGATIVE) if body else (POSITIVE,))]


@pytest.mark.parametrize("path, method, mode", CASES, ids=[f"{m} {p} {mode.value}" for p, m, mode in CASES])
def test_no_server_error_and_only_documented_statuses(fuzzed_schema, path, method, mode):
    if method.lower() not in fuzzed_schema.raw_schema["paths"].get(path, {}):
        pytest.skip(f"the server does not serve {method} {path} (yet)")
    operation = fuzzed_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case):
        if isinstance(case.body, dict) and path in TOKEN_LIMIT:    # generation is not what is fuzzed: short answers
            limit = case.body.get(TOKEN_LIMIT[path])
            if limit is None or (isinstance(limit, int) and limit > MAX_TOKENS):
                case.body[TOKEN_LIMIT[path]] = MAX_TOKENS
        case.call_and_validate(checks=[not_a_server_error, status_code_conformance], timeout=REQUEST_TIMEOUT_S)

    check()
