"""`usage.prompt_tokens_details.cached_tokens` through the router, on real engines (tiny model,
turnkv mode): what the turn did not compute, not what vLLM's decode engine calls cached.

vLLM counts the tokens a decode engine received over KV transfer as cached, so a first P/D turn
that reused nothing read as nearly all cached. The router returns the turn's reuse instead:
the prefill engine's prefix hits for a P/D turn, the decode engine's own hits for a short delta
it served alone. Each turn is checked three ways: the body's (or the usage chunk's) figure, the
router's own stats (`turnkv`, as the SDK reads them), and what the engines counted in their
`/metrics` (`vllm:prompt_tokens_by_source`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

import turnkv
from tests.support.clusters import IDLE_ROUTER, TINY_ENGINES, ClusterPool, ClusterSpec, RouterView
from tests.support.conversation import SYSTEM, USER_TURNS
from tests.support.oracle import RoutedCompletion, routed_chat
from turnkv_server.engine.metrics import (
    PromptTokenSources,
    fetch_connector_counters,
    fetch_prompt_token_sources,
)
from turnkv_server.launcher import Cluster, ClusterState

# Turns adding at most this many tokens are served by the decode engine alone: the short user
# messages below are under it (with the previous reply and the chat template), the long ones
# (a USER_TURNS message, 60-80 tokens, twice) over it.
SHORT_DELTA_TOKENS = 64
SHORT_MESSAGES = ["Go on.", "And then?"]
MAX_TOKENS = 8
TURNS = 3
CLUSTER = ClusterSpec("usage-turnkv", TINY_ENGINES["turnkv"], RouterView(
    prefill=1, decode=1, args=IDLE_ROUTER, short_delta_tokens=SHORT_DELTA_TOKENS))
pytestmark = pytest.mark.cluster(CLUSTER)


@pytest.fixture
def cluster(clusters: ClusterPool) -> tuple[Cluster, ClusterState]:
    return clusters.get(CLUSTER)


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=300) as c:
        yield c


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.1)


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
