"""The app in process (httpx's ASGI transport) over a real engine that then fails: the failing request gets
a 500 in OpenAI's shape naming the failure, /health turns 503, and a stream ends with an error event and
`[DONE]` rather than hanging."""

import asyncio
import json

import httpx
import pytest

from tp_jax.server.app import create_app
from tp_jax.serving.async_engine import AsyncLLMEngine
from tp_jax.serving.llm import LLM


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(tiny_path, tensor_parallel_size=2, max_model_len=256, max_num_seqs=4, progress=False)


def test_a_failed_engine_is_reported(llm, monkeypatch):
    aengine = AsyncLLMEngine(llm.engine)
    app = create_app(aengine, llm.get_tokenizer(), model_names=["tiny"], max_model_len=llm.max_model_len)

    def device_lost():
        raise RuntimeError("device lost")

    async def scenario():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)     # 500s are re-raised to be logged
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            ok = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            healthy = await c.get("/health")
            monkeypatch.setattr(llm.engine, "step", device_lost)
            failed = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            sick = await c.get("/health")
            stream = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True})
            return ok, healthy, failed, sick, stream

    try:
        ok, healthy, failed, sick, stream = asyncio.run(scenario())
    finally:
        aengine.shutdown()
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2
    assert healthy.status_code == 200
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "internal_server_error"
    assert "device lost" in failed.json()["error"]["message"]
    assert sick.status_code == 503 and "device lost" in sick.json()["error"]["message"]
    events = [line[len("data: "):] for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "engine has stopped" in json.loads(events[-2])["error"]["message"]
