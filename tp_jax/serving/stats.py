"""Timing a generation: load, compile, time to first token, decode throughput.

Compile time is what JAX reports through `jax.monitoring` (tracing, lowering and
backend compilation), so it can be taken out of the decode rate.
"""

from __future__ import annotations

import dataclasses
import time

import jax

_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


class CompileClock:
    """Seconds JAX has spent compiling since this process registered the listener."""
    total = 0.0
    _registered = False

    @classmethod
    def start(cls) -> None:
        if not cls._registered:
            jax.monitoring.register_event_duration_secs_listener(cls._on_event)
            cls._registered = True

    @classmethod
    def _on_event(cls, name: str, secs: float, **_) -> None:
        if name in _COMPILE_EVENTS:
            cls.total += secs


@dataclasses.dataclass
class GenerationStats:
    load_s: float = 0.0
    compile_s: float = 0.0
    ttft_s: float = 0.0                 # wall time to the first token (prefill, compile included)
    decode_s: float = 0.0               # wall time after the first token, compile excluded
    decode_tokens: int = 0
    kv_cache_bytes_per_device: int = 0
    spec: object | None = None          # speculative decoding's totals (speculative.py SpecCounters), if on

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def line(self) -> str:
        return (f"load {self.load_s:.2f} s | compile {self.compile_s:.2f} s | time to first token "
                f"{self.ttft_s:.3f} s | decode {self.decode_tokens_per_s:.1f} tokens/s "
                f"({self.decode_tokens} tokens) | KV cache {self.kv_cache_bytes_per_device / 2**20:.1f} MiB/device"
                + ("" if self.spec is None else f" | speculative: acceptance {self.spec.acceptance_rate:.2f}, "
                   f"mean accepted length {self.spec.mean_accepted_length:.2f}"))


def timed(events, stats: GenerationStats):
    """Pass stream events through, filling `stats` (first event = end of prefill).

    A request's first token comes from its prefill, so only its later tokens count as
    decode tokens (with several prompts, the others' first tokens arrive after the first event).
    """
    CompileClock.start()
    c0, t0 = CompileClock.total, time.perf_counter()
    first, started = None, set()
    for ev in events:
        now = time.perf_counter()
        if first is None:
            first = (now, CompileClock.total)
            stats.ttft_s = now - t0
        key = (ev.index, getattr(ev, "sample", 0))          # one stream per prompt (and sample)
        if key in started:
            stats.decode_tokens += 1
        started.add(key)
        yield ev
    if first is not None:
        stats.decode_s = max(time.perf_counter() - first[0] - (CompileClock.total - first[1]), 0.0)
    stats.compile_s = CompileClock.total - c0
