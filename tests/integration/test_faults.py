"""Faults on a real `turnkv` cluster (tiny model, float32): engines killed with SIGKILL
mid-stream and between turns, an engine that hangs, a KV transfer that times out, and an
engine whose core died while its API server answers 503 (health) and 500 (requests).
Elsewhere: a router killed between turns and mid-stream (test_router_shared_sessions.py); a
decode engine restarted mid-session and a lease that expired between turns
(test_turnkv_connector.py); transfers refused, timed out or to a restarted peer between two
real NIXL agents (tests/unit/test_connector_transport.py).

Each fault must end the affected turn with a clear error (an SSE error event, or a 503 with
`Retry-After`), never a hang or a silently truncated answer; a turn that finds the prefill
engine down is served by the decode engine alone instead. After the engine is back
every later turn of the session must equal a single engine's greedy output. The turns that
failed are replayed by the client, as an agent would, and must then be exact too. After each
fault the router holds no engine request open (every engine's `in_flight` back at 0: a leaked
count keeps an engine out of placement for good), and a decode engine whose reply will not be
pushed back (the prefill engine is down, or refuses a history at the model's max length) is
told to give its send up at once rather than hold the blocks for the send timeout.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import httpx
import pytest

from tests.support.cluster_pool import ClusterPool
from tests.support.clusters import FIXED_POOLS, TINY_ENGINES, ClusterSpec, RouterView
from tests.support.oracle import Completion, compare, routed_chat
from tests.support.reference import SHORT_SCRIPT, References
from tests.support.waiting import wait_for as wait_for_condition
from turnkv_server import local_http
from turnkv_server.engine.metrics import fetch_connector_counters
from turnkv_server.launcher import Cluster, ClusterState
from turnkv_server.launcher.processes import group_members

TURNS = 4
MAX_TOKENS = SHORT_SCRIPT.max_tokens
# A hung engine fails its turn after this long without a byte (the router's default is 600 s,
# above the longest CPU prefill).
READ_TIMEOUT_S = 8.0
# The tiny turnkv engines (one prefill, two decode), whose first two this module's router
# serves; a registered receive that gets no KV in RECEIVE_TIMEOUT_S is recomputed.
# In fixed pools: the faults are the P/D form's (a prefill engine lost, a transfer timed out).
CLUSTER = ClusterSpec("faults", TINY_ENGINES["turnkv"], RouterView(
    prefill=1, decode=1, args=("--engine-read-timeout", str(READ_TIMEOUT_S),
                               "--health-interval", "1", *FIXED_POOLS)))
pytestmark = pytest.mark.cluster(CLUSTER)


@pytest.fixture(scope="module")
def reference(tiny_references: References
              ) -> tuple[list[list[dict[str, Any]]], list[Completion]]:
    # The shared-session tests' conversation: its first TURNS turns.
    played = tiny_references[SHORT_SCRIPT]
    return played.messages[:TURNS], played.turns[:TURNS]


@pytest.fixture
def cluster(clusters: ClusterPool) -> tuple[Cluster, ClusterState]:
    return clusters.get(CLUSTER)


@pytest.fixture
def clean_cluster(clusters: ClusterPool) -> tuple[Cluster, ClusterState]:
    """For a test that compares the blocks in use before and after: no lease of an earlier
    test may end in between."""
    return clusters.clean(CLUSTER)


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=120) as c:
        yield c


# This module's pace: its waits are for what takes about this long.
wait_for = partial(wait_for_condition, timeout=300.0, interval=0.5)


def engine(launched: Cluster, role: str) -> Any:
    return next(e for e in launched.engines if e.spec.role == role)


def nothing_in_flight(state: ClusterState, client: httpx.Client) -> None:
    """Every engine request the router made has ended. (Push backs and lease releases run on
    after their turns: give them a moment.)"""
    def idle() -> bool:
        engines = client.get(f"{state.router}/v1/turnkv/stats").json()["engines"]
        return all(e["in_flight"] == 0 for e in engines)
    wait_for(idle, "no engine request left in flight", timeout=30)


def kill_9(victim: Any) -> None:
    """SIGKILL the engine's whole process group, as a crash or the OOM killer would."""
    assert victim.ref is not None
    os.killpg(victim.ref.pid, signal.SIGKILL)


def restart(victim: Any, state: ClusterState, client: httpx.Client) -> None:
    victim.stop()  # reaps what is left of the group
    victim.start()
    wait_for(victim.is_healthy, f"{victim.spec.name} healthy again")
    # ...and the router's health loop has seen it.
    wait_for(lambda: all(e["healthy"] for e in client.get(
        f"{state.router}/v1/turnkv/stats").json()["engines"]), "the router sees it healthy")


def play(state: ClusterState, client: httpx.Client,
         reference: tuple[list[list[dict[str, Any]]], list[Completion]], session_id: str,
         turn: int, stream: bool = False) -> dict[str, Any]:
    messages, expected = reference
    out = routed_chat(state.router, state.served_model_name, messages[turn - 1], MAX_TOKENS,
                      session={"session_id": session_id, "turn": turn}, stream=stream,
                      client=client)
    verdict = compare(expected[turn - 1], out.completion)
    print(f"{session_id} turn {turn}: {verdict.describe()}; {out.stats['prompt_tokens']}")
    assert verdict.acceptable, f"{session_id} turn {turn}: {verdict.describe()}"
    return out.stats


def stream_until_fault(state: ClusterState, client: httpx.Client,
                       messages: list[dict[str, Any]], session_id: str, turn: int,
                       fault: Callable[[], None]) -> list[dict[str, Any]]:
    """Stream a long answer; inject `fault` after the first token; return the events."""
    body = {"model": state.served_model_name, "messages": messages, "max_tokens": 400,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "turnkv": {"session_id": session_id, "turn": turn}}
    events: list[dict[str, Any]] = []
    with client.stream("POST", f"{state.router}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: "):]))
            if len(events) == 1:
                fault()
    return events


def test_a_decode_engine_killed_mid_stream(
    reference: tuple[list[list[dict[str, Any]]], list[Completion]],
    cluster: tuple[Cluster, ClusterState], client: httpx.Client,
) -> None:
    launched, state = cluster
    decode = engine(launched, "decode")
    play(state, client, reference, "mid-stream", 1)
    events = stream_until_fault(state, client, reference[0][1], "mid-stream", 2,
                                lambda: kill_9(decode))
    # The stream ends with an error event, not a silently short answer.
    assert "error" in events[-1], events[-1]
    assert "decode engine lost mid-stream" in events[-1]["error"]["message"]
    assert not any(e.get("turnkv") for e in events)  # no stats: the turn did not complete
    restart(decode, state, client)
    # The agent replays the failed turn; the restarted engine has no KV of the session and
    # must recompute, exactly.
    for turn in (2, 3, 4):
        play(state, client, reference, "mid-stream", turn, stream=turn == 3)
    nothing_in_flight(state, client)


def test_a_prefill_engine_killed_between_turns(
    reference: tuple[list[list[dict[str, Any]]], list[Completion]],
    cluster: tuple[Cluster, ClusterState], client: httpx.Client,
) -> None:
    launched, state = cluster
    prefill = engine(launched, "prefill")
    play(state, client, reference, "no-prefill", 1)
    nothing_in_flight(state, client)  # the first turn's push back has landed
    decode = engine(launched, "decode")
    before = fetch_connector_counters(decode.spec.url)
    kill_9(prefill)
    # A turn that needs a prefill (a new conversation's first) is replayed on the decode
    # engine alone, which computes it as a single engine would: exactly, and at once, rather
    # than 503 until the prefill engine is back.
    first = play(state, client, reference, "no-prefill-new", 1)
    assert first["prefill_node"] is None and first["fallback"] == "engine_unavailable", first
    # A short delta never needed the prefill engine: the session's decode engine serves it.
    assert play(state, client, reference, "no-prefill", 2, stream=True)["prefill_node"] is None
    # Nothing is kept for a push back to the dead prefill engine, so nothing has to be given
    # up: no blocks held for a send nobody will register for.
    nothing_in_flight(state, client)
    assert fetch_connector_counters(decode.spec.url)["sends_abandoned"] \
        == before["sends_abandoned"]
    restart(prefill, state, client)
    for turn in (3, 4):
        play(state, client, reference, "no-prefill", turn)
    nothing_in_flight(state, client)


def test_a_hung_decode_engine_fails_the_turn_instead_of_hanging(
    reference: tuple[list[list[dict[str, Any]]], list[Completion]],
    cluster: tuple[Cluster, ClusterState], client: httpx.Client,
) -> None:
    launched, state = cluster
    decode = engine(launched, "decode")
    assert decode.ref is not None
    play(state, client, reference, "hung", 1)
    try:
        events = stream_until_fault(state, client, reference[0][1], "hung", 2,
                                    lambda: os.killpg(decode.ref.pid, signal.SIGSTOP))
    finally:
        os.killpg(decode.ref.pid, signal.SIGCONT)
    assert "error" in events[-1], events[-1]
    wait_for(decode.is_healthy, "the decode engine answering again", timeout=60)
    wait_for(lambda: all(e["healthy"] for e in client.get(
        f"{state.router}/v1/turnkv/stats").json()["engines"]), "the router sees it healthy")
    for turn in (2, 3, 4):
        play(state, client, reference, "hung", turn)
    nothing_in_flight(state, client)


def test_a_transfer_that_times_out(
    reference: tuple[list[list[dict[str, Any]]], list[Completion]],
    clean_cluster: tuple[Cluster, ClusterState], client: httpx.Client,
) -> None:
    launched, state = clean_cluster
    prefill, decode = engine(launched, "prefill"), engine(launched, "decode")
    assert prefill.ref is not None
    # A write can land only once the decode engine has met the prefill engine (their hello
    # answered): a receive whose hello never got an answer is handed back at once, with
    # nothing to quarantine. A session's first turn makes them meet; it then ends.
    play(state, client, reference, "meet", 1)
    assert client.delete(f"{state.router}/v1/turnkv/sessions/meet").status_code == 200
    nothing_in_flight(state, client)
    wait_for(lambda: fetch_connector_counters(decode.spec.url)["kv_cache_usage"] == 0,
             "the first turn's blocks free on the decode engine", timeout=30)
    before = fetch_connector_counters(decode.spec.url)
    # The prefill engine hangs before a new conversation's turn: the decode engine registers
    # for its KV and waits; the router waits for the prefill's answer. The turn is streamed:
    # the decode engine's headers are in long before the prefill fails, and the router must
    # still close that request.
    os.killpg(prefill.ref.pid, signal.SIGSTOP)
    try:
        # (Usage asked for: the turn's stats then come with it, in the last chunk.)
        fresh = {"model": state.served_model_name, "max_tokens": 4, "stream": True,
                 "stream_options": {"include_usage": True},
                 "messages": [{"role": "user", "content": "Is anyone there?"}]}
        response = client.post(f"{state.router}/v1/chat/completions", json=fresh)
        # The prefill fails at the read timeout, and the turn is replayed on the decode engine
        # alone.
        assert response.status_code == 200, response.text
        events = [json.loads(line[len("data: "):]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        stats = events[-1]["turnkv"]
        assert stats["prefill_node"] is None and stats["fallback"] == "engine_unavailable"
        # The decode engine gave up on the KV that never came. The stopped sender could still
        # write once it runs again, so the receive's blocks stay out of use (quarantined).
        def given_up() -> bool:
            now = fetch_connector_counters(decode.spec.url)
            return now["receives_failed"] > before["receives_failed"] and \
                now.get("quarantined_blocks", 0) > 0
        wait_for(given_up, "the decode engine's receive timed out, its blocks held", timeout=60)
    finally:
        os.killpg(prefill.ref.pid, signal.SIGCONT)
    # The untagged turn opened an inferred session, whose lease holds what the decode engine
    # computed alone: ended, only the quarantine is left to come back.
    assert client.delete(f"{state.router}/v1/turnkv/sessions/{stats['session_id']}"
                         ).status_code == 200
    # Running again, the sender answers the cancel once its writes settled: the blocks come
    # back (after a grace), none held.
    def given_back() -> bool:
        now = fetch_connector_counters(decode.spec.url)
        return now.get("quarantined_blocks") == 0 and \
            now["kv_cache_usage"] == before["kv_cache_usage"]
    wait_for(given_back, "the quarantined blocks given back", timeout=60)
    assert fetch_connector_counters(decode.spec.url).get("quarantines_expired", 0) == 0
    wait_for(lambda: all(e["healthy"] for e in client.get(
        f"{state.router}/v1/turnkv/stats").json()["engines"]), "the router sees it healthy")
    for turn in (1, 2):
        play(state, client, reference, "after-timeout", turn)
    nothing_in_flight(state, client)


def test_an_engine_whose_core_died(
    reference: tuple[list[list[dict[str, Any]]], list[Completion]],
    cluster: tuple[Cluster, ClusterState], client: httpx.Client,
) -> None:
    """Only the decode engine's core process is killed: its API server, still up, answers 503
    on /health and 5xx on requests until it exits."""
    launched, state = cluster
    decode = engine(launched, "decode")
    assert decode.ref is not None
    play(state, client, reference, "dead-core", 1)
    cores = [p for p in group_members(decode.ref.pid) if "EngineCore" in " ".join(p.cmdline())
             or "EngineCore" in p.name()]
    assert cores, [p.name() for p in group_members(decode.ref.pid)]
    for process in cores:
        process.kill()
    # What the API server says meanwhile, until it exits: 503 from /health.
    seen: set[int | str] = set()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and 503 not in seen:
        try:
            seen.add(local_http.get(f"{decode.spec.url}/health", timeout=5).status_code)
        except httpx.HTTPError as exc:
            seen.add(type(exc).__name__)
        time.sleep(0.1)
    print(f"the decode engine's /health after its core died: {seen}")
    # (Unless the API server was even quicker to exit: then nothing answers at all.)
    assert 503 in seen or any(isinstance(status, str) for status in seen), seen
    # The session's next turn (a short delta, on that engine alone) fails clearly or is
    # replayed; it never hangs and is never wrong.
    messages, expected = reference
    body = {"model": state.served_model_name, "messages": messages[1],
            "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
            "turnkv": {"session_id": "dead-core", "turn": 2}}
    response = client.post(f"{state.router}/v1/chat/completions", json=body)
    print(f"the turn after the core died: {response.status_code} {response.text[:200]}")
    if response.status_code == 200:
        got = Completion(response.json()["choices"][0]["token_ids"], "")
        assert compare(expected[1], got).acceptable
    else:
        assert response.status_code == 503, response.text
        assert response.json()["error"]["message"]
    restart(decode, state, client)
    for turn in (2, 3):
        play(state, client, reference, "dead-core", turn)
    nothing_in_flight(state, client)


def test_a_history_at_the_models_max_length_is_not_pushed_back(
    clean_cluster: tuple[Cluster, ClusterState], client: httpx.Client,
) -> None:
    """A turn whose prompt and output fill the model's context exactly: the prefill engine
    refuses the push back (no room for its one token), and the decode engine, which kept the
    turn's blocks to send them, is told to give the send up."""
    launched, state = clean_cluster
    prefill, decode = engine(launched, "prefill"), engine(launched, "decode")
    max_len = int(local_http.get(f"{decode.spec.url}/v1/models").json()["data"][0]["max_model_len"])
    before = fetch_connector_counters(decode.spec.url)
    usage_before = [fetch_connector_counters(e.spec.url)["kv_cache_usage"]
                    for e in (prefill, decode)]
    output = 4
    body = {"model": state.served_model_name, "prompt": [100] * (max_len - output),
            "max_tokens": output, "ignore_eos": True, "temperature": 0, "return_token_ids": True,
            "turnkv": {"session_id": "too-long"}}
    response = client.post(f"{state.router}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["token_ids"]) == output
    wait_for(lambda: fetch_connector_counters(decode.spec.url)["sends_abandoned"]
             == before["sends_abandoned"] + 1, "the decode engine gave its send up", timeout=30)
    # The session's leases end with it, and then nothing holds the turn's blocks.
    assert client.delete(f"{state.router}/v1/turnkv/sessions/too-long").status_code == 200
    wait_for(lambda: all(fetch_connector_counters(e.spec.url)["kv_cache_usage"] <= usage
                         for e, usage in zip((prefill, decode), usage_before, strict=True)),
             "the turn's blocks free on both engines", timeout=30)
    nothing_in_flight(state, client)
