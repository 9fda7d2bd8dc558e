"""The router's Prometheus metrics (its own registry: several routers may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from turnkv.protocol import TurnStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.turns = Counter("turnkv_turns", "Turns served", ["mode", "tagged"], registry=r)
        self.errors = Counter("turnkv_errors", "Turns that failed", ["status"], registry=r)
        self.fallbacks = Counter("turnkv_fallbacks", "Turns that fell back", ["reason"],
                                 registry=r)
        self.prefix_breaks = Counter("turnkv_prefix_breaks", "Turns whose prompt diverged "
                                     "from the session's history", registry=r)
        self.prompt_tokens = Counter("turnkv_prompt_tokens", "Prompt tokens by source",
                                     ["source"], registry=r)
        self.ttft = Histogram("turnkv_time_to_first_token_seconds", "Router-measured TTFT",
                              ["mode"], buckets=_LATENCY_BUCKETS, registry=r)
        self.sessions = Gauge("turnkv_sessions", "Sessions in the table", registry=r)
        self.engine_healthy = Gauge("turnkv_engine_healthy", "1 if the engine answers /health",
                                    ["engine"], registry=r)

    def record(self, stats: TurnStats, tagged: bool) -> None:
        self.turns.labels(stats.mode, str(tagged).lower()).inc()
        if stats.fallback:
            self.fallbacks.labels(stats.fallback).inc()
        if stats.prefix_break_at is not None:
            self.prefix_breaks.inc()
        tokens = stats.prompt_tokens
        for source in ("prefill_cached", "prefill_received", "prefill_computed",
                       "decode_cached", "decode_received", "decode_computed"):
            value = getattr(tokens, source)
            if value:
                self.prompt_tokens.labels(source).inc(value)
        if stats.times.first_token_ms is not None:
            self.ttft.labels(stats.mode).observe(stats.times.first_token_ms / 1000)
