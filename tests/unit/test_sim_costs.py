"""The simulator's cost models: fitted from bench records, derived from GPU figures, and the
policies the command line names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from turnkv_server.cli import app
from turnkv_server.sim.calibration import (
    calibrate,
    fit_join_wait,
    fit_prefill,
    fit_store_cost,
)
from turnkv_server.sim.fleet import FleetSpec
from turnkv_server.sim.gpu_profiles import PROFILES
from turnkv_server.sim.policy_specs import parse_policy
from turnkv_server.sim.service_costs import ServiceCosts


def _record(sid: str, turn: int, start: float, prompt: int, computed: int, ttft_ms: float,
            itl: float = 50.0) -> dict[str, object]:
    return {"session_id": sid, "turn": turn, "prompt_tokens": prompt, "prefill_cached": None,
            "prefill_computed": None, "decode_computed": computed, "completion_tokens": 9,
            "ttft_ms": ttft_ms, "prefill_phase_ms": 0.0, "itl_ms": [itl] * 8,
            "started_at": start, "ended_at": start + ttft_ms / 1000 + 0.4, "error": None}


def _keys(computed: int, prompt: int) -> float:
    """Keys the last `computed` tokens of a `prompt`-token prompt attend to (a query at
    position p, from 0, sees p keys)."""
    start = prompt - computed
    return (prompt * (prompt - 1) - start * (start - 1)) / 2


def _result() -> dict[str, object]:
    # Turns that ran alone, their TTFT exactly 100 + 0.5 x computed + 0.1 x the keys they
    # attend to / 1000 ms.
    records = [_record("s", i, 10.0 * i, prompt, computed,
                       100 + 0.5 * computed + 0.1 * _keys(computed, prompt) / 1000)
               for i, (prompt, computed) in enumerate(
                   [(500, 500), (1200, 700), (2000, 800), (3000, 1000), (4000, 300)])]
    run = {"mode": "affinity", "status": {"state": "ok"}, "records": records,
           "kv_cache_tokens": 8192, "config": {"engines": [{"role": "engine"}] * 2,
                                               "kv_cache_bytes": 8192 * 100}}
    return {"workload": {"name": "agent", "concurrency": None}, "model": "m",
            "runs": [run], "summaries": []}


def test_the_prefill_fit_recovers_the_curve_that_made_the_turns() -> None:
    fixed, per_token, per_kctx = fit_prefill(_result()["runs"])  # type: ignore[arg-type]
    assert (fixed, per_token, per_kctx) == pytest.approx((100, 0.5, 0.1), rel=1e-6)


@pytest.mark.parametrize(("computed", "prompt", "ms"), [
    # A whole prompt of 1,000: its tokens attend to 0..999 keys, 499,500 in all.
    (1000, 1000, 10 + 1000 * 1 + 2 * 499.5),
    # The last 100 of 1,100 (1,000 cached): 1,000..1,099 keys each, 104,950 in all.
    (100, 1100, 10 + 100 * 1 + 2 * 104.95),
    (0, 500, 0.0),
])
def test_a_prompts_attention_costs_the_keys_its_computed_tokens_attend_to(
        computed: int, prompt: int, ms: float) -> None:
    costs = ServiceCosts("c", prefill_fixed_ms=10, prefill_ms_per_token=1,
                         prefill_ms_per_token_per_kctx=2, decode_fixed_ms=1,
                         decode_ms_per_seq=1, transfer_tokens_per_ms=1, tier_tokens_per_ms=1,
                         kv_capacity_tokens=1000, block_size=16, kv_bytes_per_token=1)
    assert costs.prefill_ms(computed, prompt) == pytest.approx(ms)


def test_calibration_takes_the_runs_cache_and_bytes_per_token() -> None:
    costs = calibrate(_result())
    assert costs.kv_capacity_tokens == 8192
    assert costs.kv_bytes_per_token == 100
    # Every turn decoded alone at 50 ms a step.
    assert costs.decode_step_ms(1) == pytest.approx(50)


def test_a_gpu_profile_holds_the_published_shape() -> None:
    costs = PROFILES["h200-qwen3-32b"].costs()
    # 141 GB x 0.9 less 65.6 GB of bf16 weights, at 256 KiB a token.
    assert costs.kv_capacity_tokens == int((141e9 * 0.9 - 32.8e9 * 2) / 262_144)
    # A step reads the weights once: 65.6 GB at 70% of 4.8 TB/s.
    assert costs.decode_fixed_ms == pytest.approx(65.6e9 / (4.8e12 * 0.7) * 1000)


@pytest.mark.parametrize(("text", "routing", "order", "tier", "shared", "prefill"), [
    ("affinity", "affinity", "lru", 0, False, 1),
    ("turnkv", "turnkv", "lease", 0, False, 1),
    ("turnkv:lru+tier", "turnkv", "lru", 500, False, 1),
    ("turnkv+tier+shared", "turnkv", "lease", 500, True, 1),
    ("turnkv+shared", "turnkv", "lease", 0, True, 1),
    ("standard", "standard", "lru", 0, False, 4),
    ("standard@1:3", "standard", "lru", 0, False, 2),
    ("standard@3:1", "standard", "lru", 0, False, 6),
])
def test_policies_are_read_as_the_command_line_names_them(
        text: str, routing: str, order: str, tier: int, shared: bool, prefill: int) -> None:
    base = FleetSpec("affinity", 8, ServiceCosts("c", 1, 1, 0, 1, 1, 1, 1, 1000, 16, 1))
    spec = parse_policy(text, base, 500)
    assert (spec.routing, spec.order, spec.tier_tokens, spec.shared_tier,
            spec.prefill_engines) == (routing, order, tier, shared, prefill)


def test_a_policy_the_simulator_cannot_run_is_refused() -> None:
    base = FleetSpec("affinity", 8, ServiceCosts("c", 1, 1, 0, 1, 1, 1, 1, 1000, 16, 1))
    with pytest.raises(ValueError, match="standard's only"):
        parse_policy("turnkv@1:3", base, 0)
    with pytest.raises(ValueError, match="--tier-tokens"):
        parse_policy("affinity+tier", base, 0)
    with pytest.raises(ValueError, match="once each"):
        parse_policy("turnkv+tier+tier", base, 500)
    with pytest.raises(ValueError, match="only"):
        parse_policy("turnkv+disk", base, 500)


def test_turnkv_sim_writes_results_a_table_and_plots(tmp_path: Path) -> None:
    got = CliRunner().invoke(app, [
        "sim", "--workload", "smoke", "--sessions", "6", "--engines", "2", "--policy",
        "affinity", "--policy", "turnkv", "--out", str(tmp_path)])
    assert got.exit_code == 0, got.output
    results = json.loads((tmp_path / "results.json").read_text())
    assert [p["label"] for p in results["policies"]] == ["affinity/lru", "turnkv/lease"]
    assert all(p["turns"] == results["turns"] for p in results["policies"])
    assert (tmp_path / "summary.md").read_text().count("\n") == 4
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 0


def test_turns_alone_on_their_engine_fit_the_prefill_where_the_engines_are_known() -> None:
    # Two sessions on two engines, their turns always overlapping: none ran alone in the
    # fleet, each alone on its engine (the counters say which engine served which session).
    run = _result()["runs"][0]  # type: ignore[index]
    twins = [{**r, "session_id": "t", "started_at": r["started_at"] + 0.01}
             for r in run["records"][1:]]
    run["records"] = run["records"] + twins
    counted = {sid: float(sum(r["prompt_tokens"] for r in run["records"]
                              if r["session_id"] == sid)) for sid in ("s", "t")}
    run["engine_counters"] = {"engine-0": {"prompt_tokens": counted["s"]},
                              "engine-1": {"prompt_tokens": counted["t"]}}
    fixed, per_token, per_kctx = fit_prefill([run])
    assert (fixed, per_token, per_kctx) == pytest.approx((100, 0.5, 0.1), rel=1e-6)


def test_hits_that_are_all_multiples_of_two_blocks_do_not_double_the_block() -> None:
    result = _result()
    for i, record in enumerate(result["runs"][0]["records"]):  # type: ignore[index]
        record["prefill_cached"] = 256 * (i + 1)
    assert calibrate(result).block_size == 128


def test_runs_that_record_no_hit_ran_the_benchs_default_block() -> None:
    # The pooled modes' records name no prefix hit (`prefill_cached` None): nothing says the
    # block is smaller than the bench's default, vLLM's on CPU.
    assert calibrate(_result()).block_size == 128


def test_kv_a_mode_the_simulator_does_not_replay_moved_does_not_set_the_block() -> None:
    # The affinity run's hits are whole 128-token blocks; a `bidirectional` run's
    # `prefill_reused` is the KV it moved, the whole prompt (500, 1,200, ... tokens): the
    # block stays 128, not gcd(128, 500) = 4 (below 8, the default 16).
    result = _result()
    affinity = result["runs"][0]  # type: ignore[index]
    for i, record in enumerate(affinity["records"]):
        record["prefill_cached"] = 128 * (i + 1)
    moved = {**affinity, "mode": "bidirectional",
             "records": [{**r, "prefill_cached": None, "prefill_reused": r["prompt_tokens"]}
                         for r in affinity["records"]]}
    result["runs"] = [affinity, moved]
    assert calibrate(result).block_size == 128


def test_a_modes_own_work_per_turn_is_fitted_as_its_routings_overhead() -> None:
    # The same turns, alone on their engine, under two modes: turnkv's each 40 ms slower than
    # affinity's. The prefill curve is affinity's; the 40 ms is turnkv's overhead.
    result = _result()
    affinity = result["runs"][0]  # type: ignore[index]
    turnkv = {**affinity, "mode": "turnkv",
              "records": [{**r, "ttft_ms": r["ttft_ms"] + 40} for r in affinity["records"]]}
    result["runs"] = [affinity, turnkv]
    costs = calibrate(result)
    assert dict(costs.routing_overhead_ms) == pytest.approx({"affinity": 0, "turnkv": 40})
    assert (costs.prefill_fixed_ms, costs.prefill_ms_per_token,
            costs.prefill_ms_per_token_per_kctx) == pytest.approx((100, 0.5, 0.1), rel=1e-6)


def test_a_run_on_engines_of_more_cores_does_not_fit_the_simulated_engines_costs() -> None:
    # The bench's `single-2core`: one engine on both cores, its prompts computed in half the
    # time. The simulator's engines are the replayed modes' (one core each): the curve is
    # theirs.
    result = _result()
    affinity = result["runs"][0]  # type: ignore[index]
    affinity["config"] = {**affinity["config"], "cores_per_engine": 1}
    wide = {**affinity, "mode": "single-2core",
            "config": {**affinity["config"], "cores_per_engine": 2,
                       "engines": [{"role": "single"}]},
            "records": [{**r, "ttft_ms": r["ttft_ms"] / 2} for r in affinity["records"]]}
    result["runs"] = [affinity, wide]
    costs = calibrate(result)
    assert (costs.prefill_fixed_ms, costs.prefill_ms_per_token,
            costs.prefill_ms_per_token_per_kctx) == pytest.approx((100, 0.5, 0.1), rel=1e-6)


def test_turns_alone_on_the_engine_their_record_names_fit_the_prefill() -> None:
    # As above, with no counters: each record names the engine that served it
    # (`decode_node`; `prefill_node` where another engine ran its prefill), as turnkv's do.
    run = _result()["runs"][0]  # type: ignore[index]
    run["mode"] = "turnkv"
    twins = [{**r, "session_id": "t", "started_at": r["started_at"] + 0.01,
              "prefill_node": "engine-1", "decode_node": "engine-0"}
             for r in run["records"][1:]]
    run["records"] = [{**r, "decode_node": "engine-0"} for r in run["records"]] + twins
    fixed, per_token, per_kctx = fit_prefill([run])
    assert (fixed, per_token, per_kctx) == pytest.approx((100, 0.5, 0.1), rel=1e-6)


def _arrivals(mode: str, steps: float, host_tier_blocks: int | None) -> dict[str, object]:
    """Ten prompts on one engine, each computed alone: the odd ones reach it while another
    session's turn decodes there (one sequence: a 50 ms step), and take `steps` decode steps
    beyond the curve `_JOIN_COSTS` holds; the even ones reach it idle and take the curve."""
    costs = _JOIN_COSTS
    records = []
    for i in range(10):
        start, prompt, computed = 10.0 * i, 1000 + 100 * i, 300
        ms = costs.prefill_ms(computed, prompt) + (steps * 50 if i % 2 else 0.0)
        records.append({**_record("s", i, start, prompt, computed, ms), "session_id": f"s{i}"})
        if i % 2:
            # Its first token 4.9 s before the arrival, its decode on past it.
            beside = _record(f"d{i}", 0, start - 5, 500, 500, costs.prefill_ms(500, 500))
            records.append({**beside, "ended_at": start + 3})
    return {"mode": mode, "status": {"state": "ok"}, "records": records,
            "config": {"host_tier_blocks": host_tier_blocks, "block_size": 16}}


_JOIN_COSTS = ServiceCosts("hand", 100.0, 0.5, 0.1, 40.0, 10.0, 50.0, 50.0, 8192, 16, 1)


def test_a_prompt_reaching_a_decoding_engine_is_fitted_its_wait_beyond_the_step() -> None:
    # Without a tier the prompts that met a decoding turn took 2.5 steps more than the idle
    # ones, with one 1.5: less the half step the rest of the step in progress averages, 2
    # and 1 more steps.
    runs = [_arrivals("affinity", 2.5, None), _arrivals("affinity-offload", 1.5, 4)]
    assert fit_join_wait(runs, _JOIN_COSTS) == pytest.approx((2.0, 1.0))
    # Prompts that waited less than half a step more wait nothing more; a P/D mode's prompts
    # reach a prefill engine, which decodes nothing: none of them are read.
    assert fit_join_wait([_arrivals("affinity", 0.2, None)], _JOIN_COSTS) == (0.0, 0.0)
    assert fit_join_wait([_arrivals("standard", 2.5, None)], _JOIN_COSTS) == (0.0, 0.0)


def _stored(mode: str, first_ms: float, host_tier_blocks: int | None) -> dict[str, object]:
    """Five turns of 100 tokens, 40 computed: 3 blocks of 16 new to the engine (96 // 16 less
    60 // 16). Their first 3 gaps between output tokens take `first_ms`, the 5 after 50."""
    records = [{**_record(f"s{i}", 1, 10.0 * i, 100, 40, 200.0),
                "itl_ms": [first_ms] * 3 + [50.0] * 5} for i in range(5)]
    return {"mode": mode, "status": {"state": "ok"}, "records": records,
            "config": {"host_tier_blocks": host_tier_blocks, "block_size": 16}}


def test_a_tiers_store_is_fitted_per_block_beyond_the_first_steps_without_one() -> None:
    # With a tier each turn's first 3 steps took 14 ms more than its later ones, without one
    # 2 ms more: the store is the 12 ms between, per block (one a step).
    runs = [_stored("affinity", 52.0, None), _stored("affinity-offload", 64.0, 4)]
    assert fit_store_cost(runs, 16) == pytest.approx(12.0)
    # No runs without a tier to set it against: none fitted; a P/D mode is not read.
    assert fit_store_cost(runs[1:], 16) == 0.0
    assert fit_store_cost([_stored("standard", 52.0, None), runs[1]], 16) == 0.0
