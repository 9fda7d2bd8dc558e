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

This module starts its own engines: the pair and the reference engine run together (each turn
is compared with the reference as it is played, since a stock client sends back the replies
it got).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests.support.clusters import TINY_CACHE_BYTES
from tests.support.conversation import SYSTEM, USER_TURNS
from tests.support.oracle import Completion, compare, greedy_chat
from turnkv_server.launcher import Cluster, ClusterConfig, ClusterState
from turnkv_server.models import build_tiny

MAX_TOKENS = 16
TURNS = 4
# Longer than a KV block (128 tokens): the conversations that share it share whole blocks.
LONG_SYSTEM = " ".join([SYSTEM] * 3)
EDITED_AT = 3  # the turn at which conversation "edited" rewrites its second question


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClusterState,
                                                                        ClusterState]]:
    """(the turnkv pair behind its router, the single reference engine), both running."""
    model = str(build_tiny())
    pair = Cluster(ClusterConfig(mode="turnkv", model=model, dtype="float32",
                                 run_dir=tmp_path_factory.mktemp("stock-pair"),
                                 kv_cache_bytes=TINY_CACHE_BYTES))
    single = Cluster(ClusterConfig(mode="single", model=model, dtype="float32",
                                   run_dir=tmp_path_factory.mktemp("stock-single")))
    with pair as pair_state, single as single_state:
        yield pair_state, single_state


def reference(single: ClusterState, messages: list[dict[str, Any]], salt: str,
              client: httpx.Client) -> Completion:
    # A salt per conversation: each reference computed as on an engine of its own.
    return greedy_chat(single.router, single.served_model_name, messages, MAX_TOKENS,
                       client=client, extra={"cache_salt": salt})


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
        engines: tuple[ClusterState, ClusterState]) -> None:
    pair, single = engines
    conversations: dict[str, list[dict[str, Any]]] = {
        "shared-a": [{"role": "system", "content": LONG_SYSTEM}],
        "shared-b": [{"role": "system", "content": LONG_SYSTEM}],
        "edited": [{"role": "system", "content": LONG_SYSTEM}],
        "own": [{"role": "system", "content": SYSTEM}],
    }
    questions = {name: USER_TURNS[number:] + USER_TURNS[:number]
                 for number, name in enumerate(conversations)}
    sessions: dict[str, list[str]] = {name: [] for name in conversations}
    stock = openai.OpenAI(base_url=f"{pair.router}/v1", api_key="none", max_retries=0)

    def play(name: str, turn: int, http: httpx.Client) -> None:
        messages = conversations[name]
        if name == "edited" and turn == EDITED_AT:
            messages[3] = {"role": "user", "content": "In one sentence: " + messages[3][
                "content"]}
        messages.append({"role": "user", "content": questions[name][turn - 1]})
        out, stats = stock_turn(stock, pair.served_model_name, messages)
        expected = reference(single, messages, name, http)
        verdict = compare(expected, out)
        assert verdict.acceptable, f"{name} turn {turn}: {verdict.describe()}"
        assert stats["session_source"] == "inferred", stats
        sessions[name].append(stats["session_id"])
        if turn > 1:
            # The history it continues is held: on the decode engine (a short delta), or
            # through the prefill engine, whose prefix cache a fork's parent warmed.
            assert reused(stats) > 0, (name, turn, stats["prompt_tokens"])
        messages.append({"role": "assistant", "content": out.text})

    with httpx.Client(timeout=600) as http, ThreadPoolExecutor(len(conversations)) as pool:
        for turn in range(1, TURNS + 1):
            # Every conversation's turn at once, as the clients of one service send them.
            list(pool.map(play, conversations, [turn] * len(conversations),
                          [http] * len(conversations)))
    stock.close()
    for name, ids in sessions.items():
        if name == "edited":
            before, after = ids[:EDITED_AT - 1], ids[EDITED_AT - 1:]
            assert len(set(before)) == 1 and len(set(after)) == 1 and before[0] != after[0]
        else:
            assert len(set(ids)) == 1, (name, ids)
    every = [set(ids) for ids in sessions.values()]
    assert sum(len(s) for s in every) == len(set.union(*every)) == len(conversations) + 1
    with httpx.Client(timeout=30) as http:
        for name in ("shared-a", "own"):
            view = http.get(f"{pair.router}/v1/turnkv/sessions/{sessions[name][0]}").json()
            assert view["turns"] == TURNS and view["totals"]["reused_tokens"] > 0, view


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


@pytest.mark.parametrize("conversation_id", [None, "CONV_ID_7"], ids=["untagged",
                                                                      "x-session-id"])
def test_vllms_multi_turn_client_runs_on_the_router(
        engines: tuple[ClusterState, ClusterState], conversation_id: str | None) -> None:
    pair, single = engines
    salt = f"benchmark-client-{conversation_id}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"{salt}. {SYSTEM}"}]
    session_ids = set()
    with httpx.Client(timeout=600) as http:
        for turn in range(3):
            messages.append({"role": "user", "content": USER_TURNS[turn]})
            text, headers = benchmark_client_turn(pair.router, pair.served_model_name,
                                                  messages, conversation_id, http)
            expected = reference(single, messages, salt, http)
            # Streamed text, no token IDs to judge a near-tie by: a divergence fails here and
            # shows in the output.
            assert text == expected.text, (turn, text, expected.text)
            session_ids.add(headers["x-turnkv-session"])
            messages.append({"role": "assistant", "content": text})
        assert len(session_ids) == 1
        session = session_ids.pop()
        if conversation_id is not None:
            assert session == conversation_id
        view = http.get(f"{pair.router}/v1/turnkv/sessions/{session}").json()
        assert view["turns"] == 3 and view["totals"]["reused_tokens"] > 0, view
        assert view["last_turn"]["session_source"] == (
            "vllm" if conversation_id else "inferred")
