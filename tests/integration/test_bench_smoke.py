"""`turnkv bench` end to end: the smoke workload (2 sessions x 3 turns) on the tiny model in
`standard` and `bidirectional` mode, through the command line, checked from its JSON.

Beyond "it ran": each mode's numbers must say what the mode does. In `standard` the prefill
engine reuses only its own prefix cache, which can hold a session's earlier prompts but never
the replies (those were generated on the decode engine), and it receives no KV. In
`bidirectional` the prefill engine reads the session's history back from the decode engine,
replies included, so some turn reuses more than the whole previous prompt.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from turnkv_server.bench.results import BenchResult, ModeRun, TurnRecord

MODES = ["standard", "bidirectional"]
SESSIONS, TURNS = 2, 3


def by_turn(run: ModeRun) -> dict[tuple[str, int], TurnRecord]:
    return {(r.session_id, r.turn): r for r in run.records}


def test_bench_smoke(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    command = [sys.executable, "-m", "turnkv_server.cli", "bench", "--workload", "smoke",
               "--model", str(tiny_model), "--dtype", "float32", "--modes", ",".join(MODES),
               # Read back however few tokens are missing: the smoke prompts are short.
               "--kv-recompute-threshold", "0", "--turn-timeout", "120",
               "--stall-timeout", "60", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    print(done.stdout[-4000:], done.stderr[-4000:])
    assert done.returncode == 0

    result = BenchResult.model_validate_json((out / "results.json").read_text())
    for plot in ("ttft_by_turn.png", "ttft_cdf.png", "prompt_tokens_by_source.png"):
        assert (out / plot).stat().st_size > 0
    assert [r.mode for r in result.runs] == MODES
    assert result.baseline == "standard" and result.ratios["standard"]["ttft_p50"] == 1.0
    assert result.workload.sessions == SESSIONS and result.workload.turns == SESSIONS * TURNS

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

    standard, bidirectional = (by_turn(run) for run in result.runs)
    std_counters, bidi_counters = (run.engine_counters for run in result.runs)
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
    # Both modes move KV over NIXL, as the engines count it.
    for summary in result.summaries:
        assert summary.kv_moved_bytes and summary.kv_moved_bytes > 0, summary
