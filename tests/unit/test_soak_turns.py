"""The soak's client (scripts/soak_turns.py): a turn retried under the SDK's retry policy, and
each turn's outcome, against answers scripted per attempt (httpx's MockTransport: this is the
client's logic, not a server's)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.oracle import Completion

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import soak_turns  # noqa: E402

EXPECTED = Completion([5, 6], "ab")
OK = {"choices": [{"token_ids": [5, 6]}], "turnkv": {"prefill_node": "prefill-0"}}


def play(answers: list[Callable[[httpx.Request], httpx.Response]], stream: bool = False,
         budget_s: float = 60.0) -> tuple[soak_turns.TurnResult, list[float]]:
    """Play one turn against `answers` (one per attempt); the result and when each attempt
    came (seconds after the first)."""
    times: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        times.append(time.monotonic())
        return answers[min(len(times), len(answers)) - 1](request)

    body = {"stream": stream, "turnkv": {"session_id": "s", "turn": 1}}

    async def run() -> soak_turns.TurnResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await soak_turns.play_turn(client, ("router-1", "http://router"), body,
                                              EXPECTED, time.monotonic(), budget_s)

    result = asyncio.run(run())
    return result, [t - times[0] for t in times]


def status(code: int, **headers: str) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(code, headers=headers, json={"error": "x"})


def ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json=OK)


def events(*payloads: Any) -> Callable[[httpx.Request], httpx.Response]:
    text = "".join(f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n" for p in payloads)
    return lambda request: httpx.Response(200, text=text)


def test_a_503_is_retried_after_its_retry_after() -> None:
    result, times = play([status(503, **{"Retry-After": "0.3"}), ok])
    assert result.outcome == "ok" and [a.kind for a in result.attempts] == ["status", "ok"]
    assert result.attempts[0].retry_after_s == pytest.approx(0.3)
    assert times[1] >= 0.3
    assert result.prefill_node == "prefill-0"


def test_a_connection_error_and_a_stream_cut_by_an_error_event_are_retried() -> None:
    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    streamed_ok = events({"choices": [{"token_ids": [5]}]},
                         {"choices": [{"token_ids": [6]}], "turnkv": {}}, "[DONE]")
    result, _ = play([refused, events({"error": {"message": "decode engine lost"}}),
                      streamed_ok], stream=True)
    assert [a.kind for a in result.attempts] == ["connection", "error_event", "ok"]
    assert result.outcome == "ok"


@pytest.mark.parametrize(("answer", "outcome"), [
    (lambda r: httpx.Response(200, json={**OK, "choices": [{"token_ids": [5, 7]}]}),
     "lost_wrong"),
    (lambda r: httpx.Response(200, json={"choices": [{"token_ids": [5, 6]}]}), "lost_garbled"),
    (status(400), "lost_refused"),
])
def test_a_wrong_garbled_or_refused_answer_is_final(
        answer: Callable[[httpx.Request], httpx.Response], outcome: str) -> None:
    result, times = play([answer, ok])
    assert result.outcome == outcome and len(times) == 1


def test_a_turn_retried_past_its_budget_is_unanswered() -> None:
    result, times = play([status(429, **{"Retry-After": "0.2"})], budget_s=0.5)
    assert result.outcome == "lost_unanswered"
    assert 2 <= len(times) <= 3 and all(a.status == 429 for a in result.attempts)
