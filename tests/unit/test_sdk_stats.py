"""Turn and session stats: wire + client fields, usage-only stats, totals, tables."""

from __future__ import annotations

import gzip
import json

import pytest
from rich.console import Console

import turnkv
from turnkv import protocol as p
from turnkv.observe import Observer
from turnkv.sse import SSEReader
from turnkv.stats import estimate_prefill_saved, prefill_cost_ms


def wire(turn: int, total: int, computed: int, prefill_ms: float, **extra: object
         ) -> p.RouterTurnStats:
    return p.RouterTurnStats(session_id="s", turn=turn, mode="bidirectional",
                       prompt_tokens=p.PromptTokens(total=total, prefill_computed=computed,
                                                    prefill_reused=total - computed),
                       completion_tokens=8, times=p.TurnTimes(prefill_ms=prefill_ms),
                       **extra)  # type: ignore[arg-type]


def test_turn_stats_keep_the_wire_part_intact() -> None:
    original = wire(2, 300, 100, 50.0, fallback="session_moved", prefix_break_at=120)
    stats = turnkv.TurnStats.from_wire(original.model_dump(), client_ttft_ms=12.5, retries=1)
    assert stats.wire() == original
    assert stats.served_by_turnkv and stats.client_ttft_ms == 12.5 and stats.retries == 1
    assert stats.reused_tokens == 200 and stats.computed_tokens == 100
    dumped = json.loads(stats.model_dump_json())
    assert dumped["client_ttft_ms"] == 12.5 and dumped["prompt_tokens"]["total"] == 300


def test_usage_only_stats() -> None:
    usage = {"prompt_tokens": 50, "completion_tokens": 4,
             "prompt_tokens_details": {"cached_tokens": 32}}
    stats = turnkv.TurnStats.from_usage(usage, session_id="s", turn=3)
    assert (stats.mode, stats.served_by_turnkv, stats.turn) == ("plain", False, 3)
    assert stats.prompt_tokens.prefill_cached == 32 and stats.computed_tokens == 18
    bare = turnkv.TurnStats.from_usage({"prompt_tokens": 50}, session_id="s", turn=1)
    assert bare.reused_tokens is None and bare.computed_tokens is None


def test_session_totals_and_the_prefill_estimate() -> None:
    turns = [
        turnkv.TurnStats.from_wire(wire(1, 200, 200, 40.0)),
        turnkv.TurnStats.from_wire(wire(2, 300, 100, 20.0, prefix_break_at=150), retries=2),
        turnkv.TurnStats.from_wire(wire(3, 400, 100, 20.0, fallback="transfer_failed")),
    ]
    totals = turnkv.SessionStats.from_turns(turns, session_id="s")
    assert (totals.turns, totals.prompt_tokens_total, totals.completion_tokens) == (3, 900, 24)
    assert (totals.prompt_tokens_reused, totals.prompt_tokens_computed) == (500, 400)
    assert totals.hit_ratio == pytest.approx(500 / 900)
    assert (totals.fallbacks, totals.prefix_breaks, totals.retries) == (1, 1, 2)
    # The lowest per-token cost measured: turn 1's 40 ms for 200 tokens, times 500 reused.
    assert totals.prefill_ms_per_token == pytest.approx(0.2)
    assert totals.estimated_prefill_s_saved == pytest.approx(0.1)
    plain = turnkv.SessionStats.from_turns(
        [turnkv.TurnStats.from_usage({"prompt_tokens": 10}, session_id="s", turn=1)])
    assert plain.estimated_prefill_s_saved is None and plain.hit_ratio is None


def test_the_estimate_takes_the_engines_timing_and_the_cost_of_one_more_token() -> None:
    """An agent's turns compute few tokens each, each paying a fixed cost per request: the
    session's average rate made a 90 s run "save" 167.9 s. The estimate takes the cost of one
    more token, from the engine's own timing where it reported one."""
    first = wire(1, 1000, 1000, 900.0)  # router: 900 ms; the engine: 500 ms
    first.times.engine_prefill_ms = 500.0
    turns = [turnkv.TurnStats.from_wire(first)]
    # Short turns: 40 new tokens in 60 ms each (1.5 ms per token), reusing the history.
    for n in range(2, 12):
        turns.append(turnkv.TurnStats.from_wire(wire(n, 1000 + 40 * n, 40, 60.0)))
    totals = turnkv.SessionStats.from_turns(turns)
    # (500 - 60) ms for (1000 - 40) more tokens; 40 ms of each turn is its fixed cost.
    assert totals.prefill_ms_per_token == pytest.approx(440 / 960)
    reused = sum(t.prompt_tokens.prefill_reused or 0 for t in turns)
    assert totals.estimated_prefill_s_saved == pytest.approx(440 / 960 * reused / 1000)
    # The old average rate (router times): (900 + 10 * 60) ms over 1,400 tokens.
    assert totals.estimated_prefill_s_saved < 0.5 * 1500 / 1400 * reused / 1000
    # No turn is estimated above a prefill the engine measured that computed as many tokens.
    for turn in turns:
        estimate = totals.prefill_ms_per_token * (turn.reused_tokens or 0)
        assert turn.reused_tokens is None or turn.reused_tokens > 1000 or estimate <= 500.0


def test_the_estimate_on_measured_turns() -> None:
    """Five turns of the quick start's conversation on SmolLM2 (turnkv mode, 32-token blocks):
    the first computed by the prefill engine, the rest short deltas on the decode engine
    (engine_prefill_ms). About 90 ms of each is a fixed cost."""
    measured = [(245, 437.3), (39, 136.1), (24, 116.3), (37, 135.5), (25, 151.6)]
    rate, saved = estimate_prefill_saved(measured, 1344)
    assert rate == pytest.approx(1.409, abs=1e-3)
    assert saved == pytest.approx(1.409 * 1.344, abs=1e-2)
    # The lowest per-token cost measured, turn 1's, would say 2.4 s.
    assert rate < 437.3 / 245


@pytest.mark.parametrize(("measured", "reused", "expected"), [
    ([], 100, (None, None)),
    ([(0, 10.0), (10, 0.0)], 100, (None, None)),  # nothing computed, or nothing timed
    ([(100, 50.0)], 0, (0.5, 0.0)),                # one turn: its own rate
    ([(100, 50.0), (100, 70.0)], 1000, (0.5, 0.5)),  # no spread: the lowest rate
    ([(100, 50.0), (200, 40.0)], 1000, (0.2, 0.2)),  # a falling line: the lowest rate
    ([(100, 50.0), (10, 20.0), (400, 120.0)], 1000, (20900 / 83400, 20900 / 83400)),
])
def test_estimate_prefill_saved(measured: list[tuple[int, float]], reused: int,
                                expected: tuple[float | None, float | None]) -> None:
    rate, saved = estimate_prefill_saved(measured, reused)
    assert (rate, saved) == (pytest.approx(expected[0]) if expected[0] is not None else None,
                             pytest.approx(expected[1]) if expected[1] is not None else None)
    for tokens, ms in measured:
        if rate is not None and tokens > 0 and ms > 0:
            # Any r <= tokens reused is estimated at most at that turn's measured time.
            assert rate * tokens <= ms + 1e-9


def test_a_turn_without_engine_timing_uses_the_routers() -> None:
    timed = turnkv.TurnStats.from_wire(wire(1, 100, 100, 80.0))
    assert prefill_cost_ms(timed) == 80.0
    timed.times.engine_prefill_ms = 30.0
    assert prefill_cost_ms(timed) == 30.0
    untimed = turnkv.TurnStats.from_wire(wire(2, 100, 100, 0.0))
    assert prefill_cost_ms(untimed) is None


def test_tables_render() -> None:
    stats = turnkv.TurnStats.from_wire(wire(2, 300, 100, 50.0, prefill_node="prefill-0",
                                            decode_node="decode-0"), client_ttft_ms=33.0)
    plain = turnkv.TurnStats.from_usage({"prompt_tokens": 10}, session_id="s", turn=3)
    console = Console(record=True, width=200)
    console.print(turnkv.stats_table([stats, turnkv.Turn(index=3, stats=plain)]))
    console.print(turnkv.turn_stats_table(stats))
    console.print(turnkv.session_stats_table(
        turnkv.SessionStats.from_turns([stats, plain], session_id="s")))
    out = console.export_text()
    assert "prefill-0 -> decode-0" in out and "plain server" in out and "33.0" in out
    assert "prompt_tokens.prefill_computed" in out and "estimated_prefill_s_saved" in out


def test_sse_reader_handles_any_split() -> None:
    stream = b'data: {"a": 1}\r\n\r\n: comment\ndata: {"b":\ndata: 2}\n\ndata: [DONE]\n\n'
    for size in (1, 3, 7, len(stream)):
        reader = SSEReader()
        events: list[str] = []
        for i in range(0, len(stream), size):
            events += reader.feed(stream[i:i + size])
        events += reader.close()
        assert events == ['{"a": 1}', '{"b":\n2}', "[DONE]"]


class _Pending:
    """Stands in for a pending turn: collects what the observer hands over."""

    def __init__(self) -> None:
        import time

        self.started = time.perf_counter()
        self.early_headers: dict[str, str] = {}
        self.completed: object = None
        self.failed = False

    def complete(self, observed: object) -> None:
        self.completed = observed

    def fail(self) -> None:
        self.failed = True


def test_observer_reads_gzipped_json_and_cut_streams() -> None:
    body = {"choices": [{"message": {"content": "hi"}}], "usage": {"prompt_tokens": 3},
            "turnkv": {"mode": "standard", "turn": 1}}
    pending = _Pending()
    observer = Observer(pending, {"content-type": "application/json",  # type: ignore[arg-type]
                                  "content-encoding": "gzip"}, "http://h/v1/chat/completions")
    packed = gzip.compress(json.dumps(body).encode())
    observer.feed(packed[:10])
    observer.feed(packed[10:])
    observer.finish(exhausted=True)
    observed = pending.completed
    assert observed is not None
    assert observed.wire == body["turnkv"] and observed.text == "hi"  # type: ignore[attr-defined]

    cut = _Pending()
    observer = Observer(cut, {"content-type": "text/event-stream"},  # type: ignore[arg-type]
                        "http://h/v1/chat/completions")
    observer.feed(b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n')
    observer.finish(exhausted=False)  # closed before the stats chunk and [DONE]
    assert cut.failed and cut.completed is None


def test_retry_after_is_honoured_and_capped() -> None:
    import email.utils
    import time

    import httpx
    import openai
    from tenacity import RetryCallState

    from turnkv.retry import retry_after_s

    def error(headers: dict[str, str], status: int = 503) -> openai.APIStatusError:
        request = httpx.Request("POST", "http://h/v1/chat/completions")
        return openai.APIStatusError("busy", response=httpx.Response(
            status, headers=headers, request=request), body=None)

    assert retry_after_s(error({"retry-after": "2"})) == 2.0
    in_ten = email.utils.formatdate(time.time() + 10, usegmt=True)
    assert 5 < (retry_after_s(error({"retry-after": in_ten})) or 0) <= 10
    assert retry_after_s(error({"retry-after": "soon"})) is None
    assert retry_after_s(error({})) is None

    policy = turnkv.RetryPolicy(max_retry_after_s=3.0, initial_wait_s=0.5, max_wait_s=1.5)
    state = RetryCallState(retry_object=policy.retrying(), fn=None, args=(), kwargs={})
    state.set_exception((openai.APIStatusError, error({"retry-after": "120"}), None))
    assert policy.wait(state) == 3.0  # capped
    state.set_exception((openai.APIStatusError, error({}), None))
    state.attempt_number = 3
    assert policy.wait(state) == 1.5  # 0.5 * 2**2, capped at max_wait_s
    assert policy.should_retry(error({}, 429)) and policy.should_retry(error({}, 503))
    assert not policy.should_retry(error({}, 500)) and not policy.should_retry(error({}, 400))
    request = httpx.Request("POST", "http://h")
    assert policy.should_retry(openai.APIConnectionError(request=request))
    assert not policy.should_retry(openai.APITimeoutError(request=request))


def test_early_headers_stand_in_for_missing_final_stats() -> None:
    headers = {"x-turnkv-session": "s", "x-turnkv-turn": "4", "x-turnkv-prefill-node":
               "prefill-0", "x-turnkv-decode-node": "decode-1", "x-turnkv-prefill-computed":
               "30", "x-turnkv-prefill-cached": "128", "x-turnkv-fallback": "session_moved",
               "x-turnkv-prefix-break-at": "77"}
    session = turnkv.session("s")
    turn = session.record(None, 5.0, turn=4, early_headers={k.upper(): v
                                                            for k, v in headers.items()})
    stats = turn.stats
    assert stats.served_by_turnkv and (stats.turn, stats.mode) == (4, "unknown")
    assert (stats.prompt_tokens.total, stats.computed_tokens, stats.reused_tokens) == (158, 30,
                                                                                      128)
    assert (stats.fallback, stats.prefix_break_at) == ("session_moved", 77)
    assert stats.decode_node == "decode-1" and stats.client_ttft_ms == 5.0
    assert session.turn == 5
    unknown = turnkv.TurnStats.from_headers({"x-turnkv-fallback": "made_up"}, turn=1)
    assert unknown.fallback is None


def test_a_turn_served_by_the_decode_engine_alone_counts_its_work() -> None:
    # turnkv's short delta: no prefill side, the decode engine computed 40 of 300 tokens.
    alone = p.RouterTurnStats(mode="turnkv", decode_node="decode-0",
                        prompt_tokens=p.PromptTokens(total=300, decode_cached=260,
                                                     decode_computed=40))
    stats = turnkv.TurnStats.from_wire(alone.model_dump())
    assert stats.reused_tokens == 260 and stats.computed_tokens == 40
