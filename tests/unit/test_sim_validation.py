"""The simulator against `turnkv bench`: each bench mode replayed on a layout that has what the
bench mode had."""

from __future__ import annotations

from typing import Any

import pytest

from turnkv_server.sim.bench_workloads import bench_homes, replay_records
from turnkv_server.sim.fleet import Fleet, FleetSpec
from turnkv_server.sim.report import validation_table
from turnkv_server.sim.service_costs import ServiceCosts
from turnkv_server.sim.validation import bench_figures, simulate_run

_COSTS = ServiceCosts("test", 50.0, 1.0, 0.0, 40.0, 5.0, 50.0, 50.0, 4096, 16, 100)


def _run(mode: str) -> dict[str, Any]:
    # Two sessions of two turns; the caches hold 1,000 tokens at 100 bytes a token, and the
    # host tier of the modes that have one 48 blocks of 128 tokens, as `bound`'s cache.
    records = []
    for s in range(2):
        for turn in range(2):
            start = 10.0 * turn + s
            records.append({"session_id": f"s{s}", "turn": turn, "prompt_tokens": 300 + 400 * turn,
                            "completion_tokens": 20, "ttft_ms": 100.0, "started_at": start,
                            "ended_at": start + 2.0, "error": None})
    return {"mode": mode, "status": {"state": "ok"}, "records": records,
            "kv_cache_tokens": 1000,
            "config": {"kv_cache_bytes": 100_000, "bound_kv_cache_bytes": 614_400,
                       "tier_host_blocks": 48}}


@pytest.mark.parametrize(("mode", "routing", "eviction", "tier"), [
    ("affinity", "affinity", "lru", 0),
    ("bound", "affinity", "lru", 0),
    ("standard", "standard", "lru", 0),
    ("affinity-offload", "affinity", "lru", 6144),
    ("turnkv", "turnkv", "lease", 6144),
    ("turnkv-own-tier", "turnkv", "lease", 6144),
])
def test_a_bench_mode_is_simulated_with_what_it_ran(mode: str, routing: str, eviction: str,
                                                     tier: int) -> None:
    got = simulate_run(_run(mode), _COSTS, None)
    assert (got["routing"], got["eviction"], got["tier_tokens"]) == (routing, eviction, tier)


def test_a_result_made_before_its_mode_had_a_tier_is_simulated_without_one() -> None:
    got = simulate_run(_run("turnkv"), _COSTS, None, created="2026-12-02T05:10:23.98Z")
    assert got["tier_tokens"] == 0


def test_a_pooled_replay_homes_each_session_where_the_bench_served_it() -> None:
    # The bench's router put both sessions on engine-1 (its counters count all their prompt
    # tokens): the replay keeps them there rather than spreading them one per engine.
    run = _run("affinity")
    sent = sum(r["prompt_tokens"] for r in run["records"])
    run["engine_counters"] = {"engine-0": {"prompt_tokens": 0.0},
                              "engine-1": {"prompt_tokens": float(sent)}}
    sessions = replay_records(run["records"], homes=bench_homes(run))
    served = Fleet(FleetSpec("affinity", 2, _COSTS)).run(sessions).outcomes
    assert {o.prefill for o in served} == {"engine-1"}


@pytest.mark.parametrize(("mode", "host_tier", "created", "tier"), [
    # The run's own record wins over the mode's table and the cut-off date.
    ("turnkv", 48, "2026-12-02T05:10:23.98Z", 6144),
    ("turnkv", None, "~", 0),
    ("affinity", 48, "~", 6144),
    # Results made before runs recorded it: inferred from the mode, as before.
    ("turnkv", "absent", "~", 6144),
    ("affinity", "absent", "~", 0),
])
def test_a_runs_recorded_host_tier_decides_its_replays_tier(
        mode: str, host_tier: int | None | str, created: str, tier: int) -> None:
    run = _run(mode)
    if host_tier != "absent":
        run["config"]["host_tier_blocks"] = host_tier
    assert simulate_run(run, _COSTS, None, created=created)["tier_tokens"] == tier


@pytest.mark.parametrize(("recorded", "shared"), [(True, True), (False, False), ("absent", False)])
def test_a_runs_engines_share_a_tier_in_its_replay_where_they_did(
        recorded: bool | str, shared: bool) -> None:
    run = _run("turnkv")
    if recorded != "absent":
        run["config"]["shared_tier"] = recorded
    assert simulate_run(run, _COSTS, None)["shared_tier"] is shared


def test_the_table_sets_the_bench_runs_range_beside_their_median() -> None:
    # Three affinity runs of the bench, later TTFT p50 900, 1,000 and 1,500 ms: the median
    # 1,000 is the row's; the range 900-1,500 says how far the bench's own repeats differ.
    summaries = [{"mode": "affinity", "status": {"state": "ok"}, "recompute_fraction": 0.25,
                  "ttft_ms_later": {"p50": p50}} for p50 in (1500.0, 900.0, 1000.0)]
    bench = bench_figures({"summaries": summaries}, "affinity")
    assert (bench["ttft_later_p50_ms"], bench["ttft_later_p50_range_ms"]) == (1000, (900, 1500))
    row = {"workload": "agent", "mode": "affinity", "source": "r.json", "bench": bench,
           "sim": {"ttft_later_p50_ms": 1100.0, "hit_rate": 0.75},
           "error": {"ttft_later_p50_ms": 0.1, "hit_rate": 0.0}}
    assert "| 1,000 | 900-1,500 | 1,100 | +10.0% |" in validation_table([row])
