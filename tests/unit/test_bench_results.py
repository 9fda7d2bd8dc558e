"""Aggregation of benchmark records, and the report rendered from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from turnkv_server.bench.aggregate import finalize, ratios
from turnkv_server.bench.plots import PLOTS, source_parts, write_plots
from turnkv_server.bench.report import (
    COLUMNS,
    markdown_table,
    rich_table,
    rows,
    summary_markdown,
)
from turnkv_server.bench.results import (
    BenchResult,
    MachineInfo,
    ModeRun,
    ModeStatus,
    TurnRecord,
    WorkloadSummary,
    percentiles,
    total,
)
from turnkv_server.bench.summary import summarize

OK = ModeStatus(state="ok")
STALLED = ModeStatus(state="stalled", detail="no progress for 60 s")


def record(mode: str, turn: int, ttft: float, **fields: object) -> TurnRecord:
    return TurnRecord.model_validate({
        "mode": mode, "session_id": "s0", "turn": turn, "ttft_ms": ttft,
        "started_at": 1000.0 + turn, **fields,
    })


def run(mode: str, records: list[TurnRecord], status: ModeStatus = OK) -> ModeRun:
    return ModeRun(mode=mode, records=records, status=status, wall_s=10.0,
                   cpu_s={"router": 1.5})


def test_percentiles_linear_interpolation() -> None:
    p = percentiles([1.0, 2.0, 3.0, 4.0])
    assert (p.n, p.p50, p.p90) == (4, 2.5, pytest.approx(3.7))
    assert p.p99 == pytest.approx(3.97)
    empty = percentiles([])
    assert (empty.n, empty.p50, empty.p90, empty.p99) == (0, None, None, None)


def test_total_never_guesses() -> None:
    assert total([None, None]) is None
    assert total([]) is None
    assert total([None, 0]) == 0
    assert total([3, None, 4]) == 7


def test_summary_of_one_mode() -> None:
    records = [
        record("standard", 0, 100.0, prompt_tokens=1000, prefill_computed=1000,
               completion_tokens=20, itl_ms=[10.0, 12.0], e2e_ms=400.0),
        record("standard", 1, 300.0, prompt_tokens=1500, prefill_computed=500,
               prefill_cached=1000, completion_tokens=30, itl_ms=[14.0], e2e_ms=600.0,
               fallback="session_moved"),
        record("standard", 1, 200.0, prompt_tokens=1500, completion_tokens=10),
        record("standard", 2, 9999.0, error="HTTP 500"),
    ]
    s = summarize(run("standard", records))
    assert (s.turns_ok, s.errors, s.fallbacks, s.prefix_breaks) == (3, 1, 1, 0)
    assert s.ttft_ms.p50 == 200.0  # the errored turn's 9999 is left out
    assert sorted(s.ttft_ms_by_turn) == [0, 1]
    assert s.ttft_ms_by_turn[1].p50 == 250.0
    assert s.itl_ms.n == 3 and s.itl_ms.p50 == 12.0
    assert s.e2e_ms.p50 == 500.0
    assert s.output_tokens_per_s == pytest.approx(60 / 10.0)
    assert s.turns_per_s == pytest.approx(0.3)
    assert s.prompt_tokens.total == 4000
    assert s.prompt_tokens.computed == 1500
    assert s.prompt_tokens.cached == 1000
    assert s.prompt_tokens.received is None
    # Only the two turns that report what they computed: 1500 of 2500 prompt tokens.
    assert s.recompute_fraction == pytest.approx(0.6)
    assert s.kv_to_decode_bytes is None and s.kv_to_prefill_bytes is None
    assert s.cpu_s == {"router": 1.5}


def test_kv_moved_sums_the_engines_nixl_counters() -> None:
    moved = run("bidirectional", [record("bidirectional", 0, 50.0)])
    moved.engine_counters = {"prefill-0": {"nixl_bytes_transferred": 3000.0},
                             "decode-0": {"nixl_bytes_transferred": 1500.0, "preemptions": 0.0}}
    assert summarize(moved).kv_moved_bytes == 4500
    # No engine exports the counter (a single engine): unknown, not 0.
    single = run("single", [record("single", 0, 50.0)])
    single.engine_counters = {"single": {"prompt_tokens": 10.0}}
    assert summarize(single).kv_moved_bytes is None


def test_stalled_mode_keeps_partial_latencies_but_no_throughput() -> None:
    s = summarize(run("bidirectional", [record("bidirectional", 0, 50.0)], STALLED))
    assert s.ttft_ms.p50 == 50.0
    assert s.output_tokens_per_s is None and s.turns_per_s is None


def test_throughput_unknown_without_token_counts() -> None:
    s = summarize(run("standard", [record("standard", 0, 50.0)]))
    assert s.output_tokens_per_s is None and s.turns_per_s == pytest.approx(0.1)


def test_ratios_against_a_baseline() -> None:
    base = summarize(run("standard", [record("standard", 0, 400.0)]))
    fast = summarize(run("push", [record("push", 0, 100.0)]))
    stalled = summarize(run("bidirectional", [record("bidirectional", 0, 50.0)], STALLED))
    out, spread = ratios([base, fast, stalled], "standard")
    assert out["standard"]["ttft_p50"] == 1.0
    assert out["push"]["ttft_p50"] == pytest.approx(0.25)
    assert out["push"]["recompute_fraction"] is None  # neither reported it
    assert all(v is None for v in out["bidirectional"].values())
    # One run each: the per-repeat ratio is the one ratio.
    assert (spread["push"]["ttft_p50"].n, spread["push"]["ttft_p50"].min) == (1, 0.25)
    with pytest.raises(ValueError):
        ratios([base], "turnkv")


def result() -> BenchResult:
    runs = [
        run("standard", [record("standard", t, 100.0 * (t + 1), prompt_tokens=500,
                                prefill_computed=500, kv_to_decode_bytes=3 * 2**20)
                         for t in range(3)]),
        run("bidirectional", [record("bidirectional", 0, 80.0, prompt_tokens=500,
                                     prefill_computed=100, prefill_reused=400)], STALLED),
        ModeRun(mode="push", status=ModeStatus(state="failed", detail="engine exited"),
                records=[]),
    ]
    bench = BenchResult(
        machine=MachineInfo.detect(), model="SmolLM2-135M-Instruct",
        workload=WorkloadSummary(name="agent", kind="agent", seed=1, sessions=1, turns=3),
        command=["turnkv", "bench"], runs=runs,
    )
    return finalize(bench, "standard")


def test_later_turns_and_mode_matrix() -> None:
    fast = run("push", [record("push", t, 1000.0 if t == 0 else 100.0) for t in range(3)])
    slow = run("standard", [record("standard", t, 500.0 if t == 0 else 400.0) for t in range(3)])
    stalled = run("bidirectional", [record("bidirectional", 1, 10.0)], STALLED)
    bench = finalize(BenchResult(
        machine=MachineInfo.detect(), model="m",
        workload=WorkloadSummary(name="agent", kind="agent", seed=0, sessions=1, turns=3),
        command=["turnkv"], runs=[fast, slow, stalled]), "standard")
    push = bench.summaries[0]
    # The first turn (1000 ms) is left out: only turns that can reuse KV.
    assert push.ttft_ms_later.n == 2 and push.ttft_ms_later.p50 == 100.0
    m = bench.later_ttft_p50_matrix
    assert m["push"]["standard"] == pytest.approx(0.25)
    assert m["standard"]["push"] == pytest.approx(4.0)
    assert m["push"]["bidirectional"] is None and m["bidirectional"]["bidirectional"] is None
    text = summary_markdown(bench)
    assert "| push | 1.00 | 0.25 | - |" in text and "| 2 | 100 | 400 | 10 |" in text


def test_result_json_round_trip() -> None:
    bench = result()
    assert bench.machine.cores > 0
    again = BenchResult.model_validate_json(bench.model_dump_json())
    assert again == bench
    assert again.summaries[0].ttft_ms_by_turn[2].p50 == 300.0


def test_table_rows_show_status_and_dashes() -> None:
    bench = result()
    standard, stalled, failed = rows(bench)
    column = {name: i for i, name in enumerate(COLUMNS)}
    shown = ("mode", "status", "TTFT p50 ms", "recompute", "KV moved", "TTFT p50 vs base")
    assert [standard[column[c]] for c in shown] == [
        "standard", "ok", "200", "100%", "9.0 MiB", "1.00x"]
    assert [stalled[column[c]] for c in shown] == [
        "bidirectional", "stalled: no progress for 60 s", "80", "20%", "-", "-"]
    assert stalled[column["out tok/s"]] == "-"
    assert failed[column["status"]] == "failed: engine exited"
    assert {failed[column[c]] for c in COLUMNS[column["status"] + 1:]} == {"-"}
    md = markdown_table(bench)
    assert md.count("\n") == 2 + 3 and "| stalled: no progress for 60 s |" in md
    assert rich_table(bench).row_count == 3


def test_prompt_sources_only_as_reported() -> None:
    standard, bidirectional, push = (s.prompt_tokens for s in result().summaries)
    assert source_parts(standard) == {"computed": 1500}
    assert source_parts(bidirectional) == {"computed": 100, "reused": 400}
    assert source_parts(push) == {}


def test_plots_are_written(tmp_path: Path) -> None:
    paths = write_plots(result(), tmp_path / "plots")
    assert [p.name for p in paths] == list(PLOTS)
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prefill_engine_sources_come_from_its_counters() -> None:
    moved = run("bidirectional", [record("bidirectional", 0, 50.0)])
    moved.engine_counters = {
        "prefill-0": {"prompt_tokens": 100.0, "prompt_tokens_local_cache_hit": 60.0,
                      "prompt_tokens_external_kv_transfer": 30.0,
                      "prompt_tokens_local_compute": 10.0},
        # The decode engine's own account is not the prefill engine's.
        "decode-0": {"prompt_tokens": 100.0, "prompt_tokens_local_compute": 99.0},
    }
    tokens = summarize(moved).prefill_engine_tokens
    assert tokens is not None
    assert (tokens.total, tokens.cached, tokens.received, tokens.computed) == (100, 60, 30, 10)
    assert summarize(run("push", [record("push", 0, 1.0)])).prefill_engine_tokens is None
