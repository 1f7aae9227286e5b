"""Drive a running OpenAI-compatible server with a timed workload; report throughput and latency.

    work = [{"id": "b0", "prompt": [token ids], "max_tokens": 64, "arrival": 0.0}, ...]   # seconds from start
    bench_server("http://127.0.0.1:8000", work)
    -> {"output_tokens_per_s", "requests_per_s", "wall_s", "output_tokens", "ttft_p50_s", "ttft_p99_s",
        "tpot_p50_s", "tpot_p99_s", "itl_p50_s", "itl_p99_s", "num_requests"}

Each request is sent at its arrival time as a streaming completion (`POST /v1/completions`,
prompt as token ids, temperature 0, `ignore_eos`, usage in the last chunk), so every request
makes exactly `max_tokens` tokens. Time to first token is arrival -> first streamed token,
time per output token is (last - first) / (tokens - 1) per request (as `summarize`), and
inter-token latency is every gap between a stream's successive chunks (a burst of chunks read
together, as after the server's event loop waited on the engine, shows as gaps near zero). Used by
`scripts/bench_serving.py --server URL`; it works against any OpenAI-compatible server.
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np


def summarize(records: list[dict], wall: float) -> dict:
    """records: {"arrival", "first", "done", "n"} in seconds (same clock); -> the reported figures."""
    ttft = np.array([r["first"] - r["arrival"] for r in records])
    tpot = np.array([(r["done"] - r["first"]) / (r["n"] - 1) for r in records if r["n"] > 1])
    tokens = sum(r["n"] for r in records)
    return {"output_tokens_per_s": round(tokens / wall, 2), "requests_per_s": round(len(records) / wall, 3),
            "wall_s": round(wall, 2), "output_tokens": tokens, "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99)}


def _pct(x, q) -> float | None:
    return round(float(np.percentile(x, q)), 6) if len(x) else None     # seconds, to the microsecond


def bench_server(url: str, work: list[dict], *, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 3600.0) -> dict:
    """Send `work` to the server at `url` (with or without /v1) on its schedule; the summary dict."""
    return asyncio.run(_bench(_base(url), work, model, api_key, timeout_s))


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


async def _bench(base: str, work: list[dict], model: str | None, api_key: str | None, timeout_s: float) -> dict:
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(work) + 1, max_keepalive_connections=len(work) + 1)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout_s, connect=30.0),
                                 limits=limits) as client:
        if model is None:
            r = await client.get(f"{base}/models")
            _raise_for(r, "GET /v1/models")
            model = r.json()["data"][0]["id"]
        t0 = time.monotonic()
        records = await asyncio.gather(*(_one(client, base, model, w, t0) for w in work))
        wall = time.monotonic() - t0
    gaps = np.concatenate([np.diff(r.pop("times")) for r in records]) if records else np.array([])
    return {**summarize(records, wall), "itl_p50_s": _pct(gaps, 50), "itl_p99_s": _pct(gaps, 99),
            "num_requests": len(records)}


async def _one(client, base: str, model: str, w: dict, t0: float) -> dict:
    """One streamed request at its arrival time: {"arrival", "first", "done", "n", "times"} (s from t0)."""
    await asyncio.sleep(max(0.0, t0 + w["arrival"] - time.monotonic()))
    body = {"model": model, "prompt": w["prompt"], "max_tokens": w["max_tokens"], "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    times, n = [], None
    async with client.stream("POST", f"{base}/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            _raise_for(r, f"request {w['id']}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"request {w['id']}: the server failed mid-stream: {chunk['error'].get('message')}")
            if chunk.get("choices"):
                times.append(time.monotonic() - t0)
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    if not times:
        raise RuntimeError(f"request {w['id']}: the stream ended without a token")
    return {"arrival": w["arrival"], "first": times[0], "done": times[-1], "n": len(times) if n is None else n,
            "times": times}


def _raise_for(r, what: str) -> None:
    if r.status_code != 200:
        try:
            msg = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = r.text[:500]
        raise RuntimeError(f"{what}: HTTP {r.status_code}: {msg}")
