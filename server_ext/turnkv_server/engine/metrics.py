"""Reading a vLLM engine's Prometheus counters.

`usage.prompt_tokens_details.cached_tokens` is wrong on a decode engine (it reports the prefill
engine's hits), while `vllm:prompt_tokens_by_source_total` counts each engine's own work
correctly. Until the router measures each turn itself, differences of these counters are the
honest per-turn breakdown for sequential traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@dataclass(frozen=True)
class PromptTokenSources:
    """Prompt tokens an engine computed, found in its prefix cache, or received over KV transfer."""

    local_compute: int = 0
    local_cache_hit: int = 0
    external_kv_transfer: int = 0

    def __sub__(self, other: PromptTokenSources) -> PromptTokenSources:
        return PromptTokenSources(
            self.local_compute - other.local_compute,
            self.local_cache_hit - other.local_cache_hit,
            self.external_kv_transfer - other.external_kv_transfer,
        )

    @property
    def total(self) -> int:
        return self.local_compute + self.local_cache_hit + self.external_kv_transfer


def parse_prompt_token_sources(metrics_text: str) -> PromptTokenSources:
    counts = dict.fromkeys(SOURCES, 0.0)
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "vllm:prompt_tokens_by_source":
            continue
        for sample in family.samples:
            source = sample.labels.get("source")
            if sample.name.endswith("_total") and source in counts:
                counts[source] += sample.value
    return PromptTokenSources(*(int(counts[s]) for s in SOURCES))


def fetch_prompt_token_sources(engine_url: str, timeout: float = 5.0) -> PromptTokenSources:
    response = httpx.get(f"{engine_url}/metrics", timeout=timeout)
    response.raise_for_status()
    return parse_prompt_token_sources(response.text)


def parse_connector_counters(metrics_text: str) -> dict[str, float]:
    """The turnkv connector's counters and gauges (`turnkv:*`), summed over label sets, by
    name without the prefix and the `_total` suffix; vLLM's KV cache usage as `kv_cache_usage`
    and its block count as `num_gpu_blocks`."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name.startswith("turnkv:"):
            name = family.name[len("turnkv:"):]
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                values[name] = values.get(name, 0.0) + sample.value
        elif family.name == "vllm:kv_cache_usage_perc":
            values["kv_cache_usage"] = sum(s.value for s in family.samples)
        elif family.name == "vllm:cache_config_info":
            for sample in family.samples:
                blocks = sample.labels.get("num_gpu_blocks")
                if blocks and blocks.isdigit():
                    values["num_gpu_blocks"] = float(blocks)
                size = sample.labels.get("block_size")
                if size and size.isdigit():
                    values["block_size"] = float(size)
    return values


def fetch_connector_counters(engine_url: str, timeout: float = 5.0) -> dict[str, float]:
    response = httpx.get(f"{engine_url}/metrics", timeout=timeout)
    response.raise_for_status()
    return parse_connector_counters(response.text)
