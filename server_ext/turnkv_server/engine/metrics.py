"""A vLLM engine's `/metrics`, read: the one parser of its Prometheus text, for vLLM's own
metrics and the turnkv connector's (`turnkv:*`).

Fetching is the caller's, with its own HTTP client: the router reads an engine's block size
through its aiohttp pool; the benchmark, the tests and the scripts use `fetch` (httpx,
synchronous).

`usage.prompt_tokens_details.cached_tokens` is wrong on a decode engine (it reports the prefill
engine's hits), while `vllm:prompt_tokens_by_source_total` counts each engine's own work
correctly: differences of these counters are each engine's honest account of a run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from turnkv_server import local_http

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CONNECTOR_PREFIX = "turnkv:"
# What to sum, by result name: (metric family, sample suffix, label filter). A histogram's
# `_sum` is its running total, its `_count` the number of observations.
Selection = tuple[str, str, tuple[str, str] | None]


def families(metrics_text: str) -> Iterable[Metric]:
    return text_string_to_metric_families(metrics_text)


def sum_samples(metrics_text: str, wanted: Mapping[str, Selection]) -> dict[str, float]:
    """Each selection's samples summed over other labels; one the engine does not export is
    absent, not 0 (vLLM registers some lazily, and a `single` engine has no NIXL)."""
    by_family: dict[str, list[tuple[str, str, tuple[str, str] | None]]] = {}
    for name, (family_name, suffix, label) in wanted.items():
        by_family.setdefault(family_name, []).append((name, suffix, label))
    found: dict[str, float] = {}
    for family in families(metrics_text):
        for name, suffix, label in by_family.get(family.name, []):
            for sample in family.samples:
                if sample.name != family.name + suffix:
                    continue
                if label is not None and sample.labels.get(label[0]) != label[1]:
                    continue
                found[name] = found.get(name, 0.0) + sample.value
    return found


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
    counts = sum_samples(metrics_text, {
        source: ("vllm:prompt_tokens_by_source", "_total", ("source", source))
        for source in SOURCES})
    return PromptTokenSources(*(int(counts.get(s, 0.0)) for s in SOURCES))


@dataclass(frozen=True)
class CacheConfig:
    """The engine's KV cache, from `vllm:cache_config_info` (None: not reported)."""

    block_size: int | None = None
    num_gpu_blocks: int | None = None

    @property
    def tokens(self) -> int | None:
        """Its capacity in tokens."""
        if self.block_size is None or self.num_gpu_blocks is None:
            return None
        return self.block_size * self.num_gpu_blocks


CACHE_CONFIG = "vllm:cache_config_info"


def parse_cache_config(metrics_text: str) -> CacheConfig:
    return next((_cache_config(f) for f in families(metrics_text) if f.name == CACHE_CONFIG),
                CacheConfig())


def _cache_config(family: Metric) -> CacheConfig:
    # An info metric: one sample, whose labels are the settings.
    for sample in family.samples:
        return CacheConfig(_int_label(sample.labels, "block_size"),
                           _int_label(sample.labels, "num_gpu_blocks"))
    return CacheConfig()


def parse_connector_counters(metrics_text: str) -> dict[str, float]:
    """The turnkv connector's counters and gauges (`turnkv:*`), summed over label sets, by
    name without the prefix and the `_total` suffix; vLLM's KV cache usage as `kv_cache_usage`
    and its cache's size as `num_gpu_blocks` and `block_size`."""
    values: dict[str, float] = {}
    cache = CacheConfig()
    for family in families(metrics_text):
        if family.name.startswith(CONNECTOR_PREFIX):
            name = family.name[len(CONNECTOR_PREFIX):]
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                values[name] = values.get(name, 0.0) + sample.value
        elif family.name == "vllm:kv_cache_usage_perc":
            values["kv_cache_usage"] = sum(s.value for s in family.samples)
        elif family.name == CACHE_CONFIG:
            cache = _cache_config(family)
    if cache.num_gpu_blocks is not None:
        values["num_gpu_blocks"] = float(cache.num_gpu_blocks)
    if cache.block_size is not None:
        values["block_size"] = float(cache.block_size)
    return values


def _int_label(labels: Mapping[str, str], name: str) -> int | None:
    value = labels.get(name)
    return int(value) if value and value.isdigit() else None


def fetch(engine_url: str, timeout: float = 5.0) -> str:
    """An engine's `/metrics` text; raises `httpx.HTTPError` if it does not answer with it."""
    response = local_http.get(f"{engine_url}/metrics", timeout=timeout)
    response.raise_for_status()
    return response.text


def fetch_prompt_token_sources(engine_url: str, timeout: float = 5.0) -> PromptTokenSources:
    return parse_prompt_token_sources(fetch(engine_url, timeout))


def fetch_connector_counters(engine_url: str, timeout: float = 5.0) -> dict[str, float]:
    return parse_connector_counters(fetch(engine_url, timeout))
