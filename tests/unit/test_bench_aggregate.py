"""Repeats, ITL and per-engine prompt tokens on synthetic runs: medians of the runs' medians,
their spread, ratios with the spread of the per-repeat ratios, the interleaved run order, the
ITL stall share, and the report and plots built from them."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from turnkv_server.bench.aggregate import aggregate_mode, finalize, paired_ratio, spread
from turnkv_server.bench.cli import BenchOptions, _check
from turnkv_server.bench.plan import BenchSettings, PlanError, build_workload
from turnkv_server.bench.plots import PLOTS, frontier, plot_ttft_vs_itl, write_plots
from turnkv_server.bench.report import COLUMNS, cell, rows, summary_markdown
from turnkv_server.bench.results import (
    BenchResult,
    MachineInfo,
    ModeRun,
    ModeStatus,
    Spread,
    TurnRecord,
    WorkloadSummary,
)
from turnkv_server.bench.runner import RESULTS_FILE, Runner, run_order
from turnkv_server.bench.summary import STALL_FACTOR, engine_tokens, itl_stalls, summarize

OK = ModeStatus(state="ok")
STALLED = ModeStatus(state="stalled", detail="no progress for 60 s")


def mode_run(mode: str, repeat: int, ttfts: list[float], *, itl: list[float] | None = None,
             status: ModeStatus = OK, wall_s: float = 10.0) -> ModeRun:
    """A run whose turn t of session s0 has TTFT ttfts[t] and 10 output tokens."""
    records = [TurnRecord(mode=mode, session_id="s0", turn=t, ttft_ms=v, completion_tokens=10,
                          itl_ms=itl or [], started_at=1000.0 + t)
               for t, v in enumerate(ttfts)]
    return ModeRun(mode=mode, repeat=repeat, records=records, status=status, wall_s=wall_s)


def bench(runs: list[ModeRun], baseline: str | None = "standard") -> BenchResult:
    return finalize(BenchResult(
        machine=MachineInfo.detect(), model="m",
        workload=WorkloadSummary(name="agent", kind="agent", seed=0, sessions=1, turns=3),
        command=["turnkv", "bench", "--repeat", "3"], runs=runs), baseline)


# --- spread and the run order --------------------------------------------------------------


def test_spread_is_median_min_max_of_what_was_reported() -> None:
    assert spread([300.0, 100.0, None, 200.0]) == Spread(n=3, median=200.0, min=100.0,
                                                          max=300.0)
    # numpy's median: the mean of the middle two.
    assert spread([1.0, 4.0]).median == 2.5
    assert spread([None, None]) == Spread() == spread([])


def test_runs_interleave_modes() -> None:
    assert run_order(["a", "b", "c"], 2) == [(0, "a"), (0, "b"), (0, "c"),
                                             (1, "a"), (1, "b"), (1, "c")]
    assert run_order(["a"], 1) == [(0, "a")]
    with pytest.raises(ValueError):
        run_order(["a"], 0)


def test_runner_runs_every_mode_each_repeat_in_turn(tmp_path: Path) -> None:
    runner = Runner(build_workload("smoke"), BenchSettings(), tmp_path,
                    console=Console(quiet=True))
    played: list[tuple[str, int | None]] = []

    def fake(mode: str, repeat: int | None = None) -> tuple[ModeRun, str | None]:
        played.append((mode, repeat))
        return mode_run(mode, repeat or 0, [100.0, 50.0]), "served"

    runner.run_mode = fake  # type: ignore[method-assign]
    result = runner.run(["standard", "turnkv"], "standard", ["turnkv", "bench"], repeat=2)
    assert played == [("standard", 0), ("turnkv", 0), ("standard", 1), ("turnkv", 1)]
    assert [(r.mode, r.repeat) for r in result.runs] == [
        ("standard", 0), ("turnkv", 0), ("standard", 1), ("turnkv", 1)]
    assert result.repeats == 2 and [a.mode for a in result.aggregates] == ["standard", "turnkv"]
    assert (tmp_path / RESULTS_FILE).is_file()
    # A single run keeps the single-run layout: runs/<mode>/, no repeat in the label.
    played.clear()
    runner.run(["turnkv"], None, ["turnkv"])
    assert played == [("turnkv", None)]


# --- medians of medians, ratios with their spread ------------------------------------------


def repeated() -> list[ModeRun]:
    # Per-run TTFT p50 (over turns 0-2): standard 200, 400, 300; turnkv 100, 100, 300.
    standard = [[100.0, 200.0, 900.0], [400.0, 400.0, 400.0], [300.0, 100.0, 500.0]]
    turnkv = [[100.0, 50.0, 150.0], [100.0, 100.0, 100.0], [300.0, 300.0, 300.0]]
    runs = []
    for r in range(3):
        runs += [mode_run("standard", r, standard[r]), mode_run("turnkv", r, turnkv[r])]
    return runs


def test_figures_are_medians_of_the_runs_with_their_range() -> None:
    result = bench(repeated())
    standard, turnkv = result.aggregates
    assert (standard.runs, standard.runs_ok, standard.status.state) == (3, 3, "ok")
    assert standard.figures["ttft_p50"] == Spread(n=3, median=300.0, min=200.0, max=400.0)
    assert turnkv.figures["ttft_p50"] == Spread(n=3, median=100.0, min=100.0, max=300.0)
    # After the first turn: per-run medians 550, 400, 300.
    assert standard.figures["ttft_later_p50"].median == 400.0
    # Turn 0 across the runs: 100, 400, 300.
    assert standard.ttft_p50_by_turn[0] == Spread(n=3, median=300.0, min=100.0, max=400.0)
    assert standard.figures["output_tokens_per_s"].median == pytest.approx(3.0)
    assert result.repeats == 3 and len(result.summaries) == 6


def test_ratios_are_ratios_of_medians_with_the_per_repeat_range() -> None:
    result = bench(repeated())
    assert result.ratios["turnkv"]["ttft_p50"] == pytest.approx(100.0 / 300.0)
    # Per repeat: 100/200, 100/400, 300/300.
    per_repeat = result.ratio_spread["turnkv"]["ttft_p50"]
    assert (per_repeat.n, per_repeat.min, per_repeat.max) == (3, 0.25, 1.0)
    assert per_repeat.median == pytest.approx(0.5)
    assert result.ratios["standard"]["ttft_p50"] == 1.0
    assert result.ratio_spread["standard"]["ttft_p50"] == Spread(n=3, median=1.0, min=1.0,
                                                                 max=1.0)
    matrix = result.later_ttft_p50_matrix_spread["turnkv"]["standard"]
    # Later turns, per repeat: 100/550, 100/400, 300/300.
    assert matrix.min == pytest.approx(100 / 550) and matrix.max == 1.0


def test_a_stalled_repeat_counts_in_no_median_and_no_pair() -> None:
    runs = repeated()
    runs[3] = mode_run("turnkv", 1, [1.0, 1.0, 1.0], status=STALLED)
    result = bench(runs)
    turnkv = result.aggregates[1]
    assert (turnkv.runs, turnkv.runs_ok, turnkv.status.state) == (3, 2, "ok")
    assert turnkv.status.detail == "run 2 stalled: no progress for 60 s"
    assert rows(result)[1][COLUMNS.index("status")] == (
        "ok in 2 of 3 runs (run 2 stalled: no progress for 60 s)")
    assert turnkv.figures["ttft_p50"] == Spread(n=2, median=200.0, min=100.0, max=300.0)
    per_repeat = result.ratio_spread["turnkv"]["ttft_p50"]
    assert (per_repeat.n, per_repeat.min, per_repeat.max) == (2, 0.5, 1.0)


def test_a_mode_that_never_finished_shows_partial_numbers_but_no_ratio() -> None:
    stalled = [mode_run("push", r, [50.0], status=STALLED) for r in range(2)]
    base = [mode_run("standard", r, [100.0]) for r in range(2)]
    summaries = [summarize(r) for r in stalled + base]
    agg = aggregate_mode(summaries[:2])
    assert agg.status.state == "stalled" and agg.figures["ttft_p50"].median == 50.0
    assert agg.status.detail == ("run 1 stalled: no progress for 60 s; "
                                 "run 2 stalled: no progress for 60 s")
    assert paired_ratio(summaries[:2], summaries[2:], lambda s: s.ttft_ms.p50) == (None,
                                                                                   Spread())


# --- ITL and the stall share ---------------------------------------------------------------


def test_itl_stall_share_counts_gaps_beyond_twice_the_median() -> None:
    gaps = [100.0] * 7 + [STALL_FACTOR * 100.0, 250.0, 3000.0]
    step, share = itl_stalls(gaps)
    # The gap of exactly twice the step is not a stall; 250 and 3000 are.
    assert step == 100.0 and share == pytest.approx(0.2)
    assert itl_stalls([]) == (None, None)


def test_summary_reports_itl_percentiles_and_stall_share() -> None:
    run = mode_run("turnkv", 0, [100.0, 100.0], itl=[100.0, 100.0, 100.0, 500.0])
    s = summarize(run)
    assert (s.itl_ms.n, s.itl_ms.p50, s.decode_step_ms) == (8, 100.0, 100.0)
    assert s.itl_stall_share == pytest.approx(0.25)
    assert s.itl_ms.p99 is not None and s.itl_ms.p99 > 400.0


# --- every engine's prompt tokens ------------------------------------------------------------


def test_every_engine_counts_and_the_pair_sums_them() -> None:
    counters = {
        "prefill-0": {"prompt_tokens": 100.0, "prompt_tokens_local_cache_hit": 60.0,
                      "prompt_tokens_external_kv_transfer": 30.0,
                      "prompt_tokens_local_compute": 10.0},
        "decode-0": {"prompt_tokens": 120.0, "prompt_tokens_local_cache_hit": 70.0,
                     "prompt_tokens_external_kv_transfer": 0.0,
                     "prompt_tokens_local_compute": 50.0},
        "router-ish": {"preemptions": 0.0},
    }
    per_engine = engine_tokens(counters)
    assert set(per_engine) == {"prefill-0", "decode-0"}
    assert (per_engine["decode-0"].computed, per_engine["decode-0"].reused) == (50, 70)
    run = mode_run("turnkv", 0, [1.0])
    run.engine_counters = counters
    s = summarize(run)
    assert s.all_engines_tokens is not None
    assert (s.all_engines_tokens.total, s.all_engines_tokens.cached,
            s.all_engines_tokens.received, s.all_engines_tokens.computed) == (220, 130, 30, 60)
    # The prefill engine's own account stays as before.
    assert s.prefill_engine_tokens is not None and s.prefill_engine_tokens.computed == 10
    result = bench([run], baseline=None)
    text = summary_markdown(result)
    assert "| turnkv | decode-0 | 70 | 0 | 50 | 120 |" in text
    assert "| turnkv | all engines | 130 | 30 | 60 | 220 |" in text
    assert rows(result)[0][COLUMNS.index("computed, all engines")] == "60"


# --- the report of a repeated run ----------------------------------------------------------


def test_cells_show_median_then_range() -> None:
    assert cell(Spread(n=3, median=1200.0, min=1000.0, max=1500.0), "{:,.0f}".format) == (
        "1,200 (1,000-1,500)")
    assert cell(Spread(n=1, median=1200.0, min=1200.0, max=1200.0), "{:,.0f}".format) == "1,200"
    assert cell(Spread(), "{:,.0f}".format) == "-"


def test_report_of_repeats_shows_ranges_every_run_and_plots(tmp_path: Path) -> None:
    result = bench(repeated())
    standard, turnkv = rows(result)
    assert standard[COLUMNS.index("status")] == "ok, 3 runs"
    assert standard[COLUMNS.index("TTFT p50 ms")] == "300 (200-400)"
    assert turnkv[COLUMNS.index("TTFT p50 vs base")] == "0.33x (0.25-1.00)"
    text = summary_markdown(result)
    assert "each mode 3 times, interleaved" in text
    assert "Every run, in the order they ran" in text and text.count("| 3 | turnkv |") == 1
    again = BenchResult.model_validate_json(result.model_dump_json())
    assert again == result and finalize(again, "standard") == again.model_copy(
        update={"created": again.created})
    paths = write_plots(result, tmp_path)
    assert [p.name for p in paths] == list(PLOTS)
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_the_frontier_joins_turnkv_at_every_itl_target(tmp_path: Path) -> None:
    gaps = {"affinity": 900.0, "turnkv": 1000.0, "turnkv-itl500": 300.0,
            "turnkv-itl1500": 600.0}
    # TTFT after the first turn: turns 1-2; a lower target leaves more to the prefill engine.
    later = {"affinity": 200.0, "turnkv": 100.0, "turnkv-itl500": 400.0,
             "turnkv-itl1500": 250.0}
    runs = [mode_run(mode, 0, [5000.0, later[mode], later[mode]], itl=[100.0] * 98 + [gap] * 2)
            for mode, gap in gaps.items()]
    result = bench(runs, baseline="affinity")
    # From the tightest target to none, whatever their ITL order.
    assert frontier(result) == [(300.0, 400.0), (600.0, 250.0), (1000.0, 100.0)]
    runs[1] = mode_run("turnkv", 0, [5000.0, 100.0, 100.0], itl=[100.0] * 98 + [450.0] * 2)
    assert frontier(bench(runs, baseline="affinity")) == [
        (300.0, 400.0), (600.0, 250.0), (450.0, 100.0)]
    # A stalled target is no point of the frontier.
    runs[3] = mode_run("turnkv-itl1500", 0, [5000.0], status=STALLED)
    assert frontier(bench(runs, baseline="affinity")) == [(300.0, 400.0), (450.0, 100.0)]
    assert plot_ttft_vs_itl(result, tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def test_repeat_must_be_at_least_one() -> None:
    with pytest.raises(PlanError, match="--repeat"):
        _check(BenchOptions(repeat=0))
    _check(BenchOptions(repeat=3))
