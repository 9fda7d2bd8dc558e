"""The simulator against `turnkv bench`: each run of a results.json replayed turn for turn on
the simulated layout of its mode, with costs fitted from the same file's runs (every mode's:
one cost model for the machine), and the bench's median TTFT after the first turn and prefix
hit rate (`1 - recompute_fraction`) beside the simulator's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from statistics import median
from typing import Any

from turnkv_server.bench.cli import VLLM_CPU_BLOCK_TOKENS
from turnkv_server.mode_names import has_host_tier
from turnkv_server.sim.bench_modes import BENCH_ROUTINGS
from turnkv_server.sim.bench_workloads import bench_homes, preset_prefix, replay_records
from turnkv_server.sim.calibration import calibrate
from turnkv_server.sim.fleet import Fleet, FleetSpec
from turnkv_server.sim.service_costs import ServiceCosts
from turnkv_server.sim.summary import summarize

# The bench's modes as simulated routings (`bench_modes`), on two engines; whether a mode has a
# host tier below each engine's cache is the bench's own table's (`mode_names.has_host_tier`).
ROUTINGS = BENCH_ROUTINGS
ENGINES = 2
# Modes that gained their host tier after results were first made with them, and when (UTC, as
# a result's `created` reads), for runs that do not record their own (`host_tier_blocks` in
# their `config`): before that, a run's `config` named the bench's tier size for every mode,
# not whether its mode had one.
TIER_SINCE = {"turnkv": "2026-12-03T18:52:30"}


def _bench_figures(result: Mapping[str, Any], mode: str) -> dict[str, float | None]:
    summaries = [s for s in result["summaries"] if s["mode"] == mode
                 and s["status"]["state"] == "ok"]
    later = [s["ttft_ms_later"]["p50"] for s in summaries if s["ttft_ms_later"]["p50"]]
    hits = [1 - s["recompute_fraction"] for s in summaries
            if s.get("recompute_fraction") is not None]
    return {"ttft_later_p50_ms": median(later) if later else None,
            "hit_rate": median(hits) if hits else None, "runs": len(summaries)}


def tier_tokens(run: Mapping[str, Any], created: str = "~") -> int:
    """Tokens of one engine's host tier in the bench run (0: it had none): the blocks its
    cluster had (`host_tier_blocks`), where the run does not record that the bench's tier
    (`tier_host_blocks`, as many as `bound`'s cache holds) if its mode has one, or where an
    older result does not say, `bound`'s cache at the run's bytes per token. `created`: the
    result's (default: made after every change of `TIER_SINCE`)."""
    config = run.get("config", {})
    block = int(config.get("block_size") or VLLM_CPU_BLOCK_TOKENS)
    if "host_tier_blocks" in config:
        return int(config["host_tier_blocks"] or 0) * block
    if not has_host_tier(run["mode"]) or created < TIER_SINCE.get(run["mode"], ""):
        return 0
    if config.get("tier_host_blocks"):
        return int(config["tier_host_blocks"]) * block
    per_token = (config.get("kv_cache_bytes") or 0) / max(1, run.get("kv_cache_tokens") or 1)
    size = config.get("bound_kv_cache_bytes")
    return int(size / per_token) if size and per_token else 0


def simulate_run(run: Mapping[str, Any], costs: ServiceCosts, concurrency: int | None,
                 prefix: tuple[str | None, int] = (None, 0), created: str = "~"
                 ) -> dict[str, Any]:
    """One bench run replayed turn for turn on its mode's layout: its cache size, its host
    tier where the mode has one, and (pooled engines) each session on the engine the bench
    served it on."""
    if run.get("kv_cache_tokens"):
        costs = replace(costs, kv_capacity_tokens=int(run["kv_cache_tokens"]))
    spec = FleetSpec(ROUTINGS[run["mode"]], ENGINES, costs, tier_tokens=tier_tokens(run, created),
                     concurrency=concurrency,
                     itl_target_ms=run.get("config", {}).get("itl_target_ms"))
    homes = bench_homes(run) if spec.routing == "affinity" else {}
    return summarize(Fleet(spec).run(replay_records(run["records"], *prefix, homes)))


def validate(result: Mapping[str, Any], modes: Sequence[str]) -> list[dict[str, Any]]:
    """One row per mode: the bench's figures (median over its runs), the simulator's (median
    over the same runs replayed) and the relative error of each."""
    costs = calibrate(result)
    concurrency = result.get("workload", {}).get("concurrency")
    prefix = preset_prefix(result.get("workload", {}).get("name", ""))
    rows = []
    for mode in modes:
        runs = [r for r in result["runs"] if r["mode"] == mode
                and r.get("status", {}).get("state") == "ok"]
        bench = _bench_figures(result, mode)
        if not runs or mode not in ROUTINGS:
            rows.append({"mode": mode, "bench": bench, "sim": None, "error": None})
            continue
        sims = [simulate_run(r, costs, concurrency, prefix, result.get("created", "~"))
                for r in runs]
        sim = {"ttft_later_p50_ms": median(s["ttft_ms_later"]["p50"] or 0 for s in sims),
               "hit_rate": median(s["hit_rate"] or 0 for s in sims)}
        row: dict[str, Any] = {"mode": mode, "bench": bench, "sim": sim}
        rows.append({**row, "error": {
            k: None if not bench[k] else round(sim[k] / bench[k] - 1, 4)  # type: ignore[operator]
            for k in ("ttft_later_p50_ms", "hit_rate")}})
    return rows
