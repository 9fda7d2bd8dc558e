"""The soak's clients (scripts/soak.py): scripted conversations, each turn played until it is
answered as a client with the SDK's retry policy plays it, checked against a single engine's
output, and tallied.

Each turn ends in exactly one outcome (docs/reliability.md, Soak): `ok`, or lost as `wrong`
(complete, other tokens), `garbled` (a 200 that is not a complete answer), `refused` (a status
the SDK does not retry) or `unanswered` (no answer within the turn's time budget).
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_before_delay

from tests.support.oracle import Completion, compare, greedy_chat
from turnkv.retry import RetryPolicy, retry_after_s
from turnkv_server.launcher import Cluster, ClusterConfig

MAX_TOKENS = 8
# The SDK's policy: 429 and 503 (after their Retry-After, up to 30 s) and connection errors,
# else 0.5 s doubling up to 8 s. Here timeouts are retried too, and attempts are bounded by
# time (each turn's budget), not by the SDK's three: an engine restart on this machine takes
# longer than three attempts wait.
POLICY = RetryPolicy(retry_timeouts=True)
SYSTEM = "You are a terse assistant in a reliability soak. Answer briefly."
TOPICS = ("the weather on the coast", "a list of three colours", "how a lock works",
          "why the sky is blue", "a short poem about rust", "the rules of chess",
          "the boiling point of water", "a name for a cat", "how trains brake",
          "what a prime number is")
# Every retried turn is kept up to a bound well above one per session per fault (64 sessions
# x 3 faults): a record cut at 100 once read as turns that hung.
RETRIED_KEPT = 2000


@dataclass
class Script:
    """One conversation: the messages of each turn (with the reference's replies as the
    assistant's turns) and the single engine's greedy output for each turn."""

    messages: list[list[dict[str, Any]]]
    expected: list[Completion]


def reference_scripts(count: int, turns: int, run_dir: Path) -> list[Script]:
    """Every script's turns on one engine with prefix caching (`single` mode): the output
    every routed turn must equal, token by token (near-ties allowed: tests/support/oracle)."""
    config = ClusterConfig(mode="single", model="tiny", dtype="float32", run_dir=run_dir)
    scripts = []
    with Cluster(config) as state, httpx.Client(timeout=300) as client:
        for index in range(count):
            rng = random.Random(index)
            messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
            per_turn, expected = [], []
            for turn in range(1, turns + 1):
                messages.append({"role": "user", "content": f"Conversation {index}, turn "
                                 f"{turn}: tell me about {rng.choice(TOPICS)}."})
                per_turn.append([dict(m) for m in messages])
                out = greedy_chat(state.router, state.served_model_name, messages, MAX_TOKENS,
                                  client=client)
                expected.append(out)
                messages.append({"role": "assistant", "content": out.text})
            scripts.append(Script(per_turn, expected))
    return scripts


@dataclass
class Attempt:
    router: str
    at_s: float
    kind: str  # ok, wrong, garbled, status, error_event, connection, timeout
    status: int | None = None
    detail: str = ""
    retry_after_s: float | None = None


class Retry(Exception):
    """An attempt the client retries. `response`: the answer, whose Retry-After the SDK's
    policy honours."""

    def __init__(self, attempt: Attempt, response: httpx.Response | None = None) -> None:
        super().__init__(attempt.kind)
        self.attempt, self.response = attempt, response


@dataclass
class TurnResult:
    session: str
    turn: int
    outcome: str  # ok, lost_wrong, lost_garbled, lost_refused, lost_unanswered
    attempts: list[Attempt]
    seconds: float
    prefill_node: str | None = None


@dataclass
class SoakTally:
    results: Counter[str] = field(default_factory=Counter)
    ok_first_try: int = 0
    ok_after_retry: int = 0
    attempt_kinds: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)  # ok turns, first attempt to answer
    retried: list[dict[str, Any]] = field(default_factory=list)
    lost: list[dict[str, Any]] = field(default_factory=list)
    server_errors: list[dict[str, Any]] = field(default_factory=list)  # >= 500 but 503
    short_deltas: int = 0
    in_flight: int = 0
    open_sessions: set[str] = field(default_factory=set)

    def record(self, result: TurnResult) -> None:
        self.results[result.outcome] += 1
        for attempt in result.attempts:
            self.attempt_kinds[attempt.kind] += 1
            if attempt.status is not None:
                self.statuses[attempt.status] += 1
                if attempt.status >= 500 and attempt.status != 503:
                    self.server_errors.append({"session": result.session,
                                               "turn": result.turn, **asdict(attempt)})
        record = {"session": result.session, "turn": result.turn, "outcome": result.outcome,
                  "seconds": round(result.seconds, 2),
                  "attempts": [asdict(a) for a in result.attempts]}
        if result.outcome == "ok":
            self.latencies.append(result.seconds)
            if len(result.attempts) == 1:
                self.ok_first_try += 1
            else:
                self.ok_after_retry += 1
            if result.prefill_node is None:
                self.short_deltas += 1
        else:
            self.lost.append(record)
        if len(result.attempts) > 1 and len(self.retried) < RETRIED_KEPT:
            self.retried.append(record)

    @property
    def attempted(self) -> int:
        return sum(self.results.values())

    @property
    def lost_count(self) -> int:
        return self.attempted - self.results["ok"]


def _status(router: str, at: float, response: httpx.Response) -> Attempt:
    attempt = Attempt(router, at, "status", response.status_code, response.text[:300])
    if response.status_code in POLICY.statuses:
        retry = Retry(attempt, response)
        attempt.retry_after_s = retry_after_s(retry)
        raise retry
    return attempt


async def _read_stream(response: httpx.Response, router: str, at: float
                       ) -> tuple[Attempt | None, list[int], dict[str, Any] | None]:
    """A streamed answer's token IDs and stats; an attempt if it was not a complete one."""
    token_ids: list[int] = []
    stats: dict[str, Any] | None = None
    done, error = False, None
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            done = True
            continue
        try:
            event = json.loads(payload)
        except json.JSONDecodeError:
            return Attempt(router, at, "garbled", 200, f"not JSON: {payload[:200]}"), [], None
        if "error" in event:
            error = event["error"]
        if isinstance(event.get("turnkv"), dict):
            stats = event["turnkv"]
        for choice in event.get("choices") or []:
            token_ids.extend(choice.get("token_ids") or [])
    if error is not None:
        # An agent replays a turn whose stream failed mid-answer (test_faults.py does the
        # same); the SDK itself retries only before the first byte.
        message = error.get("message") if isinstance(error, dict) else error
        raise Retry(Attempt(router, at, "error_event", 200, str(message)[:300]))
    if not done or stats is None:
        return Attempt(router, at, "garbled", 200,
                       "the stream ended without its stats or [DONE]"), [], None
    return None, token_ids, stats


async def attempt_turn(client: httpx.AsyncClient, router: tuple[str, str],
                       body: dict[str, Any], expected: Completion, t0: float
                       ) -> tuple[Attempt, str | None]:
    """One attempt at a turn through `router` (name, URL); (what happened, the prefill engine
    that served it). Raises Retry for what the client retries."""
    name, at = router[0], round(time.monotonic() - t0, 2)
    url = f"{router[1]}/v1/chat/completions"
    try:
        if body["stream"]:
            async with client.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    return _status(name, at, response), None
                bad, token_ids, stats = await _read_stream(response, name, at)
                if bad is not None:
                    return bad, None
        else:
            response = await client.post(url, json=body)
            if response.status_code != 200:
                return _status(name, at, response), None
            try:
                data = response.json()
                token_ids = list(data["choices"][0]["token_ids"])
                stats = data.get("turnkv")
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                return Attempt(name, at, "garbled", 200, f"{exc!r}: {response.text[:200]}"), None
            if stats is None:
                return Attempt(name, at, "garbled", 200, "no turnkv stats"), None
    except httpx.TimeoutException as exc:
        raise Retry(Attempt(name, at, "timeout", detail=type(exc).__name__)) from exc
    except httpx.TransportError as exc:
        raise Retry(Attempt(name, at, "connection",
                            detail=f"{type(exc).__name__}: {exc}"[:300])) from exc
    verdict = compare(expected, Completion(token_ids, ""))
    if not verdict.acceptable:
        return Attempt(name, at, "wrong", 200, f"{verdict.describe()}; got {token_ids}, "
                       f"expected {expected.token_ids}"), None
    return Attempt(name, at, "ok", 200), (stats or {}).get("prefill_node")


async def play_turn(client: httpx.AsyncClient, router: tuple[str, str], body: dict[str, Any],
                    expected: Completion, t0: float, budget_s: float) -> TurnResult:
    """A turn until it is answered, retried under the SDK's policy within `budget_s` from its
    first attempt; a wrong or garbled answer, or a status the policy does not retry, is
    final."""
    tag = body["turnkv"]
    start = time.monotonic()
    attempts: list[Attempt] = []
    retrying = AsyncRetrying(stop=stop_before_delay(budget_s), wait=POLICY.wait,
                             retry=retry_if_exception_type(Retry), reraise=True)
    prefill: str | None = None
    try:
        async for trial in retrying:
            with trial:
                try:
                    attempt, prefill = await attempt_turn(client, router, body, expected, t0)
                except Retry as retry:
                    attempts.append(retry.attempt)
                    raise
                attempts.append(attempt)
    except Retry:
        outcome = "lost_unanswered"
    else:
        outcome = {"ok": "ok", "wrong": "lost_wrong", "garbled": "lost_garbled"}.get(
            attempts[-1].kind, "lost_refused")
    return TurnResult(tag["session_id"], tag["turn"], outcome, attempts,
                      time.monotonic() - start, prefill)
