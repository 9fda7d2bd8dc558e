"""The simulator against `turnkv bench`: each run of a results.json replayed turn for turn on
the simulated layout of its mode, with costs fitted from the same file's runs (every mode's:
one cost model for the machine), and the bench's median TTFT after the first turn and prefix
hit rate (`1 - recompute_fraction`) beside the simulator's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from statistics import median
from typing import Any

from turnkv_server.sim.bench_modes import BENCH_ROUTINGS
from turnkv_server.sim.bench_tiers import shares_tier, tier_tokens
from turnkv_server.sim.bench_workloads import bench_homes, preset_prefix, replay_records
from turnkv_server.sim.calibration import calibrate
from turnkv_server.sim.fleet import Fleet, FleetSpec
from turnkv_server.sim.service_costs import ServiceCosts
from turnkv_server.sim.summary import summarize

# The bench's modes as simulated routings (`bench_modes`), on two engines; the host tier below
# each engine's cache, and the tier they shared, the run's (`bench_tiers`).
ROUTINGS = BENCH_ROUTINGS
ENGINES = 2


def bench_figures(result: Mapping[str, Any], mode: str) -> dict[str, Any]:
    """The bench's figures for `mode`: the medians over its finished runs, the later TTFT's
    range over them, and how many there were."""
    summaries = [s for s in result["summaries"] if s["mode"] == mode
                 and s["status"]["state"] == "ok"]
    later = [s["ttft_ms_later"]["p50"] for s in summaries if s["ttft_ms_later"]["p50"]]
    hits = [1 - s["recompute_fraction"] for s in summaries
            if s.get("recompute_fraction") is not None]
    return {"ttft_later_p50_ms": median(later) if later else None,
            "ttft_later_p50_range_ms": (min(later), max(later)) if later else None,
            "hit_rate": median(hits) if hits else None, "runs": len(summaries)}


def simulate_run(run: Mapping[str, Any], costs: ServiceCosts, concurrency: int | None,
                 prefix: tuple[str | None, int] = (None, 0), created: str = "~"
                 ) -> dict[str, Any]:
    """One bench run replayed turn for turn on its mode's layout: its cache size, its host
    tier where the mode has one, the tier its engines shared where they did, and (pooled
    engines) each session on the engine the bench served it on."""
    if run.get("kv_cache_tokens"):
        costs = replace(costs, kv_capacity_tokens=int(run["kv_cache_tokens"]))
    spec = FleetSpec(ROUTINGS[run["mode"]], ENGINES, costs, tier_tokens=tier_tokens(run, created),
                     shared_tier=shares_tier(run), concurrency=concurrency,
                     itl_target_ms=run.get("config", {}).get("itl_target_ms"))
    homes = bench_homes(run) if spec.routing == "affinity" else {}
    return summarize(Fleet(spec).run(replay_records(run["records"], *prefix, homes)))


def validate(result: Mapping[str, Any], modes: Sequence[str]) -> list[dict[str, Any]]:
    """One row per mode: the bench's figures (median over its runs; the later TTFT's range
    over them too, to read an error against how much the bench's own repeats differ), the
    simulator's (median over the same runs replayed) and the relative error of each."""
    costs = calibrate(result)
    concurrency = result.get("workload", {}).get("concurrency")
    prefix = preset_prefix(result.get("workload", {}).get("name", ""))
    rows = []
    for mode in modes:
        runs = [r for r in result["runs"] if r["mode"] == mode
                and r.get("status", {}).get("state") == "ok"]
        bench = bench_figures(result, mode)
        if not runs or mode not in ROUTINGS:
            rows.append({"mode": mode, "bench": bench, "sim": None, "error": None})
            continue
        sims = [simulate_run(r, costs, concurrency, prefix, result.get("created", "~"))
                for r in runs]
        sim = {"ttft_later_p50_ms": median(s["ttft_ms_later"]["p50"] or 0 for s in sims),
               "hit_rate": median(s["hit_rate"] or 0 for s in sims)}
        row: dict[str, Any] = {"mode": mode, "bench": bench, "sim": sim}
        rows.append({**row, "error": {
            k: None if not bench[k] else round(sim[k] / bench[k] - 1, 4)
            for k in ("ttft_later_p50_ms", "hit_rate")}})
    return rows
