"""Stock clients on real engines: what a user gets who tags nothing (tiny model, float32, a
turnkv prefill/decode pair, and one plain engine beside it as the reference).

- A stock openai client with no tags plays several conversations at once, two sharing a long
  system prompt, one edited mid-way: the router infers one session per conversation (the
  edited one goes on in a fork of its own), never merges two, every turn from the second on
  reuses KV, and every answer equals the single engine's (`tests.support.oracle`).
- A streaming client that reads `choices[0]` of every chunk, as vLLM's
  `benchmarks/multi_turn` client does, plays a conversation untagged and one with
  `X-Session-ID` (and `conversation_id`, as that client's `--send-conversation-id` sends
  them): no chunk without choices reaches it, and both conversations are sessions whose
  later turns reuse KV.

The engines are the suite's tiny turnkv ones (`TINY_ENGINES`), behind a router of this
module's own; the single tiny engine played each conversation first, with the suite's others
(`tests.support.stock_conversations`): a stock client sends back the replies it got, so each
turn's reference is the engine's answer to the same history as long as every reply before it
equalled the reference's. A turn whose history departs from it (an earlier near-tie the oracle
accepted) has no reference to compare with: it is checked for its session and reuse only.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests.support.cluster_pool import ClusterPool
from tests.support.clusters import TINY_ENGINES, ClusterSpec, RouterView
from tests.support.oracle import Completion, compare
from tests.support.reference import References
from tests.support.stock_conversations import (
    AT_ONCE,
    BENCHMARK_IDS,
    EDITED_AT,
    MAX_TOKENS,
    StockConversation,
    benchmark_conversation,
)
from turnkv_server.launcher import ClusterState

# A router of its own (nothing inferred from other modules' turns) in front of one prefill
# and one decode engine.
CLUSTER = ClusterSpec("stock-clients", TINY_ENGINES["turnkv"], RouterView())
pytestmark = pytest.mark.cluster(CLUSTER)


@pytest.fixture
def pair(clusters: ClusterPool, tiny_references: References) -> ClusterState:
    """The turnkv pair behind this module's router, once the references are played (the pool
    runs one engine set at a time)."""
    return clusters.get(CLUSTER)[1]


def comparable(expected: list[Completion], replies: list[str]) -> bool:
    """Whether the conversation's history so far is the reference's (its replies equal)."""
    return replies == [turn.text for turn in expected[:len(replies)]]


def stock_turn(client: openai.OpenAI, model: str, messages: list[dict[str, Any]]
               ) -> tuple[Completion, dict[str, Any]]:
    """A greedy turn as a stock openai client sends it (no tags), asking vLLM for the token
    IDs to compare; the router's stats from the body's `turnkv` field."""
    response = client.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
        temperature=0, extra_body={"return_token_ids": True})
    choice = response.choices[0]
    token_ids = list((choice.model_extra or {}).get("token_ids") or [])
    stats = dict((response.model_extra or {})["turnkv"])
    return Completion(token_ids, choice.message.content or ""), stats


def reused(stats: dict[str, Any]) -> int:
    tokens = stats["prompt_tokens"]
    return int(tokens["total"] - (tokens["prefill_computed"] or 0)
               - (tokens["decode_computed"] or 0))


def test_untagged_conversations_are_one_inferred_session_each(
        tiny_references: References, pair: ClusterState) -> None:
    expected = {c.name: tiny_references[c] for c in AT_ONCE}
    replies: dict[str, list[str]] = {c.name: [] for c in AT_ONCE}
    sessions: dict[str, list[str]] = {c.name: [] for c in AT_ONCE}
    compared: dict[str, int] = {c.name: 0 for c in AT_ONCE}
    stock = openai.OpenAI(base_url=f"{pair.router}/v1", api_key="none", max_retries=0)

    def play(conversation: StockConversation, turn: int) -> None:
        name = conversation.name
        out, stats = stock_turn(stock, pair.served_model_name,
                                conversation.messages(turn, replies[name]))
        if comparable(expected[name], replies[name]):
            verdict = compare(expected[name][turn - 1], out)
            assert verdict.acceptable, f"{name} turn {turn}: {verdict.describe()}"
            compared[name] += 1
        assert stats["session_source"] == "inferred", stats
        sessions[name].append(stats["session_id"])
        if turn > 1:
            # The history it continues is held: on the decode engine (a short delta), or
            # through the prefill engine, whose prefix cache a fork's parent warmed.
            assert reused(stats) > 0, (name, turn, stats["prompt_tokens"])
        replies[name].append(out.text)

    turns = AT_ONCE[0].turns
    with ThreadPoolExecutor(len(AT_ONCE)) as pool:
        for turn in range(1, turns + 1):
            # Every conversation's turn at once, as the clients of one service send them.
            list(pool.map(play, AT_ONCE, [turn] * len(AT_ONCE)))
    stock.close()
    print(f"turns compared with the reference: {compared}")
    for name, ids in sessions.items():
        if name == "edited":
            before, after = ids[:EDITED_AT - 1], ids[EDITED_AT - 1:]
            assert len(set(before)) == 1 and len(set(after)) == 1 and before[0] != after[0]
        else:
            assert len(set(ids)) == 1, (name, ids)
    every = [set(ids) for ids in sessions.values()]
    assert sum(len(s) for s in every) == len(set.union(*every)) == len(AT_ONCE) + 1
    with httpx.Client(timeout=30) as http:
        for name in ("shared-a", "own"):
            view = http.get(f"{pair.router}/v1/turnkv/sessions/{sessions[name][0]}").json()
            assert view["turns"] == turns and view["totals"]["reused_tokens"] > 0, view


def benchmark_client_turn(router: str, model: str, messages: list[dict[str, Any]],
                          conversation_id: str | None, http: httpx.Client
                          ) -> tuple[str, dict[str, str]]:
    """One turn as vLLM's `benchmarks/multi_turn` client sends and reads it: streamed with
    `include_usage` false, `choices[0]["delta"]` of every chunk but `[DONE]`."""
    payload: dict[str, Any] = {"model": model, "messages": messages, "stream": True,
                               "stream_options": {"include_usage": False},
                               "max_tokens": MAX_TOKENS, "temperature": 0}
    headers = {"Content-Type": "application/json"}
    if conversation_id is not None:
        payload["conversation_id"] = conversation_id
        headers["X-Session-ID"] = conversation_id
    text = ""
    with http.stream("POST", f"{router}/v1/chat/completions", json=payload,
                     headers=headers) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            chunk = line.strip().removeprefix("data: ")
            if not chunk or chunk == "[DONE]":
                continue
            data = json.loads(chunk)
            delta = data["choices"][0]["delta"]
            text += delta.get("content") or ""
        return text, dict(response.headers)


@pytest.mark.parametrize("conversation_id", BENCHMARK_IDS, ids=["untagged", "x-session-id"])
def test_vllms_multi_turn_client_runs_on_the_router(
        tiny_references: References, pair: ClusterState, conversation_id: str | None) -> None:
    conversation = benchmark_conversation(conversation_id)
    expected = tiny_references[conversation]
    replies: list[str] = []
    session_ids = set()
    with httpx.Client(timeout=600) as http:
        for turn in range(1, conversation.turns + 1):
            text, headers = benchmark_client_turn(
                pair.router, pair.served_model_name, conversation.messages(turn, replies),
                conversation_id, http)
            # Streamed text, no token IDs to judge a near-tie by: a divergence fails here and
            # shows in the output (and every turn's history is the reference's).
            assert text == expected[turn - 1].text, (turn, text, expected[turn - 1].text)
            session_ids.add(headers["x-turnkv-session"])
            replies.append(text)
        assert len(session_ids) == 1
        session = session_ids.pop()
        if conversation_id is not None:
            assert session == conversation_id
        view = http.get(f"{pair.router}/v1/turnkv/sessions/{session}").json()
        assert view["turns"] == conversation.turns and view["totals"]["reused_tokens"] > 0, view
        assert view["last_turn"]["session_source"] == (
            "vllm" if conversation_id else "inferred")
