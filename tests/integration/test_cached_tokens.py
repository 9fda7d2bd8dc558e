"""`usage.prompt_tokens_details.cached_tokens` through the router, on real engines (tiny model,
turnkv mode): what the turn did not compute, not what vLLM's decode engine calls cached.

vLLM counts the tokens a decode engine received over KV transfer as cached, so a first P/D turn
that reused nothing read as nearly all cached. The router returns the turn's reuse instead:
the prefill engine's prefix hits for a P/D turn, the decode engine's own hits for a short delta
it served alone. Each turn is checked three ways: the body's (or the usage chunk's) figure, the
router's own stats (`turnkv`, as the SDK reads them), and what the engines counted in their
`/metrics` (`vllm:prompt_tokens_by_source`).

On the same engines: a hint sent between turns (`POST .../hints`, the SDK's `hint_now`) renews
the session's leases on both engines with a renew-only request (`turnkv:leases_renewed`, and
`turnkv_hint_renewals_total` on the router), and the next turn reuses the history.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import httpx
import pytest

import turnkv
from tests.support.cluster_pool import ClusterPool
from tests.support.clusters import (
    FIXED_POOLS,
    IDLE_ROUTER,
    TINY_ENGINES,
    ClusterSpec,
    RouterView,
)
from tests.support.conversation import SYSTEM, USER_TURNS
from tests.support.oracle import RoutedCompletion, compare, routed_chat
from tests.support.reference import SHORT_SCRIPT, Reference, References
from tests.support.waiting import wait_for as wait_for_condition
from turnkv_server.engine.metrics import (
    PromptTokenSources,
    fetch_connector_counters,
    fetch_prompt_token_sources,
    sum_samples,
)
from turnkv_server.launcher import Cluster, ClusterState

# Turns adding at most this many tokens are served by the decode engine alone: the short user
# messages below are under it (with the previous reply and the chat template), the long ones
# (a USER_TURNS message, 60-80 tokens, twice) over it.
SHORT_DELTA_TOKENS = 64
SHORT_MESSAGES = ["Go on.", "And then?"]
MAX_TOKENS = 8
TURNS = 3
# In fixed pools: the P/D form's cached tokens and push backs are what is checked.
CLUSTER = ClusterSpec("usage-turnkv", TINY_ENGINES["turnkv"], RouterView(
    prefill=1, decode=1, args=(*IDLE_ROUTER, *FIXED_POOLS),
    short_delta_tokens=SHORT_DELTA_TOKENS))
pytestmark = pytest.mark.cluster(CLUSTER)


@pytest.fixture(scope="module")
def reference(tiny_references: References) -> Reference:
    """The single engine's answers to the hint test's conversation (played, in the whole
    suite, before these engines started: module-scoped, so asked for before `cluster`)."""
    return tiny_references[SHORT_SCRIPT]


@pytest.fixture
def cluster(clusters: ClusterPool) -> tuple[Cluster, ClusterState]:
    """Clean: what the engines count during a turn (their computed tokens, renewals) is that
    turn's alone, with no earlier session's release or lease to end meanwhile."""
    return clusters.clean(CLUSTER)


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=300) as c:
        yield c


# This module's pace: its waits are for what takes about this long.
wait_for = partial(wait_for_condition, timeout=30.0, interval=0.1)


def user_message(kind: str, turn: int) -> str:
    if turn == 1:
        # Over one 128-token block from the first turn on, so that turn 2 has blocks to reuse.
        return " ".join(USER_TURNS[:2])
    if kind == "short":
        return SHORT_MESSAGES[turn - 2]
    return " ".join(USER_TURNS[2 * turn - 2: 2 * turn])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("kind", ["pd", "short"])
def test_cached_tokens_are_what_the_turn_did_not_compute(
    cluster: tuple[Cluster, ClusterState], client: httpx.Client, kind: str, stream: bool
) -> None:
    _, state = cluster
    endpoints = state.endpoints()
    prefill: str = endpoints["prefill"][0]
    decode: str = endpoints["decode"][0]
    session_id = f"usage-{kind}-{'sse' if stream else 'json'}"
    block = int(fetch_connector_counters(decode)["block_size"])
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for turn in range(1, TURNS + 1):
        messages.append({"role": "user", "content": user_message(kind, turn)})
        before = {url: fetch_prompt_token_sources(url) for url in (prefill, decode)}
        pushed_before = fetch_connector_counters(prefill).get("receives_done", 0.0)
        out = routed_chat(state.router, state.served_model_name, messages, MAX_TOKENS,
                          session={"session_id": session_id}, stream=stream, client=client,
                          # Its own salt: no other test's prefixes to hit. Every reply as long
                          # as MAX_TOKENS, so that each turn has a reply to push back.
                          extra={"cache_salt": session_id, "ignore_eos": True})
        messages.append({"role": "assistant", "content": out.completion.text})
        # The push back of the reply to the prefill engine, during the pause between turns.
        wait_for(lambda pushed=pushed_before:  # type: ignore[misc]
                 fetch_connector_counters(prefill).get("receives_done", 0.0) > pushed,
                 f"turn {turn}'s push back")
        engines = {url: fetch_prompt_token_sources(url) - before[url]
                   for url in (prefill, decode)}
        check_turn(kind, turn, out, engines[prefill], engines[decode], block)
    assert client.delete(f"{state.router}/v1/turnkv/sessions/{session_id}").status_code == 200


def check_turn(kind: str, turn: int, out: RoutedCompletion, prefill: PromptTokenSources,
               decode: PromptTokenSources, block: int) -> None:
    stats = turnkv.TurnStats.from_wire(out.stats)
    tokens = stats.prompt_tokens
    cached = out.completion.usage["prompt_tokens_details"]["cached_tokens"]
    alone = stats.prefill_node is None
    print(f"{kind} turn {turn}: cached_tokens {cached}; {tokens}; engines: prefill {prefill}, "
          f"decode {decode}; note {stats.note!r}")
    assert alone == (kind == "short" and turn > 1), stats
    # The router's figure is its stats' reuse, as the SDK (and its adapters' cache_read) read it.
    assert cached == stats.reused_tokens
    assert cached + (stats.computed_tokens or 0) == tokens.total == out.completion.usage[
        "prompt_tokens"]
    if turn == 1:
        # Nothing to reuse yet; vLLM's own figure on the decode engine (its hits plus what it
        # received) would have been nearly the whole prompt.
        assert cached == 0
        assert decode.local_cache_hit + decode.external_kv_transfer >= tokens.total - 1
    else:
        # The session's history is over a block: whole blocks of it were reused.
        assert cached > 0 and cached % block == 0, cached
    if alone:
        # The decode engine computed the turn by itself: its hits are the turn's reuse.
        assert (decode.local_cache_hit, decode.local_compute) == (cached, tokens.total - cached)
        assert decode.external_kv_transfer == 0
        assert tokens.decode_cached == cached
    else:
        # The prefill engine computed what was not cached; the push back that followed the
        # turn received the reply's KV and computed only its last token.
        assert prefill.local_compute == tokens.total - cached + 1, (prefill, tokens)
        assert tokens.prefill_reused == cached
    assert stats.times.engine_prefill_ms is not None and stats.times.engine_prefill_ms > 0


def test_a_history_under_one_block_reuses_nothing_and_the_stats_say_why(
    cluster: tuple[Cluster, ClusterState], client: httpx.Client
) -> None:
    _, state = cluster
    session = {"session_id": "usage-under-a-block"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi."}]
    for _ in (1, 2):
        out = routed_chat(state.router, state.served_model_name, messages, MAX_TOKENS,
                          session=session, stream=False, client=client,
                          extra={"cache_salt": session["session_id"], "ignore_eos": True})
        messages += [{"role": "assistant", "content": out.completion.text},
                     {"role": "user", "content": SHORT_MESSAGES[0]}]
    stats = turnkv.TurnStats.from_wire(out.stats)
    assert out.completion.usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert stats.reused_tokens == 0 and stats.fallback is None
    assert stats.note is not None and "whole KV blocks of" in stats.note, stats
    assert client.delete(f"{state.router}/v1/turnkv/sessions/{session['session_id']}"
                         ).status_code == 200


# What the hint test reads: each engine's lease counters, the router's renew-only requests.
RENEWALS = ("leases_renewed", "renewals_missed")
ROUTER_RENEWALS = {"sent": ("turnkv_hint_renewals", "_total", ("outcome", "sent")),
                   "all": ("turnkv_hint_renewals", "_total", None)}


def test_a_hint_between_turns_renews_the_leases_on_both_engines(
    reference: Reference, cluster: tuple[Cluster, ClusterState], client: httpx.Client
) -> None:
    _, state = cluster
    endpoints = state.endpoints()
    engines = {"prefill": endpoints["prefill"][0], "decode": endpoints["decode"][0]}
    session_id = "hint-between-turns"
    sessions = f"{state.router}/v1/turnkv/sessions"
    block = int(fetch_connector_counters(engines["decode"])["block_size"])

    def counters() -> dict[str, dict[str, float]]:
        return {role: fetch_connector_counters(url) for role, url in engines.items()}

    def renewals() -> dict[str, dict[str, float]]:
        """Each engine's renewal counters and the router's renew-only requests."""
        now = {role: {name: c.get(name, 0.0) for name in RENEWALS}
               for role, c in counters().items()}
        text = client.get(f"{state.router}/metrics").text
        now["router"] = {name: 0.0 for name in ROUTER_RENEWALS} | sum_samples(
            text, ROUTER_RENEWALS)
        return now

    def change(now: dict[str, dict[str, float]], before: dict[str, dict[str, float]]
               ) -> dict[str, dict[str, float]]:
        return {who: {name: value - before[who][name] for name, value in values.items()}
                for who, values in now.items()}

    def turn(n: int) -> RoutedCompletion:
        """Turn `n` of the conversation, equal to the single engine's; returns once its push
        back has landed on the prefill engine (the lease there is then the turn's)."""
        pushed = fetch_connector_counters(engines["prefill"]).get("receives_done", 0.0)
        out = routed_chat(state.router, state.served_model_name, reference.messages[n - 1],
                          SHORT_SCRIPT.max_tokens, session={"session_id": session_id},
                          stream=False, client=client, extra={"cache_salt": session_id})
        verdict = compare(reference.turns[n - 1], out.completion)
        print(f"turn {n}: {verdict.describe()}; stats {out.stats['prompt_tokens']}")
        assert verdict.acceptable, f"turn {n}: {verdict.describe()}"
        assert out.completion.token_ids, f"turn {n}: no reply, so no push back to wait for"
        wait_for(lambda: fetch_connector_counters(engines["prefill"]).get(
            "receives_done", 0.0) > pushed, f"turn {n}'s push back", timeout=60)
        return out

    first = turn(1)
    assert first.stats["prefill_node"] is not None and first.stats["decode_node"] is not None

    # The hint, on its own between turns: the router renews the session's lease on each
    # engine holding it (the decode engine at once, the prefill engine after the push back).
    before = renewals()
    reply = client.post(f"{sessions}/{session_id}/hints", json={"next_turn_in": 5, "ttl": 60})
    assert reply.status_code == 200, reply.text
    assert 0 < reply.json()["expires_in_s"] <= 60, reply.json()
    want = {"prefill": 1.0, "decode": 1.0, "router": 2.0}
    deadline = time.monotonic() + 60
    while True:
        moved = change(renewals(), before)
        got = {"prefill": moved["prefill"]["leases_renewed"],
               "decode": moved["decode"]["leases_renewed"], "router": moved["router"]["all"]}
        if all(got[who] >= want[who] for who in want):
            break
        assert time.monotonic() < deadline, (
            f"the hint's renewals did not all arrive within 60 s: wanted {want}, changes "
            f"{moved} (router outcomes other than 'sent': see its log)")
        time.sleep(0.2)
    assert moved["router"] == {"sent": 2.0, "all": 2.0}, moved
    for role in ("prefill", "decode"):
        assert moved[role] == {"leases_renewed": 1.0, "renewals_missed": 0.0}, (role, moved)

    # The next turn finds the history the renewed leases kept, and equals the single engine.
    second = turn(2)
    stats = turnkv.TurnStats.from_wire(second.stats)
    assert second.stats["decode_node"] == first.stats["decode_node"]
    assert stats.reused_tokens > 0 and stats.reused_tokens % block == 0, stats
    assert second.completion.usage["prompt_tokens_details"]["cached_tokens"] \
        == stats.reused_tokens
    assert change(renewals(), before) == moved  # a turn renews no lease of this kind

    # `final`, sent on its own, ends the session: its leases are released, none renewed;
    # a hint for the ended session renews nothing anywhere.
    before = renewals()
    released = {role: c.get("leases_released", 0.0) for role, c in counters().items()}
    reply = client.post(f"{sessions}/{session_id}/hints", json={"final": True})
    assert reply.status_code == 200 and reply.json()["released"] is True, reply.text
    wait_for(lambda: all(c.get("leases_released", 0.0) > released[role]
                         for role, c in counters().items()),
             "the session's leases released on both engines", timeout=60)
    reply = client.post(f"{sessions}/{session_id}/hints", json={"next_turn_in": 5, "ttl": 60})
    assert reply.status_code == 404, reply.text
    # Nothing to wait for: give a renewal the router should not have sent time to land.
    time.sleep(2.0)
    moved = change(renewals(), before)
    assert all(value == 0 for values in moved.values() for value in values.values()), moved
