"""Tagging and recording through each path, retries and plain servers: SDK logic against an
in-process responder (tests/support/fake_openai.py); real servers are in tests/integration."""

from __future__ import annotations

import asyncio
import warnings

import httpx
import openai
import pytest

import turnkv
from tests.support.fake_openai import FakeServer

MESSAGES = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
BASE = "http://fake/v1"


def turnkv_client(server: FakeServer, **kwargs: object) -> turnkv.OpenAI:
    return turnkv.OpenAI(base_url=BASE, api_key="k", **kwargs,  # type: ignore[arg-type]
                         http_client=turnkv.http_client(transport=httpx.MockTransport(server)))


def test_session_chat_and_stream_tag_and_record() -> None:
    server = FakeServer()
    client = turnkv_client(server)
    with client.session("s-1", ttl=60, keep=True) as session:
        first = session.chat(messages=MESSAGES, model="m", max_tokens=2)
        session.hint(next_turn_in=4)
        with session.stream(messages=MESSAGES, model="m") as stream:
            texts = [c.choices[0].delta.content for c in stream]
    assert texts == ["Hel", "lo"] and stream.text == "Hello"
    tags = server.tags()
    assert [t["x-turnkv-turn"] for t in tags] == ["1", "2"]
    assert tags[0]["x-turnkv-ttl"] == "60.0" and "x-turnkv-next-turn-in" not in tags[0]
    assert tags[1]["x-turnkv-next-turn-in"] == "4.0"
    assert tags[0]["x-turnkv-prefix"] == turnkv.prefix_id(model="m", messages=MESSAGES)
    assert first.text == "Hello" and first.response.choices[0].message.content == "Hello"
    second = stream.turn
    assert second is not None and second.response is None and second.text == "Hello"
    assert second.message.content == "Hello"
    assert second.stats.client_ttft_ms is not None and first.stats.client_ttft_ms is None
    assert [t.index for t in session.turns] == [1, 2] and session.turn == 3
    assert session.stats.prompt_tokens_reused == 30 and session.stats.hit_ratio == 0.75


def test_a_retried_turn_keeps_its_index_and_counts_once() -> None:
    server = FakeServer(fail_first=2)
    client = turnkv_client(server)
    session = client.session("s-2", retry=turnkv.RetryPolicy(attempts=3))
    turn = session.chat(messages=MESSAGES, model="m")
    assert [t["x-turnkv-turn"] for t in server.tags()] == ["1", "1", "1"]
    assert turn.stats.retries == 2 and session.stats.turns == 1 and session.stats.retries == 2
    assert session.turn == 2


def test_retries_stop_after_the_policy_and_give_the_index_back() -> None:
    server = FakeServer(fail_first=5)
    session = turnkv_client(server).session("s-3", retry=turnkv.RetryPolicy(attempts=2))
    with pytest.raises(openai.APIStatusError):
        session.chat(messages=MESSAGES, model="m")
    assert len(server.requests) == 2 and session.turn == 1 and session.turns == []


def test_async_sessions_retry_and_record_as_the_sync_ones_do() -> None:
    server = FakeServer(fail_first=2)

    def whole(request: httpx.Request) -> httpx.Response:
        # The fake streams from a sync iterator; an async client needs the body whole.
        answer = server(request)
        headers = {k: v for k, v in answer.headers.items()
                   if k.startswith(("x-turnkv", "content-type", "retry-after"))}
        return httpx.Response(answer.status_code, headers=headers, content=answer.read())

    async def main() -> turnkv.AsyncSession:
        client = turnkv.AsyncOpenAI(
            base_url=BASE, api_key="k",
            http_client=turnkv.async_http_client(transport=httpx.MockTransport(whole)))
        async with client.session("a-1", keep=True) as session:
            first = await session.chat(messages=MESSAGES, model="m")
            assert first.text == "Hello" and first.stats.retries == 2
            with pytest.raises(TypeError):
                await session.chat(messages=MESSAGES, model="m", stream=True)
            stream = await session.stream(messages=MESSAGES, model="m")
            assert [c.choices[0].delta.content async for c in stream] == ["Hel", "lo"]
            assert (await stream.finish()).index == 2
        return session

    session = asyncio.run(main())
    assert [t["x-turnkv-turn"] for t in server.tags()] == ["1", "1", "1", "2"]
    assert [t.index for t in session.turns] == [1, 2] and session.stats.retries == 2
    assert session.turns[1].stats.client_ttft_ms is not None


def test_client_errors_are_not_retried() -> None:
    server = FakeServer(fail_first=1, fail_status=400)
    session = turnkv_client(server).session("s-4")
    with pytest.raises(openai.BadRequestError):
        session.chat(messages=MESSAGES, model="m")
    assert len(server.requests) == 1


@pytest.mark.parametrize("kind", ["turnkv", "stock", "http"])
def test_openai_own_retries_reuse_the_turn_index(kind: str) -> None:
    server = FakeServer(fail_first=1)
    transport = httpx.MockTransport(server)
    with turnkv.session("ctx-retry") as session:
        if kind == "http":
            with turnkv.http_client(transport=transport) as http:
                assert http.post(f"{BASE}/chat/completions",
                                 json={"model": "m", "messages": MESSAGES}).status_code == 503
                http.post(f"{BASE}/chat/completions", json={"model": "m", "messages": MESSAGES})
        else:
            client = (turnkv.OpenAI(base_url=BASE, api_key="k", max_retries=1,
                                    http_client=turnkv.http_client(transport=transport))
                      if kind == "turnkv" else
                      openai.OpenAI(base_url=BASE, api_key="k", max_retries=1,
                                    http_client=httpx.Client(transport=transport)))
            client.chat.completions.create(messages=MESSAGES, model="m")  # type: ignore[arg-type]
        session.keep = True
    assert [t["x-turnkv-turn"] for t in server.tags()] == ["1", "1"]
    assert len(session.turns) == 1 and session.turns[0].index == 1
    if kind != "http":
        assert session.turns[0].stats.retries == 1


def _stock_client(server: FakeServer, library: str) -> openai.OpenAI:
    if library == "httpx2":  # openai 3's own http library
        httpx2 = pytest.importorskip("httpx2")
        server.library = httpx2
        http: object = httpx2.Client(transport=httpx2.MockTransport(server))
    else:
        http = httpx.Client(transport=httpx.MockTransport(server))
    return openai.OpenAI(base_url=BASE, api_key="k", http_client=http)  # type: ignore[arg-type]


@pytest.mark.parametrize("library", ["httpx", "httpx2"])
def test_stock_openai_clients_are_tagged_inside_a_session(library: str) -> None:
    server = FakeServer()
    stock = _stock_client(server, library)
    stock.chat.completions.create(messages=MESSAGES, model="m")  # type: ignore[arg-type]
    with turnkv.session("ctx-1", keep=True) as session:
        stock.chat.completions.create(messages=MESSAGES, model="m")  # type: ignore[arg-type]
        for _ in stock.chat.completions.create(messages=MESSAGES, model="m",  # type: ignore
                                               stream=True):
            pass
    assert server.tags()[0] == {}  # outside the session: untagged
    assert [t["x-turnkv-turn"] for t in server.tags()[1:]] == ["1", "2"]
    assert [t.stats.turn for t in session.turns] == [1, 2]
    assert session.turns[1].text == "Hello" and session.turns[1].stats.client_ttft_ms


def test_concurrent_tasks_keep_their_own_sessions() -> None:
    server = FakeServer()

    async def one(name: str, client: openai.AsyncOpenAI) -> turnkv.Session:
        async with turnkv.session(name, keep=True) as session:
            for _ in range(3):
                await client.chat.completions.create(messages=MESSAGES,  # type: ignore[arg-type]
                                                     model="m")
                await asyncio.sleep(0)
        return session

    async def main() -> list[turnkv.Session]:
        client = openai.AsyncOpenAI(
            base_url=BASE, api_key="k",
            http_client=httpx.AsyncClient(transport=httpx.MockTransport(server)))
        return list(await asyncio.gather(one("a", client), one("b", client)))

    sessions = asyncio.run(main())
    for session in sessions:
        assert [t.stats.session_id for t in session.turns] == [session.id] * 3
        assert [t.index for t in session.turns] == [1, 2, 3]
    by_session = sorted((t["x-turnkv-session"], t["x-turnkv-turn"]) for t in server.tags())
    assert by_session == [(s, str(i)) for s in ("a", "b") for i in (1, 2, 3)]


def test_plain_server_one_warning_per_client_and_usage_stats() -> None:
    server = FakeServer(turnkv=False, cached_tokens=7)
    client = turnkv_client(server)
    with pytest.warns(turnkv.PlainServerWarning) as caught:
        for _ in range(2):
            with client.session() as session:
                turn = session.chat(messages=MESSAGES, model="m")
                session.stream(messages=MESSAGES, model="m").finish()
    assert len([w for w in caught if w.category is turnkv.PlainServerWarning]) == 1
    stats = turn.stats
    assert not stats.served_by_turnkv and stats.mode == "plain"
    assert stats.prompt_tokens.total == 20 and stats.prompt_tokens.prefill_cached == 7
    assert stats.reused_tokens == 7 and stats.computed_tokens == 13
    assert session.hint_now(ttl=5) == {}
    # Nothing was released or hinted on a plain server: only the turns went out.
    assert all(r.method == "POST" for r in server.requests)


def test_ambient_sessions_warn_once_each() -> None:
    server = FakeServer(turnkv=False, cached_tokens=None)
    http = turnkv.http_client(transport=httpx.MockTransport(server))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in ("one", "two"):
            with turnkv.session(name) as session:
                for _ in range(3):
                    http.post(f"{BASE}/chat/completions", json={"model": "m",
                                                                "messages": MESSAGES})
    assert len([w for w in caught if w.category is turnkv.PlainServerWarning]) == 2
    assert session.turns[-1].stats.reused_tokens is None
    assert session.stats.hit_ratio is None


def test_closed_sessions_refuse_turns() -> None:
    session = turnkv.session("done")
    session.close()
    with pytest.raises(turnkv.SessionClosedError):
        session.begin_turn()
    with pytest.raises(turnkv.TurnKVError):
        turnkv.session("unbound").chat(messages=MESSAGES, model="m")


def test_the_openai_patch_is_installed_once() -> None:
    from openai import _base_client as base

    from turnkv import openai_patch

    turnkv.session("patch-check")
    openai_patch.install()
    openai_patch.install()
    for cls in (base.SyncAPIClient, base.AsyncAPIClient):
        for name in ("request", "_process_response"):
            method = cls.__dict__[name]
            assert getattr(method, "__turnkv_patched__", False)
            assert not getattr(method.__wrapped__, "__turnkv_patched__", False)


def test_turnkv_clients_copy_keeps_the_tagging_http_client() -> None:
    server = FakeServer()
    client = turnkv_client(server)
    copy = client.with_options(timeout=5)
    assert isinstance(copy, turnkv.OpenAI)
    with turnkv.session("copied", keep=True) as session:
        copy.chat.completions.create(messages=MESSAGES, model="m")  # type: ignore[arg-type]
    assert session.turns[0].stats.session_id == "copied"
