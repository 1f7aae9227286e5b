"""/openapi.json tells the truth: every status the server answers is documented for its route, with
OpenAI's error body; FastAPI's 422 (never answered: bad requests get 400) is gone; 401 and bearer
auth appear exactly when the server has an API key."""

import json
import re

import httpx
import pytest

from tp_jax.server.app import create_app
from tp_jax.server.openapi import ErrorResponse

V1 = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
      "/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel")


def document(api_key=None) -> dict:
    app = create_app(None, None, model_names=["tiny"], max_model_len=256, api_key=api_key)
    return app.openapi()


def test_no_422_and_the_error_statuses_carry_openais_body():
    doc = document()
    assert "422" not in json.dumps(doc["paths"]) and "HTTPValidationError" not in json.dumps(doc)
    schemas = doc["components"]["schemas"]
    assert schemas["ErrorResponse"]["properties"]["error"] == {"$ref": "#/components/schemas/ErrorDetail"}
    assert set(schemas["ErrorDetail"]["required"]) == {"message", "type"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "404", "500"}                # 404: an unknown model
        for status in ("400", "404", "500"):
            assert responses[status]["content"]["application/json"]["schema"] == \
                {"$ref": "#/components/schemas/ErrorResponse"}
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert "requestBody" in doc["paths"][path]["post"]                # the request schema stays
    assert set(doc["paths"]["/health"]["get"]["responses"]) == {"200", "503"}
    for path in ("/tokenize", "/detokenize"):                            # vLLM's extras (tokenization.py)
        assert set(doc["paths"][path]["post"]["responses"]) == {"200", "400", "404", "500"}
    assert set(doc["paths"]["/version"]["get"]["responses"]) == {"200"}
    for method in ("get", "post"):
        assert set(doc["paths"]["/ping"][method]["responses"]) == {"200", "503"}
        assert "content" not in doc["paths"]["/ping"][method]["responses"]["200"]      # vLLM's empty 200
    assert "securitySchemes" not in doc["components"] and "401" not in json.dumps(doc["paths"])


def test_api_key_adds_401_and_bearer_auth_to_v1_routes_only():
    import asyncio
    app = create_app(None, None, model_names=["tiny"], max_model_len=256, api_key="secret")
    doc = app.openapi()

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            return (await c.post("/v1/completions", json={"prompt": "Hi"}), await c.get("/v1/models"),
                    await c.get("/v1/models", headers={"Authorization": "Bearer secret"}))
    answers = asyncio.run(ask())
    assert [r.status_code for r in answers] == [401, 401, 200]
    for r, path, method in zip(answers, ("/v1/completions", "/v1/models", "/v1/models"), ("post", "get", "get")):
        assert str(r.status_code) in doc["paths"][path][method]["responses"]
        if r.status_code == 401:
            ErrorResponse.model_validate(r.json())
    assert doc["components"]["securitySchemes"] == {"bearerAuth": {"type": "http", "scheme": "bearer"}}
    for path, methods in doc["paths"].items():
        for op in methods.values():
            protected = path in V1
            assert ("401" in op["responses"]) == protected and ("security" in op) == protected, path


REQUESTS = [   # (method, path, body): good and bad requests, each answered with a documented status
    ("post", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("post", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": True}),
    ("post", "/v1/completions", {"prompt": "Hi", "frobnicate": 1}),
    ("post", "/v1/completions", {"prompt": 5}),
    ("post", "/v1/completions", {}),
    ("post", "/v1/completions", b"{not json"),
    ("post", "/v1/completions", {"prompt": "Hi", "model": "no-such-model"}),
    ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("post", "/v1/chat/completions", {"messages": "Hi"}),
    ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "temperature": -1}),
    ("post", "/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
    ("post", "/v1/responses", {"input": "Hi", "max_output_tokens": 2, "stream": True}),
    ("post", "/v1/responses", {"input": "Hi", "tools": [{"type": "web_search"}]}),
    ("post", "/v1/responses", {"input": "Hi", "previous_response_id": "resp_unknown"}),
    ("get", "/v1/responses/resp_unknown", None),
    ("post", "/v1/responses/resp_unknown/cancel", None),
    ("get", "/v1/models", None),
    ("post", "/tokenize", {"prompt": "Hi"}),
    ("post", "/tokenize", {"messages": [{"role": "user", "content": "Hi"}], "model": "no-such-model"}),
    ("post", "/detokenize", {"tokens": [10**9]}),
    ("get", "/version", None),
    ("get", "/health", None),
    ("get", "/metrics", None),
]


def test_the_served_document_lists_every_status_the_server_answers(tiny_server):
    doc = httpx.get(f"{tiny_server.url}/openapi.json", timeout=30).json()
    seen = set()
    for method, path, body in REQUESTS:
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
            {"json": body} if body is not None else {}
        r = httpx.request(method, f"{tiny_server.url}{path}", timeout=60, **kw)
        route = next(p for p in doc["paths"] if re.fullmatch(re.sub(r"\{\w+\}", "[^/]+", p), path))   # {response_id}
        responses = doc["paths"][route][method]["responses"]
        assert str(r.status_code) in responses, f"{method} {path} answered {r.status_code}, documented {set(responses)}"
        media = r.headers["content-type"].split(";")[0]
        assert media in responses[str(r.status_code)].get("content", {media: None}), (path, media)
        if r.status_code >= 400:
            ErrorResponse.model_validate(r.json())                       # the documented error body
        seen.add(r.status_code)
    assert {200, 400, 404} <= seen
