"""The SDK against a real router (bidirectional mode, tiny model) and a plain vLLM engine.

Every turn's stats, as the SDK recorded them, must equal the router's own record of that turn
(`GET /v1/turnkv/sessions/{id}` -> `last_turn`), and from turn 2 a session reuses its KV.
"""

from __future__ import annotations

import asyncio
import json
import uuid
import warnings
from typing import Any

import httpx
import openai
import pytest

import turnkv
from tests.support.conversation import SYSTEM, USER_TURNS
from turnkv_server.launcher import ClusterState

MAX_TOKENS = 6


def sampling() -> dict[str, Any]:
    """Greedy, short, and a cache salt of its own: the prefill engine's prefix cache then
    holds nothing of the conversation from other tests, so reuse can only come from the
    session's own turns."""
    return {"max_tokens": MAX_TOKENS, "temperature": 0,
            "extra_body": {"cache_salt": uuid.uuid4().hex}}


def conversation(replies: list[str]) -> list[dict[str, Any]]:
    """The messages of the next turn, given the replies so far."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for turn, reply in enumerate(replies):
        messages += [{"role": "user", "content": USER_TURNS[turn]},
                     {"role": "assistant", "content": reply}]
    messages.append({"role": "user", "content": USER_TURNS[len(replies)]})
    return messages


def router_record(state: ClusterState, session_id: str) -> httpx.Response:
    return httpx.get(f"{state.router}/v1/turnkv/sessions/{session_id}", timeout=30)


def check_turn(state: ClusterState, session_id: str, turn: turnkv.Turn, index: int) -> None:
    """The SDK's stats of a turn equal the router's record of it; reuse from turn 2."""
    stats = turn.stats
    print(f"{session_id} turn {index}: prompt {stats.prompt_tokens.total}, reused "
          f"{stats.reused_tokens}, computed {stats.computed_tokens}, client TTFT "
          f"{stats.client_ttft_ms}, retries {stats.retries}")
    assert stats.served_by_turnkv and stats.mode == "bidirectional"
    assert (stats.session_id, stats.turn, turn.index) == (session_id, index, index)
    record = router_record(state, session_id).json()
    assert record["turns"] == index
    assert record["last_turn"] == stats.wire().model_dump()
    tokens = stats.prompt_tokens
    assert tokens.total > 0 and stats.completion_tokens > 0
    assert stats.client_total_ms is not None and stats.client_total_ms > 0
    if index == 1:
        assert tokens.prefill_reused == 0, tokens
    else:
        assert tokens.prefill_reused is not None and tokens.prefill_reused > 0, tokens


def check_totals(state: ClusterState, session: turnkv.Session | turnkv.AsyncSession) -> None:
    totals = router_record(state, session.id).json()["totals"]
    mine = session.stats
    assert mine.turns == totals["turns"] == len(session.turns)
    assert mine.prompt_tokens_total == totals["prompt_tokens"]
    assert mine.prompt_tokens_computed == totals["prefill_computed"]
    assert mine.prompt_tokens_reused == totals["reused_tokens"] > 0
    assert mine.completion_tokens == totals["completion_tokens"]
    assert mine.hit_ratio is not None and 0 < mine.hit_ratio < 1
    assert mine.estimated_prefill_s_saved is not None and mine.estimated_prefill_s_saved > 0


def test_sync_session_chat_stream_hints_and_release(router_cluster: ClusterState) -> None:
    state = router_cluster
    client = turnkv.OpenAI(base_url=f"{state.router}/v1", api_key="unused")
    model = state.served_model_name
    replies: list[str] = []
    options = sampling()
    with client.session(ttl=120) as session:
        first = session.chat(messages=conversation(replies), model=model, **options)
        check_turn(state, session.id, first, 1)
        assert first.response is not None and first.text == first.message.content
        replies.append(first.text)

        session.hint(next_turn_in=30, priority=2)
        with session.stream(messages=conversation(replies), model=model, **options) as stream:
            chunks = list(stream)
        second = stream.turn
        assert second is not None and second.response is None and chunks
        check_turn(state, session.id, second, 2)
        assert second.text == stream.text
        assert second.stats.client_ttft_ms is not None
        assert stream.early_headers["x-turnkv-turn"] == "2"
        assert router_record(state, session.id).json()["priority"] == 2
        replies.append(second.text)

        third = session.chat(messages=conversation(replies), model=model, **options)
        check_turn(state, session.id, third, 3)
        check_totals(state, session)
        assert session.prefix_id == turnkv.prefix_id(model=model, messages=conversation([]))

        view = session.hint_now(ttl=5)
        assert 0 < view["expires_in_s"] <= 5
    # Released on exit.
    assert router_record(state, session.id).status_code == 404
    # Hints for a session the router no longer holds: a typed error in the router's words.
    with pytest.raises(turnkv.SessionNotFoundError, match="^no live session .*lease expired"):
        client.session(session.id).hint_now(ttl=5)


def test_async_session_chat_stream_and_keep(router_cluster: ClusterState) -> None:
    state = router_cluster

    async def play() -> turnkv.AsyncSession:
        client = turnkv.AsyncOpenAI(base_url=f"{state.router}/v1", api_key="unused")
        replies: list[str] = []
        options = sampling()
        async with client.session(keep=True) as session:
            first = await session.chat(messages=conversation(replies),
                                       model=state.served_model_name, **options)
            check_turn(state, session.id, first, 1)
            replies.append(first.text)
            stream = await session.stream(messages=conversation(replies),
                                          model=state.served_model_name, **options)
            second = await stream.finish()
            check_turn(state, session.id, second, 2)
            assert second.stats.client_ttft_ms is not None
            check_totals(state, session)
        await client.close()
        return session

    session = asyncio.run(play())
    # keep=True: still held by the router after the block.
    assert router_record(state, session.id).json()["turns"] == 2
    assert asyncio.run(session.release()) is True
    assert router_record(state, session.id).status_code == 404


def _send_turn(kind: str, state: ClusterState, messages: list[dict[str, Any]], stream: bool,
               options: dict[str, Any]) -> None:
    """One turn sent by plain code that knows nothing of sessions."""
    base = f"{state.router}/v1"
    body: dict[str, Any] = {"model": state.served_model_name, "messages": messages,
                            **options}
    if kind in ("turnkv-client", "stock-openai"):
        client = (turnkv.OpenAI if kind == "turnkv-client" else openai.OpenAI)(
            base_url=base, api_key="unused")
        if stream:
            for _ in client.chat.completions.create(**body, stream=True):
                pass
        else:
            client.chat.completions.create(**body)
        client.close()
    elif kind == "stock-async-openai":
        async def send() -> None:
            client = openai.AsyncOpenAI(base_url=base, api_key="unused")
            if stream:
                async for _ in await client.chat.completions.create(**body, stream=True):
                    pass
            else:
                await client.chat.completions.create(**body)
            await client.close()
        asyncio.run(send())
    else:
        body.update(body.pop("extra_body"))  # what openai's extra_body does
        with turnkv.http_client(timeout=120) as http:
            if stream:
                with http.stream("POST", f"{base}/chat/completions",
                                 json={**body, "stream": True}) as response:
                    for _ in response.iter_lines():
                        pass
            else:
                http.post(f"{base}/chat/completions", json=body).raise_for_status()


@pytest.mark.parametrize("kind", ["turnkv-client", "stock-openai", "stock-async-openai",
                                  "http-client"])
def test_context_tagging(router_cluster: ClusterState, kind: str) -> None:
    state = router_cluster
    replies: list[str] = []
    options = sampling()
    with turnkv.session() as session:
        for index, stream in ((1, False), (2, True)):
            _send_turn(kind, state, conversation(replies), stream, options)
            turn = session.turns[-1]
            check_turn(state, session.id, turn, index)
            assert turn.text
            assert (turn.response is None) == stream
            replies.append(turn.text)
        assert session.base_url == f"{state.router}/v1"
    assert router_record(state, session.id).status_code == 404


def test_plain_vllm_server_one_warning_and_usage_stats(plain_engine: ClusterState) -> None:
    state = plain_engine
    # mode="single": `router` is the engine itself, plain vLLM.
    assert state.router_process is None
    client = turnkv.OpenAI(base_url=f"{state.router}/v1", api_key="unused")
    replies: list[str] = []
    options = sampling()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with client.session() as session:
            for index in (1, 2, 3):
                if index == 2:
                    turn = session.stream(messages=conversation(replies),
                                          model=state.served_model_name,
                                          **options).finish()
                else:
                    turn = session.chat(messages=conversation(replies),
                                        model=state.served_model_name, **options)
                stats = turn.stats
                assert not stats.served_by_turnkv and stats.mode == "plain"
                assert stats.turn == index and stats.completion_tokens > 0
                if turn.response is not None:
                    usage = turn.response.usage
                    assert stats.prompt_tokens.total == usage.prompt_tokens
                    details = usage.prompt_tokens_details
                    assert stats.prompt_tokens.prefill_cached == details.cached_tokens
                else:
                    assert stats.prompt_tokens.total > 0
                replies.append(turn.text)
            # Nothing to tell a plain server: no request, no error.
            assert session.hint_now(next_turn_in=5) == {}
    plain = [w for w in caught if issubclass(w.category, turnkv.PlainServerWarning)]
    assert len(plain) == 1, [str(w.message) for w in caught]
    assert session.stats.turns == 3 and session.stats.turns_served_by_turnkv == 0
    # Nothing to release on a plain server, and no error logged for it.
    assert not session.released


def test_router_rejects_what_the_sdk_would_have_caught(router_cluster: ClusterState) -> None:
    """The SDK and the router share the validation: the router's 400 names the same field
    the SDK's InvalidTagError names."""
    state = router_cluster
    with pytest.raises(turnkv.InvalidTagError) as sdk_error:
        turnkv.session(ttl=0)
    response = httpx.post(f"{state.router}/v1/chat/completions", timeout=30, json={
        "model": state.served_model_name, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1, "turnkv": {"session_id": "x", "hints": {"ttl": 0}}})
    assert response.status_code == 400
    assert json.loads(response.text)["error"]["message"] == str(sdk_error.value)
