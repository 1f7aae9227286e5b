"""tp_jax's OpenAI-compatible server and the `tp-jax` command (knows HTTP; the engine does not).

    protocol.py      request schemas (pydantic): OpenAI's fields and vLLM's extra sampling fields
    responses.py     response bodies: choices, usage, logprobs, stream deltas
    handlers.py      a request through the async engine: checked, run, answered whole or streamed
    app.py           the FastAPI app: routes, API key, OpenAI-style errors
    metrics.py       Prometheus metrics (prometheus-client)
    serve.py         `tp-jax serve`: load, bind, uvicorn, signals, many hosts
    generate.py      `tp-jax generate` (scripts/generate.py)
    cli.py           the `tp-jax` entry point
    bench_client.py  drive a running server with a timed workload (scripts/bench_serving.py --server)
"""
