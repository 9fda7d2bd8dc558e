"""The workloads' names and how the pressure presets are sized: what the command line shows
without the benchmark's extra (numpy), declared here once; `presets` builds the workloads."""

from __future__ import annotations

from dataclasses import dataclass

PRESETS = ("agent", "chat", "conversation", "smoke", "memory-pressure", "agent-pressure",
           "agent-longtool")


@dataclass(frozen=True)
class Pressure:
    """How a pressure preset is sized: against one engine's KV cache of `cache_tokens` (unless
    `--kv-cache-bytes` gives another), sessions are added until their total context is more
    than `factor` times it."""

    cache_tokens: int
    factor: float


# memory-pressure: 4,096 tokens per engine (32 blocks of 128), small enough that a handful of
# sessions outgrows it. An earlier measurement (10 sessions, SmolLM2 in bf16, one core per
# engine) used a cache of 20,864 tokens and 47k tokens of context on a machine that prefilled
# about 10x faster; `--kv-cache-bytes` reproduces that cache.
# agent-pressure: 3,072 tokens, just above its sessions' longest context (vLLM refuses a cache
# that cannot hold one request), and three times what two engines' caches hold together (a P/D
# pair, or two aggregated engines) in live sessions.
PRESSURE: dict[str, Pressure] = {"memory-pressure": Pressure(4_096, 2.0),
                                 "agent-pressure": Pressure(3_072, 6.0)}
DEFAULT_KV_CACHE_TOKENS = PRESSURE["memory-pressure"].cache_tokens
DEFAULT_PRESSURE = PRESSURE["memory-pressure"].factor
# A cap so that a huge cache cannot make the memory-pressure workload endless.
MAX_PRESSURE_SESSIONS = 500
