"""What a benchmark run will do, decided before any engine starts: modes, settings, workload.

Everything here is checked up front so that a bad option fails in a second with a clear
message, not after the first mode's engines took a minute to start.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from turnkv_server.bench import presets
from turnkv_server.bench.options import DEFAULTS, WORKLOADS
from turnkv_server.bench.sizing import TokenCounter, approx_tokens
from turnkv_server.bench.trace import load_trace
from turnkv_server.bench.workloads import Workload
from turnkv_server.launcher import ClusterConfig
from turnkv_server.launcher.engine import resolve_dtype
from turnkv_server.mode_names import (
    BENCH_MODES,
    bench_layout,
    cluster_mode,
    has_host_tier,
    is_bench_mode,
    itl_variant_target,
    tagged_mode,
)
from turnkv_server.router.config import itl_target_args

_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


class PlanError(ValueError):
    """A benchmark option that cannot work; the message says which and why."""


_CHOICES = f"{', '.join(BENCH_MODES)}, turnkv-itl<ms>, any of them as <mode>-untagged"


def parse_modes(text: str) -> list[str]:
    """'single,standard,...' -> the modes in order, each once; unknown names are an error."""
    modes: list[str] = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        if not is_bench_mode(name):
            raise PlanError(f"unknown mode {name!r}; choose from {_CHOICES}")
        if name not in modes:
            modes.append(name)
    if not modes:
        raise PlanError(f"no mode given; choose from {_CHOICES}")
    return modes


def pick_baseline(modes: list[str], baseline: str | None) -> str:
    """The mode ratios divide by: as asked, else `affinity` if it runs (what a platform runs
    instead of P/D, on the same cores), else `standard` if it runs, else the first mode."""
    if baseline is None:
        return next((m for m in ("affinity", "standard") if m in modes), modes[0])
    if baseline not in modes:
        raise PlanError(f"baseline {baseline!r} is not among the modes run ({', '.join(modes)})")
    return baseline


@dataclass(frozen=True)
class BenchSettings:
    """The cluster settings every mode starts from, and the runner's limits: the options'
    (`options.BenchOptions`, whose defaults these are) and what `bench.cli` sizes from them."""

    model: str = DEFAULTS.model
    dtype: str = DEFAULTS.dtype
    kv_cache_bytes: int | None = None
    max_model_len: int | None = None
    block_size: int | None = None  # None: vLLM's
    decoder_kv_ttl: float = 120.0
    # bidirectional: read back only when at least this many tokens are missing (None: vLLM's
    # 64; 0: always, which short test prompts need to show any read-back).
    kv_recompute_threshold: int | None = None
    # turnkv: turns adding at most this many tokens run on the decode engine alone (None: the
    # router's default).
    short_delta_tokens: int | None = None
    # turnkv: the router's --itl-target-ms (None: off; a `turnkv-itl<ms>` mode sets its own).
    itl_target_ms: float | None = None
    # bound: each engine's KV cache, enough to hold every session (None: the engines' default).
    bound_kv_cache_bytes: int | None = None
    # The modes with a host tier (`mode_names.has_host_tier`): each engine's tier in blocks
    # (as many as `bound`'s cache holds).
    tier_host_blocks: int | None = None
    turn_timeout_s: float = DEFAULTS.turn_timeout
    stall_timeout_s: float = DEFAULTS.stall_timeout
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("turn_timeout_s", "stall_timeout_s", "startup_timeout_s"):
            if getattr(self, name) <= 0:
                raise PlanError(f"{name} must be positive")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise PlanError("kv_cache_bytes must be positive")

    def describe(self) -> dict[str, Any]:
        """The settings as recorded in each mode's `config`, with the dtype resolved."""
        return {**asdict(self), "dtype": resolve_dtype(self.dtype)}


def layout(mode: str) -> dict[str, int]:
    """How many engines `mode` runs and how many cores each gets (`mode_names.bench_layout`),
    as each run's results record it."""
    engines, cores = bench_layout(mode)
    return {"engine_count": engines, "cores_per_engine": cores}


def mode_settings(mode: str, settings: BenchSettings) -> BenchSettings:
    """`settings` as `mode` runs them: a `turnkv-itl<ms>` mode with its own ITL target,
    `bound` with caches that hold every session; every other mode as given (and
    `<mode>-untagged` as `<mode>`)."""
    mode = tagged_mode(mode)
    target = itl_variant_target(mode)
    if target is not None:
        return replace(settings, itl_target_ms=target)
    if mode == "bound":
        return replace(settings, kv_cache_bytes=settings.bound_kv_cache_bytes)
    return settings


def run_config(mode: str, settings: BenchSettings, cluster: ClusterConfig) -> dict[str, Any]:
    """A run's `config` in the results: the settings as `mode` ran them (`tier_host_blocks`
    is the bench's, recorded for every mode), its layout, and what its own cluster had:
    `host_tier_blocks`, the host tier below each engine's cache (None: the mode has none), and
    whether a file tier below them was shared by its engines."""
    return {"mode": mode, **mode_settings(mode, settings).describe(), **layout(mode),
            "prefill_cache": cluster.prefill_cache, "host_tier_blocks": cluster.tier_host_blocks,
            "shared_tier": cluster.shares_tier(), "run_dir": str(cluster.run_dir)}


def cluster_config(mode: str, settings: BenchSettings, run_dir: Path) -> ClusterConfig:
    """The launcher's configuration for `mode`: one prefill + one decode engine, two
    aggregated engines (`affinity`, `bound`) or one single engine, on the cores `layout` gives
    it; everything else from `mode_settings`, the same for every mode but what it changes."""
    if not is_bench_mode(mode):
        raise PlanError(f"unknown mode {mode!r}")
    engines, cores = bench_layout(mode)
    settings = mode_settings(mode, settings)
    mode = tagged_mode(mode)  # the untagged variant's cluster is the mode's own
    config = ClusterConfig(
        mode=cluster_mode(mode),
        num_aggregated=engines,
        cores_per_engine=cores,
        model=settings.model,
        dtype=settings.dtype,
        prefill_cache=mode != "standard-nocache",
        kv_cache_bytes=settings.kv_cache_bytes,
        max_model_len=settings.max_model_len,
        block_size=settings.block_size,
        decoder_kv_ttl=settings.decoder_kv_ttl,
        kv_recompute_threshold=settings.kv_recompute_threshold,
        short_delta_tokens=settings.short_delta_tokens,
        router_args=(*itl_target_args(settings.itl_target_ms),
                     *(["--pair-pool"] if mode == "turnkv-pool" else []),
                     *(["--no-landing-holds"] if mode == "turnkv-no-hold" else []),
                     *(["--fixed-pools"] if mode == "turnkv-tier" else [])),
        connector_settings={"layer_writes": False} if mode == "turnkv-end-write" else {},
        tier_host_blocks=settings.tier_host_blocks if has_host_tier(mode) else None,
        engine_leases=mode == "affinity-tier",
        tier_shared=False if mode == "turnkv-own-tier" else None,
        startup_timeout=settings.startup_timeout_s,
        run_dir=run_dir,
    )
    # The results say `layout`: it must be what starts.
    if len(config.roles()) != engines:
        raise PlanError(f"{mode} starts {len(config.roles())} engines, its layout says {engines}")
    return config


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """KV cache bytes one token takes in a model folder's Llama-style config at `dtype`:
    layers x (K and V) x KV heads x head size x bytes per element."""
    config = json.loads((model_dir / "config.json").read_text())
    resolved = resolve_dtype(dtype)
    if resolved == "auto":
        resolved = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    if resolved not in _DTYPE_BYTES:
        raise PlanError(f"cannot size the KV cache of dtype {resolved!r}")
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    layers = int(config["num_hidden_layers"])
    return layers * 2 * kv_heads * head_dim * _DTYPE_BYTES[resolved]


def build_workload(name: str, *, seed: int = 0, sessions: int | None = None,
                   concurrency: int | None = None, trace: Path | None = None,
                   kv_cache_tokens: int | None = None,
                   count_tokens: TokenCounter = approx_tokens) -> Workload:
    """The workload of a preset (with overrides) or a trace file.

    `kv_cache_tokens` sizes the presets in `presets.PRESSURE` (their sessions are added until
    their context is a multiple of the cache); `sessions` caps how many it may add.
    `count_tokens` sizes generated text: pass the served model's (`sizing.tokenizer_counter`)
    so contexts fit it.
    """
    if name == "trace":
        if trace is None:
            raise PlanError("--workload trace needs --trace FILE")
        if not trace.is_file():
            raise PlanError(f"trace file {trace} does not exist")
        workload = load_trace(trace)
        if concurrency is not None:
            workload = workload.model_copy(update={"concurrency": concurrency})
        return workload
    if trace is not None:
        raise PlanError("--trace goes with --workload trace")
    if name not in presets.PRESETS:
        raise PlanError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    overrides: dict[str, Any] = {}
    if sessions is not None:
        overrides["sessions"] = sessions
    if concurrency is not None:
        overrides["concurrency"] = concurrency
    try:
        if name in presets.PRESSURE:
            return presets.build_workload(name, seed, count_tokens,
                                          kv_cache_tokens=kv_cache_tokens, **overrides)
        return presets.build_workload(name, seed, count_tokens, **overrides)
    except ValueError as exc:
        raise PlanError(str(exc)) from exc
