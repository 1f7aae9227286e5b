"""Prometheus metrics of a running server (prometheus-client), named like vLLM's (`tp_jax:` for `vllm:`).

Engine state is read on the engine thread (`AsyncLLMEngine.call`) when `/metrics` is
scraped, so the numbers of one scrape belong to the same moment between two steps:

    tp_jax:num_requests_running / _waiting     engine requests (an n > 1 request counts n)
    tp_jax:kv_blocks_used / _total, tp_jax:kv_cache_usage_perc
    tp_jax:kv_cache_bytes_per_token            K + V bytes of one token on one device (the pool's layout)
    tp_jax:kv_cache_max_model_len_sequences    sequences of max_model_len tokens the pool holds at once
    tp_jax:kv_cache_group_blocks{group, kind}  per KV cache group: the most blocks a max_model_len sequence holds
    tp_jax:kv_cache_group_blocks_used{group, kind}   per KV cache group: blocks held by requests now
    tp_jax:cache_config_info{block_size, cache_dtype, num_gpu_blocks}   (vLLM's, value 1)
    tp_jax:prefix_cache_hit_rate, tp_jax:prefix_cache_queries_total / _hits_total (tokens)
    tp_jax:generation_tokens_total             tokens sampled by the engine (tokens out)
    tp_jax:num_preemptions_total, tp_jax:engine_steps_total
    tp_jax:spec_decode_num_drafts_total / _num_draft_tokens_total / _num_accepted_tokens_total,
    tp_jax:spec_decode_num_accepted_tokens_per_pos_total{position}   speculative decoding (when configured)

Per request, as it runs (`RequestTimer`):

    tp_jax:prompt_tokens_total                 prompt tokens of accepted requests (tokens in)
    tp_jax:time_to_first_token_seconds         arrival -> first token (histogram)
    tp_jax:inter_token_latency_seconds         between a request's successive tokens (histogram)
    tp_jax:e2e_request_latency_seconds         arrival -> finished (histogram)
    tp_jax:request_success_total{finished_reason="stop|length|abort"}
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tp_jax.serving.outputs import RequestOutput

log = logging.getLogger("tp_jax.server")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
SNAPSHOT_TIMEOUT_S = 10.0                # a step (a compile) may hold the engine thread


def engine_snapshot(engine) -> dict:
    """The engine's counters at one moment (call on the engine thread)."""
    core = engine.core
    used, total = core.kv_usage()
    queries, hits = core.prefix_cache_counts()
    pool = core.pool
    return {"running": core.scheduler.num_running, "waiting": len(core.scheduler.waiting),
            "kv_blocks_used": used, "kv_blocks_total": total, "kv_usage": used / total,
            "kv_bytes_per_token": pool.bytes_per_token, "kv_sequences": pool.sequences(core.config.max_model_len),
            "kv_groups": kv_groups(core),
            "cache_config": {"block_size": str(pool.block_size), "cache_dtype": core.config.kv_cache_dtype,
                             "num_gpu_blocks": str(pool.num_blocks)},
            "prefix_hit_rate": hits / queries if queries else 0.0, "prefix_queries": queries, "prefix_hits": hits,
            "generated_tokens": core.stats["generated_tokens"], "preemptions": core.stats["preemptions"],
            "steps": core.stats["steps"], "constrained_tokens": core.stats["constrained_tokens"],
            "grammar_seconds": core.stats["grammar_seconds"], "spec": None if core.config.speculative_config is None
            else dataclasses.replace(core.spec, accepted_per_pos=list(core.spec.accepted_per_pos))}


def kv_groups(core) -> list[tuple[str, int, int]]:
    """(kind, the most blocks a max_model_len sequence holds, blocks held now over every dp replica) of each KV cache
    group (tp_jax/models/cache.py KVGroups; a model with one kind of layer: one group)."""
    pool, managers = core.pool, core.scheduler.blocks
    groups = pool.layout.groups
    windows = (pool.window,) if groups is None else groups.windows
    most = pool.group_blocks or (pool.sequence_blocks(core.config.max_model_len),)
    used = [sum(len({b for t in bm.group_tables[g].values() for b in t if b >= 0}) for bm in managers)
            for g in range(len(windows))]
    return [("full" if w is None else f"sliding-{w}", n, u) for w, n, u in zip(windows, most, used)]


class _EngineCollector:
    """Yields the latest engine snapshot as Prometheus families."""

    def __init__(self):
        self.snapshot: dict | None = None

    def collect(self):
        s = self.snapshot
        if s is None:
            return
        gauges = [("num_requests_running", "Requests running in the engine", "running"),
                  ("num_requests_waiting", "Requests waiting to be scheduled", "waiting"),
                  ("kv_blocks_used", "KV cache blocks held by requests", "kv_blocks_used"),
                  ("kv_blocks_total", "KV cache blocks in the pool (all dp replicas)", "kv_blocks_total"),
                  ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full)", "kv_usage"),
                  ("kv_cache_bytes_per_token", "KV cache bytes (K + V) of one token on one device",
                   "kv_bytes_per_token"),
                  ("kv_cache_max_model_len_sequences", "Sequences of max_model_len tokens the KV pool holds at once "
                   "(all dp replicas)", "kv_sequences"),
                  ("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up", "prefix_hit_rate")]
        for name, doc, key in gauges:
            yield GaugeMetricFamily(f"tp_jax:{name}", doc, value=s[key])
        info = GaugeMetricFamily("tp_jax:cache_config_info", "The KV cache's configuration (num_gpu_blocks per dp "
                                 "replica)", labels=list(s["cache_config"]))
        info.add_metric(list(s["cache_config"].values()), 1)
        yield info
        for suffix, doc, i in (("", "the most blocks one sequence of max_model_len holds", 1),
                               ("_used", "blocks held by requests now (all dp replicas)", 2)):
            family = GaugeMetricFamily(f"tp_jax:kv_cache_group_blocks{suffix}", f"Per KV cache group: {doc}",
                                       labels=["group", "kind"])
            for g, group in enumerate(s["kv_groups"]):
                family.add_metric([str(g), group[0]], group[i])
            yield family
        counters = [("generation_tokens", "Tokens sampled by the engine", "generated_tokens"),
                    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "prefix_queries"),
                    ("prefix_cache_hits", "Prompt tokens found in the prefix cache", "prefix_hits"),
                    ("num_preemptions", "Requests preempted (blocks freed, recomputed later)", "preemptions"),
                    ("engine_steps", "Engine steps run", "steps"),
                    ("structured_output_tokens", "Tokens sampled under a grammar (structured outputs)",
                     "constrained_tokens"),
                    ("structured_output_host_seconds", "Host time of the grammar matchers: bitmasks and token "
                     "advances (structured outputs)", "grammar_seconds")]
        for name, doc, key in counters:
            yield CounterMetricFamily(f"tp_jax:{name}", doc, value=s[key])
        spec = s["spec"]
        if spec is not None:                    # vLLM's spec-decode series
            for name, doc, value in [("num_drafts", "Speculative steps of a request (rows verified)", spec.drafts),
                                     ("num_draft_tokens", "Draft tokens proposed and verified", spec.draft_tokens),
                                     ("num_accepted_tokens", "Draft tokens accepted", spec.accepted_tokens)]:
                yield CounterMetricFamily(f"tp_jax:spec_decode_{name}", doc, value=value)
            per_pos = CounterMetricFamily("tp_jax:spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by position in the draft", labels=["position"])
            for i, n in enumerate(spec.accepted_per_pos):
                per_pos.add_metric([str(i)], n)
            yield per_pos


class ServerMetrics:
    """One registry per server; `render()` is the /metrics body."""

    def __init__(self, aengine):
        self.aengine = aengine
        disable_created_metrics()               # no `_created` series (process-wide switch, as vLLM)
        self.registry = CollectorRegistry()
        self._engine = _EngineCollector()
        self.registry.register(self._engine)
        kw = dict(registry=self.registry)
        self.prompt_tokens = Counter("tp_jax:prompt_tokens", "Prompt tokens of accepted requests", **kw)
        self.ttft = Histogram("tp_jax:time_to_first_token_seconds", "Arrival to first token", buckets=TTFT_BUCKETS,
                              **kw)
        self.itl = Histogram("tp_jax:inter_token_latency_seconds", "Time between a request's successive tokens",
                             buckets=ITL_BUCKETS, **kw)
        self.e2e = Histogram("tp_jax:e2e_request_latency_seconds", "Arrival to finished", buckets=E2E_BUCKETS, **kw)
        self.finished = Counter("tp_jax:request_success", "Finished requests by reason", ["finished_reason"], **kw)

    async def render(self) -> bytes:
        if self.aengine.error is None:
            try:
                fut = self.aengine.call(engine_snapshot)
                self._engine.snapshot = await asyncio.wait_for(asyncio.wrap_future(fut), SNAPSHOT_TIMEOUT_S)
            except (asyncio.TimeoutError, RuntimeError):
                pass                                      # the last snapshot stands
        return generate_latest(self.registry)

    def timer(self, request_id: str, prompt_tokens: int) -> RequestTimer:
        self.prompt_tokens.inc(prompt_tokens)
        return RequestTimer(self, request_id, prompt_tokens)


class RequestTimer:
    """Observes one engine request's latencies from its successive RequestOutputs; logs it when it ends."""

    def __init__(self, metrics: ServerMetrics, request_id: str, prompt_tokens: int):
        self.m, self.request_id, self.prompt_tokens = metrics, request_id, prompt_tokens
        self.last_token_time: float | None = None
        self.completion_tokens = 0
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        t = out.metrics
        if t is not None and t.last_token_time is not None and t.last_token_time != self.last_token_time:
            if self.last_token_time is None:
                self.m.ttft.observe(max(t.first_token_time - t.arrival_time, 0.0))
            else:
                self.m.itl.observe(t.last_token_time - self.last_token_time)
            self.last_token_time = t.last_token_time
        self.completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        if out.finished:
            reasons = sorted({c.finish_reason for c in out.outputs})
            end = t.finished_time if t is not None and t.finished_time is not None else time.monotonic()
            self._end(",".join(reasons), end - (t.arrival_time if t is not None else end), t)

    def abort(self, why: str) -> None:
        """The request stopped before finishing (client gone, server stopping)."""
        if not self.done:
            self._end("abort", None, None, why)

    def _end(self, reason: str, latency: float | None, t, why: str = "") -> None:
        self.done = True
        for r in reason.split(","):
            self.m.finished.labels(finished_reason=r).inc()
        if latency is not None:
            self.m.e2e.observe(latency)
        ttft = (f", ttft {t.first_token_time - t.arrival_time:.3f} s"
                if t is not None and t.first_token_time is not None else "")
        lat = f", latency {latency:.3f} s" if latency is not None else ""
        log.info("request %s: %d prompt + %d completion tokens, finish %s%s%s%s", self.request_id,
                 self.prompt_tokens, self.completion_tokens, reason, ttft, lat, f" ({why})" if why else "")
