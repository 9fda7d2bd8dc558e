"""Peers' session dialects (`turnkv_server.router.peer_sessions`): OpenAI's `prompt_cache_key`,
Dynamo's `nvext.session_control` and `nvext.agent_hints`, and the `X-Dynamo-Session-*` headers,
read as the turnkv tag, as test_router_logic.py reads the native one: the mapping, the
precedence of the native tag, the refusals. Then a few turns through the router (under
uvicorn) in front of stand-in engines: tenants stay apart, and engines see none of it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.fuzz_seed import fuzz
from tests.support.local_servers import serving
from tests.unit.test_router_affinity import StandIn
from turnkv.protocol import MAX_TTL_SECONDS, CacheHints, TurnTag
from turnkv_server.router.app import create_app, extract_tag
from turnkv_server.router.config import RouterConfig
from turnkv_server.router.errors import BadRequest
from turnkv_server.router.peer_sessions import PROMPT_CACHE_PREFIX, DialectError

DYNAMO = "X-Dynamo-Session-ID"
FINAL = "X-Dynamo-Session-Final"


def control(session_id: Any = "s", **fields: Any) -> dict[str, Any]:
    return {"nvext": {"session_control": {"session_id": session_id, **fields}}}


# -- each dialect --------------------------------------------------------------------------

def test_the_dynamo_header_names_the_session_and_may_end_it() -> None:
    body: dict[str, Any] = {"model": "m"}
    assert extract_tag(body, {DYNAMO: "research-run-42:researcher"}) == TurnTag(
        session_id="research-run-42:researcher")
    assert body == {"model": "m"}
    assert extract_tag({}, {DYNAMO: "  s  "}) == TurnTag(session_id="s")  # trimmed, as Dynamo
    assert extract_tag({}, {DYNAMO: " "}) is None  # a blank header is no header
    for value, final in (("true", True), ("1", True), ("YES", True), ("false", False),
                         ("0", False), ("", False)):
        tag = extract_tag({}, {DYNAMO: "s", FINAL: value})
        assert tag is not None and tag.hints.final is final, value
    assert extract_tag({}, {FINAL: "true"}) is None  # no session to end


def test_session_control_opens_with_a_timeout_continues_and_closes() -> None:
    body = {"model": "m", **control(action="open", timeout=120)}
    assert extract_tag(body, {}) == TurnTag(session_id="s", hints=CacheHints(ttl=120))
    assert body == {"model": "m"}  # nvext held nothing else: it goes too
    # Dynamo reads the timeout with "open" only (its serde default is sent on every turn).
    assert extract_tag(control(timeout=50), {}) == TurnTag(session_id="s")
    assert extract_tag(control(action="open"), {}) == TurnTag(session_id="s")
    assert extract_tag(control(action=None), {}) == TurnTag(session_id="s")
    closed = extract_tag(control(action="close", timeout=300), {})
    assert closed == TurnTag(session_id="s", hints=CacheHints(final=True))
    # Above turnkv's own bound: capped there (the router's --max-ttl caps it further).
    long = extract_tag(control(action="open", timeout=10**9), {})
    assert long is not None and long.hints.ttl == MAX_TTL_SECONDS
    # Fields Dynamo added later are ignored, as Dynamo's own parser does.
    assert extract_tag(control(action="open", timeout=9, future=1), {}) == TurnTag(
        session_id="s", hints=CacheHints(ttl=9))


def test_agent_hints_give_a_clamped_priority_and_other_extensions_stay() -> None:
    body = {"nvext": {"agent_hints": {"priority": 5, "osl": 1024, "speculative_prefill": True,
                                      "latency_sensitivity": 0.5, "strict_priority": 1},
                      "greed_sampling": True},
            "turnkv": {"session_id": "s"}}
    assert extract_tag(body, {}) == TurnTag(session_id="s", hints=CacheHints(priority=5))
    assert body == {"nvext": {"greed_sampling": True}}  # vLLM ignores the rest of nvext
    for sent, kept in ((99, 10), (-2**31, -10), (0, 0)):
        tag = extract_tag({"nvext": {"agent_hints": {"priority": sent}}}, {DYNAMO: "s"})
        assert tag is not None and tag.hints.priority == kept
    # Dynamo's one-off request: hints without a session are no tag, and go no further.
    one_off = {"nvext": {"agent_hints": {"priority": 5}}}
    assert extract_tag(one_off, {}) is None and one_off == {}


def test_a_prompt_cache_key_is_a_tenant_scoped_prefix_never_a_session() -> None:
    def prefix(key: str, tenant: str = "t") -> str | None:
        tag = extract_tag({"prompt_cache_key": key}, {DYNAMO: "s"}, tenant)
        assert tag is not None and tag.session_id == "s"
        return tag.prefix_id

    first = prefix("user:alice@example.com / ✓")  # any string: OpenAI sets no alphabet
    assert first is not None and first.startswith(PROMPT_CACHE_PREFIX)
    assert prefix("user:alice@example.com / ✓") == first  # the same key, the same prefix
    assert prefix("user:bob") != first
    assert prefix("user:alice@example.com / ✓", tenant="other") != first
    # Alone it opens no session: many conversations share one key.
    body = {"model": "m", "prompt_cache_key": "shared-system-prompt"}
    assert extract_tag(body, {}) is None and body == {"model": "m"}
    assert extract_tag({"prompt_cache_key": ""}, {DYNAMO: "s"}) == TurnTag(session_id="s")


# -- precedence ----------------------------------------------------------------------------

def test_the_turnkv_tag_wins_field_by_field() -> None:
    body = {"turnkv": {"session_id": "native", "prefix_id": "sys", "hints": {"priority": 1}},
            "prompt_cache_key": "k", **control("s", action="open", timeout=60)}
    body["nvext"]["agent_hints"] = {"priority": 7}
    tag = extract_tag(body, {DYNAMO: "h", FINAL: "true"})
    # A dialect's lifecycle acts only on the session its own field named: not on "native".
    assert tag == TurnTag(session_id="native", prefix_id="sys", hints=CacheHints(priority=1))
    assert body == {}
    # Native headers too; a dialect may name the session that native hints go with.
    tag = extract_tag({"prompt_cache_key": "k", "nvext": {"agent_hints": {"priority": 7}}},
                      {"X-TurnKV-TTL": "30", "X-TurnKV-Priority": "2", DYNAMO: "h"})
    assert tag is not None and tag.session_id == "h" and tag.prefix_id.startswith("pck-")
    assert tag.hints == CacheHints(ttl=30, priority=2)
    # The same session named both ways: the dialect's lifecycle fills what the tag leaves.
    tag = extract_tag(control("s", action="close"), {"X-TurnKV-Session": "s"})
    assert tag == TurnTag(session_id="s", hints=CacheHints(final=True))
    tag = extract_tag({"turnkv": {"session_id": "s", "hints": {"final": False}}},
                      {DYNAMO: "s", FINAL: "true"})
    assert tag is not None and tag.hints.final is False


def test_session_control_wins_over_the_dynamo_header() -> None:
    tag = extract_tag(control("body", action="open", timeout=60), {DYNAMO: "header"})
    assert tag == TurnTag(session_id="body", hints=CacheHints(ttl=60))
    # The final header ends the header's session, not another one.
    tag = extract_tag(control("body"), {DYNAMO: "header", FINAL: "true"})
    assert tag == TurnTag(session_id="body")
    tag = extract_tag(control("body"), {FINAL: "true"})  # no header ID: the Dynamo session
    assert tag == TurnTag(session_id="body", hints=CacheHints(final=True))


# -- refusals ------------------------------------------------------------------------------

@pytest.mark.parametrize("body, headers, where", [
    ({"nvext": 5}, {}, "nvext"),
    ({"nvext": {"session_control": "s"}}, {}, "nvext.session_control"),
    ({"nvext": {"session_control": {}}}, {}, "nvext.session_control.session_id"),
    (control("a b"), {}, "nvext.session_control.session_id"),
    (control("x" * 200), {}, "nvext.session_control.session_id"),
    (control(7), {}, "nvext.session_control.session_id"),
    (control(action="reopen"), {}, "nvext.session_control.action"),
    (control(action="open", timeout=-1), {}, "nvext.session_control.timeout"),
    (control(action="open", timeout="60"), {}, "nvext.session_control.timeout"),
    (control(timeout=1.5), {}, "nvext.session_control.timeout"),
    (control(timeout=True), {}, "nvext.session_control.timeout"),
    (control(action="open", timeout=0), {}, "nvext.session_control.timeout"),
    ({"nvext": {"agent_hints": []}}, {}, "nvext.agent_hints"),
    ({"nvext": {"agent_hints": {"priority": "5"}}}, {}, "nvext.agent_hints.priority"),
    ({"nvext": {"agent_hints": {"priority": 2.5}}}, {}, "nvext.agent_hints.priority"),
    ({"nvext": {"agent_hints": {"priority": True}}}, {}, "nvext.agent_hints.priority"),
    ({"nvext": {"agent_hints": {"osl": -1}}}, {}, "nvext.agent_hints.osl"),
    ({"nvext": {"agent_hints": {"speculative_prefill": "yes"}}}, {},
     "nvext.agent_hints.speculative_prefill"),
    ({"nvext": {"agent_hints": {"latency_sensitivity": "high"}}}, {},
     "nvext.agent_hints.latency_sensitivity"),
    ({"prompt_cache_key": 42}, {}, "prompt_cache_key"),
    ({}, {DYNAMO: "bad id"}, DYNAMO),
    ({}, {DYNAMO: "\u202eevil"}, DYNAMO),
    ({}, {DYNAMO: "s", FINAL: "maybe"}, FINAL),
])
def test_bad_dialect_fields_are_refused_with_the_field_named(
        body: dict[str, Any], headers: dict[str, str], where: str) -> None:
    with pytest.raises(DialectError) as info:
        extract_tag(body, headers)
    assert info.value.param == where and info.value.status == 400
    assert info.value.message.startswith(f"invalid {where}: ")


DIALECT_VALUES = st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(
    allow_nan=False, allow_infinity=False) | st.text(max_size=12) | st.lists(st.integers(),
                                                                          max_size=2)


def mostly(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`valid`, or one time in five anything: most draws then get past every field."""
    return st.integers(0, 4).flatmap(lambda i: DIALECT_VALUES if i == 0 else valid)


@fuzz(300)
@given(sc=mostly(st.none() | st.fixed_dictionaries({}, optional={
           "session_id": mostly(st.sampled_from(["s", "n"])),
           "action": mostly(st.sampled_from(["open", "close", None])),
           "timeout": mostly(st.integers(0, 10**6)), "x": DIALECT_VALUES})),
       hints=mostly(st.none() | st.fixed_dictionaries({}, optional={
           "priority": mostly(st.integers(-100, 100)), "osl": mostly(st.integers(0, 4096)),
           "speculative_prefill": mostly(st.booleans()),
           "latency_sensitivity": mostly(st.floats(0, 1))})),
       key=mostly(st.none() | st.text(max_size=12)),
       header=st.none() | st.sampled_from(["s", "n", " s "]) | st.text(max_size=12),
       final=st.none() | st.sampled_from(["true", "false"]) | st.text(max_size=6),
       native=st.none() | st.just({"session_id": "n"}))
def test_any_dialect_input_is_read_or_refused_and_never_reaches_the_engines(
        sc: Any, hints: Any, key: Any, header: str | None, final: str | None,
        native: dict[str, Any] | None) -> None:
    body: dict[str, Any] = {"nvext": {"session_control": sc, "agent_hints": hints,
                                      "greed_sampling": True}, "prompt_cache_key": key}
    if native is not None:
        body["turnkv"] = native
    headers = {k: v for k, v in ((DYNAMO, header), (FINAL, final)) if v is not None}
    try:
        tag = extract_tag(body, headers)
    except (DialectError, BadRequest) as exc:
        assert exc.status == 400 and exc.param
        return
    assert body == {"nvext": {"greed_sampling": True}}
    if native is not None:
        assert tag is not None and tag.session_id == "n"


# -- through the router ----------------------------------------------------------------------

KEYS = {"sk-a": "tenant-a", "sk-b": "tenant-b"}


@contextlib.asynccontextmanager
async def router_with_tenants(engines: list[StandIn], **settings: Any) -> AsyncIterator[str]:
    for engine in engines:
        await engine.start()
    # Tenant A may ask for priorities up to 5 (by default no tenant above 0).
    app = create_app(RouterConfig(mode="affinity", engine=[e.url for e in engines],
                                  api_keys=KEYS, health_interval=60.0,
                                  tenant_caps={KEYS["sk-a"]: {"max_priority": 5}},
                                  **settings))
    try:
        async with serving(app) as url:
            yield url
    finally:
        for engine in engines:
            await engine.stop()


def test_dialect_sessions_are_the_tenants_own_and_engines_never_see_them() -> None:
    async def main() -> None:
        engines = [StandIn(), StandIn()]
        async with router_with_tenants(engines) as url, \
                httpx.AsyncClient(timeout=30) as client:
            def auth(key: str, **headers: str) -> dict[str, str]:
                return {"Authorization": f"Bearer {key}", **headers}

            async def chat(key: str, headers: dict[str, str] | None = None,
                           **extra: Any) -> httpx.Response:
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 2, **extra}
                return await client.post(f"{url}/v1/chat/completions", json=body,
                                         headers=auth(key, **(headers or {})))

            sessions = f"{url}/v1/turnkv/sessions"
            first = await chat("sk-a", prompt_cache_key="team-prompt", nvext={
                "session_control": {"session_id": "agent-1", "action": "open", "timeout": 60},
                "agent_hints": {"priority": 3, "osl": 16}})
            assert first.status_code == 200, first.text
            assert first.json()["turnkv"]["session_id"] == "agent-1"
            for turn in (2, 3):
                reply = await chat("sk-a", {DYNAMO: "agent-1"}, prompt_cache_key="team-prompt")
                assert reply.json()["turnkv"]["turn"] == turn
            view = (await client.get(f"{sessions}/agent-1", headers=auth("sk-a"))).json()
            assert view["turns"] == 3 and view["priority"] == 3
            assert view["prefix_id"].startswith(PROMPT_CACHE_PREFIX)
            # Tenant B: A's session is not there, and the same ID opens B's own.
            assert (await client.get(f"{sessions}/agent-1", headers=auth("sk-b"))
                    ).status_code == 404
            other = await chat("sk-b", {DYNAMO: "agent-1"}, prompt_cache_key="team-prompt")
            assert other.json()["turnkv"]["turn"] == 1
            b_view = (await client.get(f"{sessions}/agent-1", headers=auth("sk-b"))).json()
            assert b_view["prefix_id"] != view["prefix_id"]
            # A bad dialect field: an OpenAI-shaped 400 naming it.
            bad = await chat("sk-a", nvext={"session_control": {"session_id": "agent-1",
                                                                 "action": "reopen"}})
            assert bad.status_code == 400
            assert bad.json()["error"]["param"] == "nvext.session_control.action"
            assert bad.json()["error"]["type"] == "invalid_request_error"
            # Close, as Dynamo's last turn does: the turn is served, then the session ends.
            closed = await chat("sk-a", nvext={"session_control": {"session_id": "agent-1",
                                                                    "action": "close"}})
            assert closed.json()["turnkv"]["turn"] == 4
            assert (await client.get(f"{sessions}/agent-1", headers=auth("sk-a"))
                    ).status_code == 404
            assert (await client.get(f"{sessions}/agent-1", headers=auth("sk-b"))
                    ).status_code == 200
            seen = [body for engine in engines for body in engine.seen]
            assert len(seen) == 5
            for body in seen:
                assert "nvext" not in body and "prompt_cache_key" not in body
                # Only the router's hash of the session, and no key.
                assert b"agent-1" not in orjson.dumps(body)
                assert b"team-prompt" not in orjson.dumps(body)

    asyncio.run(main())


def test_turns_without_a_session_go_where_their_prompt_cache_key_is_warm() -> None:
    """OpenAI clients send `prompt_cache_key` and no session: each such turn goes to the
    engine its key's prefix warmed first; turns without a key keep the round robin. (With
    sessions inferred from the content, each chat turn here would open a session: the router
    that infers none shows the sessionless placement, which completions keep.)"""
    async def main() -> None:
        engines = [StandIn(), StandIn()]
        async with router_with_tenants(engines, no_inferred_sessions=True) as url, \
                httpx.AsyncClient(timeout=30) as client:
            async def chat(key: str, **extra: Any) -> httpx.Response:
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 2, **extra}
                return await client.post(f"{url}/v1/chat/completions", json=body,
                                         headers={"Authorization": f"Bearer {key}"})

            def counts() -> list[int]:
                return [len(e.seen) for e in engines]

            first = await chat("sk-a", prompt_cache_key="support-bot")
            assert first.status_code == 200 and first.json()["turnkv"]["session_id"] is None
            warm = counts().index(1)
            for _ in range(4):
                await chat("sk-a", prompt_cache_key="support-bot")
            assert counts()[warm] == 5, counts()
            assert all("prompt_cache_key" not in body for e in engines for body in e.seen)
            # No key: the round robin, both engines.
            before = counts()
            for _ in range(2):
                await chat("sk-a")
            assert [a - b for a, b in zip(counts(), before, strict=True)] == [1, 1]
    asyncio.run(main())
