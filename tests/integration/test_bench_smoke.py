"""`turnkv bench` end to end: the smoke workload (2 sessions x 3 turns) on the tiny model in
`standard` and `bidirectional` mode, through the command line with `--repeat 1`, checked from
its JSON. (The order of repeats, their medians and ranges and the ratios' spread are the
runner's and the aggregation's logic, tested in tests/unit/test_bench_aggregate.py: a second
repeat here would start each mode's engines again and check the same code.)

Beyond "it ran": each mode's numbers must say what the mode does. In `standard` the prefill
engine reuses only its own prefix cache, which can hold a session's earlier prompts but never
the replies (those were generated on the decode engine), and it receives no KV. In
`bidirectional` the prefill engine reads the session's history back from the decode engine,
replies included, so some turn reuses more than the whole previous prompt.

The figures are checked for consistency, never for speed: every run recorded, each mode's
figures the median of its runs with their range, ratios with the per-repeat range, ITL and
its stall share present, and the engines' prompt tokens adding up to the pair's total.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.clusters import TINY_CACHE_BYTES
from turnkv_server.bench.aggregate import finalize
from turnkv_server.bench.plots import PLOTS
from turnkv_server.bench.results import BenchResult, ModeRun, ModeSummary, TurnRecord

MODES = ["standard", "bidirectional"]
SESSIONS, TURNS = 2, 3
REPEAT = 1


def by_turn(run: ModeRun) -> dict[tuple[str, int], TurnRecord]:
    return {(r.session_id, r.turn): r for r in run.records}


def test_bench_smoke(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    command = [sys.executable, "-m", "turnkv_server.cli", "bench", "--workload", "smoke",
               "--model", str(tiny_model), "--dtype", "float32", "--modes", ",".join(MODES),
               # Read back however few tokens are missing: the smoke prompts are short.
               "--kv-recompute-threshold", "0", "--turn-timeout", "120",
               "--stall-timeout", "60", "--repeat", str(REPEAT), "--out", str(out),
               # A small cache: vLLM's CPU default (1 GiB) takes each engine seconds to
               # register with NIXL, at every cluster start.
               "--kv-cache-bytes", str(TINY_CACHE_BYTES)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    print(done.stdout[-4000:], done.stderr[-4000:])
    assert done.returncode == 0

    result = BenchResult.model_validate_json((out / "results.json").read_text())
    for plot in PLOTS:
        assert (out / plot).stat().st_size > 0
    # Interleaved: every mode once, then every mode again.
    assert [(r.mode, r.repeat) for r in result.runs] == [
        (mode, repeat) for repeat in range(REPEAT) for mode in MODES]
    assert result.repeats == REPEAT and len(result.summaries) == REPEAT * len(MODES)
    assert result.baseline == "standard" and result.ratios["standard"]["ttft_p50"] == 1.0
    assert result.workload.sessions == SESSIONS and result.workload.turns == SESSIONS * TURNS
    # `turnkv bench-report` rebuilds the same figures from the recorded runs alone.
    assert finalize(result, result.baseline) == result
    check_aggregates(result)
    summary = (out / "summary.md").read_text()
    assert "| standard | bidirectional |" in summary, summary

    for run in result.runs:
        assert run.status.state == "ok", run.status
        turns = by_turn(run)
        assert len(run.records) == len(turns) == SESSIONS * TURNS
        assert {t for _, t in turns} == set(range(TURNS))
        for r in run.records:
            assert r.error is None, r
            assert r.ttft_ms is not None and r.e2e_ms is not None and r.ttft_ms <= r.e2e_ms
            assert r.prompt_tokens and r.completion_tokens
            assert r.prefill_computed is not None and r.prefill_reused is not None
        assert set(run.cpu_s) == {"router", "prefill-0", "decode-0"}
        assert all(cpu > 0 for cpu in run.cpu_s.values()), run.cpu_s
        assert run.kv_cache_tokens and run.kv_cache_tokens > 0

    for repeat in range(REPEAT):
        check_modes(*(run for run in result.runs if run.repeat == repeat))
    # Both modes move KV over NIXL, as the engines count it.
    for summary in result.summaries:
        assert summary.kv_moved_bytes and summary.kv_moved_bytes > 0, summary


def check_aggregates(result: BenchResult) -> None:
    """Each mode's figures: the median of its runs' figures, between their min and max."""
    for agg in result.aggregates:
        runs = [s for s in result.summaries if s.mode == agg.mode]
        assert (agg.runs, agg.runs_ok, agg.status.state) == (REPEAT, REPEAT, "ok")
        for name, get in (("ttft_p50", lambda s: s.ttft_ms.p50),
                          ("ttft_later_p50", lambda s: s.ttft_ms_later.p50),
                          ("itl_p50", lambda s: s.itl_ms.p50), ("itl_p99", lambda s: s.itl_ms.p99),
                          ("output_tokens_per_s", lambda s: s.output_tokens_per_s)):
            per_run = [get(s) for s in runs]
            figure = agg.figures[name]
            assert None not in per_run and figure.n == REPEAT, (name, figure)
            assert figure.min == min(per_run) and figure.max == max(per_run), (name, figure)
            assert figure.median == pytest.approx(statistics.median(per_run)), (name, figure)
        check_itl(runs)
        check_engine_tokens(runs)
        assert agg.all_engines_tokens is not None and agg.all_engines_tokens.computed
    for mode in MODES:
        for metric in ("ttft_p50", "ttft_later_p50", "itl_p99"):
            per_repeat = result.ratio_spread[mode][metric]
            assert per_repeat.n == REPEAT and per_repeat.min is not None
            assert per_repeat.min <= (per_repeat.median or 0) <= (per_repeat.max or 0)
            assert result.ratios[mode][metric] is not None


def check_itl(runs: list[ModeSummary]) -> None:
    for s in runs:
        assert s.itl_ms.n > 0 and s.decode_step_ms == s.itl_ms.p50
        assert s.itl_stall_share is not None and 0.0 <= s.itl_stall_share <= 1.0


def check_engine_tokens(runs: list[ModeSummary]) -> None:
    """Both engines report their prompt tokens; the pair's total is their sum."""
    for s in runs:
        assert set(s.engine_tokens) == {"prefill-0", "decode-0"}, s.engine_tokens
        pair = s.all_engines_tokens
        assert pair is not None
        for source in ("cached", "received", "computed", "total"):
            assert getattr(pair, source) == sum(
                getattr(t, source) for t in s.engine_tokens.values()), source
        assert s.prefill_engine_tokens is not None
        assert s.prefill_engine_tokens.computed == s.engine_tokens["prefill-0"].computed


def check_modes(standard_run: ModeRun, bidirectional_run: ModeRun) -> None:
    """What each mode does, in one repeat."""
    standard, bidirectional = by_turn(standard_run), by_turn(bidirectional_run)
    std_counters, bidi_counters = standard_run.engine_counters, bidirectional_run.engine_counters
    for (session, turn), r in standard.items():
        assert r.prefill_received == 0 and r.prefill_reused == r.prefill_cached
        if turn > 0:
            previous = standard[(session, turn - 1)]
            assert r.prefill_reused is not None and previous.prompt_tokens is not None
            assert r.prefill_reused <= previous.prompt_tokens, (r, previous)
    # The standard prefill engine never receives KV; its decode engine always does.
    assert std_counters["prefill-0"]["prompt_tokens_external_kv_transfer"] == 0
    assert std_counters["decode-0"]["prompt_tokens_external_kv_transfer"] > 0

    beyond_prompt = [
        r for (session, turn), r in bidirectional.items()
        if turn > 0 and (r.prefill_reused or 0)
        > (bidirectional[(session, turn - 1)].prompt_tokens or 0)
    ]
    assert beyond_prompt, "no bidirectional turn reused its previous reply's KV"
    assert bidi_counters["prefill-0"]["prompt_tokens_external_kv_transfer"] > 0
    assert bidi_counters["prefill-0"]["nixl_bytes_transferred"] > 0
