"""Engine counters for one benchmark mode: `/metrics` snapshots, their deltas, the KV cache size.

Per-turn numbers come from the router; these counters are each engine's own account of the
whole run (prompt tokens by source, KV bytes moved over NIXL, preemptions), which also covers
what the router cannot see, such as what a decode engine pulled. The text is read by the
engines' one parser (`turnkv_server.engine.metrics`).
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx

from turnkv_server.engine import metrics
from turnkv_server.engine.metrics import Selection

# Counter names as they appear in the result.
COUNTERS: dict[str, Selection] = {
    "prompt_tokens_local_compute": (
        "vllm:prompt_tokens_by_source", "_total", ("source", "local_compute")),
    "prompt_tokens_local_cache_hit": (
        "vllm:prompt_tokens_by_source", "_total", ("source", "local_cache_hit")),
    "prompt_tokens_external_kv_transfer": (
        "vllm:prompt_tokens_by_source", "_total", ("source", "external_kv_transfer")),
    "prompt_tokens": ("vllm:prompt_tokens", "_total", None),
    "generation_tokens": ("vllm:generation_tokens", "_total", None),
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "_total", None),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "_total", None),
    "preemptions": ("vllm:num_preemptions", "_total", None),
    "nixl_bytes_transferred": ("vllm:nixl_bytes_transferred", "_sum", None),
    "nixl_transfers": ("vllm:nixl_bytes_transferred", "_count", None),
    # The turnkv connector counts each transfer once, on the engine that received it.
    "turnkv_bytes_received": ("turnkv:bytes_received", "_total", None),
    # ...and its sender: the bytes it wrote while the request computed, and the time from the
    # last write's start to its end (on a prefill engine: what the decode engine waits for).
    "turnkv_bytes_sent": ("turnkv:bytes_sent", "_total", None),
    "turnkv_bytes_streamed": ("turnkv:bytes_streamed", "_total", None),
    "turnkv_sends_done": ("turnkv:sends_done", "_total", None),
    "turnkv_send_seconds": ("turnkv:send_seconds", "_total", None),
    "turnkv_blocks_received": ("turnkv:blocks_received", "_total", None),
    "turnkv_receives_failed": ("turnkv:receives_failed", "_total", None),
    "turnkv_leases_pressure": ("turnkv:leases_pressure", "_total", None),
}


def parse_counters(metrics_text: str) -> dict[str, float]:
    """The `COUNTERS` an engine's `/metrics` text has, summed over other labels.

    A counter the engine does not export (no NIXL in `single` mode) is absent, not 0.
    """
    return metrics.sum_samples(metrics_text, COUNTERS)


def counter_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """after - before for every counter the engine exported at the end of the run.

    A counter first exported during the run (vLLM registers some lazily) started from 0.
    """
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


def parse_kv_cache_tokens(metrics_text: str) -> int | None:
    """KV cache capacity in tokens (blocks x block size) from `vllm:cache_config_info`."""
    return metrics.parse_cache_config(metrics_text).tokens


def fetch_metrics(engine_url: str, timeout: float = 10.0) -> str | None:
    """An engine's `/metrics` text, or None if it does not answer (a stalled or dead engine)."""
    try:
        return metrics.fetch(engine_url, timeout)
    except httpx.HTTPError:
        return None
