"""The simulator's workloads: its JSONL trace form, the Mooncake trace converter (on a sample
written by hand in that format), bench presets and bench runs replayed."""

from __future__ import annotations

from pathlib import Path

import pytest

from turnkv_server.sim.bench_workloads import preset_sessions, replay_records
from turnkv_server.sim.mooncake_trace import read_mooncake
from turnkv_server.sim.sessions import SimSession, SimTurn
from turnkv_server.sim.traces import read_trace, write_trace

SAMPLE = Path(__file__).parent / "data" / "mooncake_sample.jsonl"


def test_mooncake_requests_are_chained_into_sessions_by_their_blocks() -> None:
    sessions = {s.session_id: s for s in read_mooncake(SAMPLE)}
    assert sorted(sessions) == ["mooncake-000000", "mooncake-000001", "mooncake-000002"]
    first, second, third = (sessions[f"mooncake-00000{i}"] for i in range(3))
    # Requests 0, 2, 4: each prompt starts with the previous one's blocks.
    assert first.turns == (SimTurn(1200, 40, 0.0), SimTurn(1900 - 1240, 50, 4.0),
                           SimTurn(2600 - 1950, 60, 5.0))
    assert first.prefix is None
    # Request 1 shares blocks 1 and 2 (1,024 tokens) with request 0: a shared prefix.
    assert second.turns == (SimTurn(1100, 30, 0.0), SimTurn(1700 - 1130, 20, 6.0))
    assert second.prefix is not None and second.prefix_tokens == 1024
    assert second.start_s == 0.5
    assert third.turns == (SimTurn(300, 10, 0.0),) and third.start_s == 9.5


def test_a_trace_round_trips_through_its_jsonl_form(tmp_path: Path) -> None:
    sessions = [SimSession("a", (SimTurn(100, 5), SimTurn(20, 5, 1.5)), 2.0, "sys", 80),
                SimSession("a-sub", (SimTurn(50, 3),), 3.0, parent="a")]
    assert read_trace(write_trace(sessions, tmp_path / "t.jsonl")) == sessions


def test_a_trace_with_a_missing_turn_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"session": "a", "turn": 0, "tokens_in": 5, "tokens_out": 1}\n'
                    '{"session": "a", "turn": 2, "tokens_in": 5, "tokens_out": 1}\n')
    with pytest.raises(ValueError, match="without gaps"):
        read_trace(path)


def test_a_bench_run_is_replayed_turn_for_turn() -> None:
    records = [
        {"session_id": "s", "turn": 0, "prompt_tokens": 500, "completion_tokens": 20,
         "started_at": 100.0, "ended_at": 101.0, "error": None},
        {"session_id": "s", "turn": 1, "prompt_tokens": 700, "completion_tokens": 30,
         "started_at": 103.5, "ended_at": 104.0, "error": None},
        {"session_id": "t", "turn": 0, "prompt_tokens": 400, "completion_tokens": 10,
         "started_at": 102.0, "ended_at": 102.5, "error": None},
    ]
    s, t = replay_records(records)
    assert s.turns == (SimTurn(500, 20, 0.0), SimTurn(700 - 520, 30, 2.5))
    assert s.prompts == (500, 700)
    assert (t.start_s, t.turns) == (2.0, (SimTurn(400, 10, 0.0),))


def test_a_bench_preset_keeps_its_shape() -> None:
    sessions, concurrency = preset_sessions("conversation")
    assert concurrency == 1 and len(sessions) == 1
    (conversation,) = sessions
    assert len(conversation.turns) == 8
    assert all(t.tokens_out == 64 for t in conversation.turns)
    assert conversation.prefix_tokens > 0
