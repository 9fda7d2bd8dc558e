"""The simulator against `turnkv bench`: each run of a results.json replayed turn for turn on
the simulated layout of its mode, with costs fitted from the same file's runs (every mode's:
one cost model for the machine), and the bench's median TTFT after the first turn and prefix
hit rate (`1 - recompute_fraction`) beside the simulator's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from statistics import median
from typing import Any

from turnkv_server.sim.bench_workloads import preset_prefix, replay_records
from turnkv_server.sim.calibration import calibrate
from turnkv_server.sim.fleet import Fleet, FleetSpec, RoutingName
from turnkv_server.sim.service_costs import ServiceCosts
from turnkv_server.sim.summary import summarize

# The bench's modes as simulated layouts: (routing, engines, host tier).
LAYOUTS: dict[str, tuple[RoutingName, int, bool]] = {
    "affinity": ("affinity", 2, False),
    "affinity-offload": ("affinity", 2, True),
    "bound": ("affinity", 2, False),
    "standard": ("standard", 2, False),
    "turnkv": ("turnkv", 2, False),
    "turnkv-tier": ("turnkv", 2, True),
}


def _bench_figures(result: Mapping[str, Any], mode: str) -> dict[str, float | None]:
    summaries = [s for s in result["summaries"] if s["mode"] == mode
                 and s["status"]["state"] == "ok"]
    later = [s["ttft_ms_later"]["p50"] for s in summaries if s["ttft_ms_later"]["p50"]]
    hits = [1 - s["recompute_fraction"] for s in summaries
            if s.get("recompute_fraction") is not None]
    return {"ttft_later_p50_ms": median(later) if later else None,
            "hit_rate": median(hits) if hits else None, "runs": len(summaries)}


def _tier_tokens(result: Mapping[str, Any], run: Mapping[str, Any]) -> int:
    blocks = run.get("config", {}).get("tier_host_blocks") or 0
    size = run.get("config", {}).get("bound_kv_cache_bytes")
    per_token = (run["config"].get("kv_cache_bytes") or 0) / max(1, run.get("kv_cache_tokens") or 1)
    if size and per_token:
        return int(size / per_token)
    return int(blocks) * 128


def simulate_run(run: Mapping[str, Any], costs: ServiceCosts, concurrency: int | None,
                 tier_tokens: int = 0, prefix: tuple[str | None, int] = (None, 0)
                 ) -> dict[str, Any]:
    routing, engines, tier = LAYOUTS[run["mode"]]
    if run.get("kv_cache_tokens"):
        costs = replace(costs, kv_capacity_tokens=int(run["kv_cache_tokens"]))
    spec = FleetSpec(routing, engines, costs, tier_tokens=tier_tokens if tier else 0,
                     concurrency=concurrency,
                     itl_target_ms=run.get("config", {}).get("itl_target_ms"))
    return summarize(Fleet(spec).run(replay_records(run["records"], *prefix)))


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
        if not runs or mode not in LAYOUTS:
            rows.append({"mode": mode, "bench": bench, "sim": None, "error": None})
            continue
        sims = [simulate_run(r, costs, concurrency, _tier_tokens(result, r), prefix)
                for r in runs]
        sim = {"ttft_later_p50_ms": median(s["ttft_ms_later"]["p50"] or 0 for s in sims),
               "hit_rate": median(s["hit_rate"] or 0 for s in sims)}
        row: dict[str, Any] = {"mode": mode, "bench": bench, "sim": sim}
        rows.append({**row, "error": {
            k: None if not bench[k] else round(sim[k] / bench[k] - 1, 4)  # type: ignore[operator]
            for k in ("ttft_later_p50_ms", "hit_rate")}})
    return rows
