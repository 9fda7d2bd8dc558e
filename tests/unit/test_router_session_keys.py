"""Session keys in one order (`turnkv_server.router.app.read_keys`, docs/protocol.md "Session
keys"): turnkv's tag, Dynamo's, vLLM's `session_id`/`X-Session-ID` (and the multi-turn
client's `conversation_id`), the Responses lineage, Claude Code's and Codex's headers, Codex's
`prompt_cache_key`; `prompt_cache_retention`. Then through the router in front of stand-in
engines: what the engines see, tenants kept apart, and the stats naming the key.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import httpx
import orjson
import pytest

from tests.unit.test_router_affinity import StandIn
from tests.unit.test_router_dialects import router_with_tenants
from turnkv.protocol import MAX_TTL_SECONDS, CacheHints, TurnTag
from turnkv_server.router.app import read_keys
from turnkv_server.router.peer_sessions import (
    FOREIGN_PREFIX,
    PROMPT_CACHE_PREFIX,
    DialectError,
    foreign_id,
)

CODEX = {"originator": "codex_cli_rs"}


def keys(body: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
         lineage: str | None = None, tenant: str = "t") -> tuple[str | None, str | None]:
    """The session a request names and which key named it."""
    found = read_keys(copy.deepcopy(body or {}), headers or {}, tenant, lineage=lineage)
    return (found.tag.session_id if found.tag else None), found.source


def test_each_key_names_the_session_in_the_documented_order() -> None:
    everything = ({"turnkv": {"session_id": "tag"},
                   "nvext": {"session_control": {"session_id": "dynamo"}},
                   "session_id": "vllm-body", "conversation_id": "conv",
                   "vllm_xargs": {"session_id": "xargs"}, "prompt_cache_key": "codex-key"},
                  {"X-Session-ID": "vllm-header", "x-claude-code-session-id": "claude",
                   "session_id": "codex", **CODEX})
    body, headers = everything
    order = [("tag", "tag"), ("dynamo", "dynamo"), ("vllm-body", "vllm"),
             ("vllm-header", "vllm"), ("xargs", "vllm"), ("conv", "vllm"),
             ("lineage", "lineage"), ("claude", "agent"), ("codex", "agent"),
             ("codex-key", "prompt_cache_key")]
    # Take the keys away one by one, first first: each time the next one names the session.
    removals: list[tuple[str, str]] = [
        ("body", "turnkv"), ("body", "nvext"), ("body", "session_id"),
        ("headers", "X-Session-ID"), ("body", "vllm_xargs"), ("body", "conversation_id"),
        ("lineage", ""), ("headers", "x-claude-code-session-id"), ("headers", "session_id")]
    lineage: str | None = "lineage"
    for (expected, source), removal in zip(order, [*removals, None], strict=True):
        assert keys(body, headers, lineage) == (expected, source), removal
        if removal is None:
            break
        where, name = removal
        if where == "lineage":
            lineage = None
        else:
            (body if where == "body" else headers).pop(name)
    assert keys({"prompt_cache_key": "k"}, CODEX) == ("k", "prompt_cache_key")
    assert keys({}, {"session-id": "later-codex"}) == ("later-codex", "agent")
    assert keys({}, {}) == (None, None)


# Each peer's field as a request's only one (beside turnkv's own tag, for those that name no
# session), and what it makes of the request's keys.
ALONE: list[tuple[dict[str, Any], dict[str, str], tuple[str | None, str | None]]] = [
    ({"session_id": "b"}, {}, ("b", "vllm")),
    ({}, {"X-Session-ID": "h"}, ("h", "vllm")),
    ({"vllm_xargs": {"session_id": "x"}}, {}, ("x", "vllm")),
    ({"conversation_id": "c"}, {}, ("c", "vllm")),
    ({}, {"x-claude-code-session-id": "cc"}, ("cc", "agent")),
    ({}, {"session_id": "cx"}, ("cx", "agent")),
    ({}, {"Session-Id": "cx2"}, ("cx2", "agent")),
    ({"nvext": {"session_control": {"session_id": "d"}}}, {}, ("d", "dynamo")),
    ({}, {"X-Dynamo-Session-ID": "dh"}, ("dh", "dynamo")),
    ({"prompt_cache_key": "k"}, CODEX, ("k", "prompt_cache_key")),
]


@pytest.mark.parametrize(("body", "headers", "named"), ALONE)
def test_each_peer_key_alone_is_read(body: dict[str, Any], headers: dict[str, str],
                                     named: tuple[str | None, str | None]) -> None:
    """Peers' fields are read only where a request carries one: each is one of them."""
    assert keys(body, headers) == named


def test_each_peer_hint_alone_is_read() -> None:
    tag = {"turnkv": {"session_id": "s"}}
    found = read_keys({**tag, "prompt_cache_retention": "24h"}, {}, "t")
    assert found.tag is not None and found.tag.hints.ttl == MAX_TTL_SECONDS
    found = read_keys({**tag, "nvext": {"agent_hints": {"priority": 3}}}, {}, "t")
    assert found.tag is not None and found.tag.hints.priority == 3
    found = read_keys(dict(tag), {"X-Dynamo-Session-ID": "s", "X-Dynamo-Session-Final": "1"},
                      "t")
    assert found.tag is not None and found.tag.hints.final
    sessionless = read_keys({"prompt_cache_key": "k"}, {}, "t")
    assert sessionless.tag is None and sessionless.prefix_id is not None


def test_every_key_leaves_the_body_and_other_fields_stay() -> None:
    body = {"model": "m", "session_id": "a", "conversation_id": "b",
            "vllm_xargs": {"session_id": "c", "priority_boost": 1},
            "prompt_cache_key": "k", "prompt_cache_retention": "24h"}
    read_keys(body, {}, "t")
    assert body == {"model": "m", "vllm_xargs": {"priority_boost": 1}}
    only_session = {"vllm_xargs": {"session_id": "c"}}
    read_keys(only_session, {}, "t")
    assert only_session == {}


def test_a_prompt_cache_key_names_a_session_only_for_codex() -> None:
    """Codex sends its conversation ID as the key; other clients share a key across
    conversations (per user, per template): there it only places the turn."""
    for headers in (CODEX, {"user-agent": "codex_cli_rs/0.63.0 (Mac OS 15.1.0; arm64)"},
                    {"originator": "codex-tui"}):
        found = read_keys({"prompt_cache_key": "019a9544-7ab1"}, headers, "t")
        assert found.tag is not None and found.tag.session_id == "019a9544-7ab1", headers
        assert found.source == "prompt_cache_key"
        assert found.tag.prefix_id is not None
        assert found.tag.prefix_id.startswith(PROMPT_CACHE_PREFIX)
    other = read_keys({"prompt_cache_key": "support-bot"}, {"user-agent": "OpenAI/Python"}, "t")
    assert other.tag is None and other.source is None
    assert other.prefix_id is not None and other.prefix_id.startswith(PROMPT_CACHE_PREFIX)


def test_foreign_ids_outside_turnkvs_alphabet_are_named_by_their_hash() -> None:
    odd = "conversation #7 / ünïcode"
    named = foreign_id(odd)
    assert named.startswith(FOREIGN_PREFIX) and named == foreign_id(odd)
    assert named != foreign_id(odd + " ")
    assert keys({"session_id": odd}) == (named, "vllm")
    assert keys({}, {"X-Session-ID": "  CONV_ID_0  "}) == ("CONV_ID_0", "vllm")  # trimmed
    assert keys({"session_id": ""}, {"X-Session-ID": " "}) == (None, None)  # empty: none
    with pytest.raises(DialectError) as info:
        read_keys({"session_id": 7}, {}, "t")
    assert info.value.param == "session_id"
    with pytest.raises(DialectError) as info:
        read_keys({"vllm_xargs": {"session_id": ["x"]}}, {}, "t")
    assert info.value.param == "vllm_xargs.session_id"


def test_the_tags_hints_go_with_the_session_a_peer_named() -> None:
    found = read_keys({}, {"X-Session-ID": "s", "X-TurnKV-TTL": "30"}, "t")
    assert found.tag == TurnTag(session_id="s", hints=CacheHints(ttl=30))
    assert found.source == "vllm" and found.native


def test_prompt_cache_retention_is_a_lease() -> None:
    day = read_keys({"prompt_cache_retention": "24h"}, {"X-Session-ID": "s"}, "t")
    assert day.tag is not None and day.tag.hints.ttl == MAX_TTL_SECONDS
    own = read_keys({"prompt_cache_retention": "24h", "turnkv": {
        "session_id": "s", "hints": {"ttl": 60}}}, {}, "t")
    assert own.tag is not None and own.tag.hints.ttl == 60  # the tag's own wins
    default = read_keys({"prompt_cache_retention": "in_memory"}, {"X-Session-ID": "s"}, "t")
    assert default.tag == TurnTag(session_id="s")
    unnamed = read_keys({"prompt_cache_retention": "24h"}, {}, "t")
    assert unnamed.tag is None and unnamed.retention_ttl == MAX_TTL_SECONDS
    with pytest.raises(DialectError) as info:
        read_keys({"prompt_cache_retention": "forever"}, {}, "t")
    assert info.value.param == "prompt_cache_retention"


# -- through the router ----------------------------------------------------------------------


def test_peer_sessions_are_the_tenants_own_and_engines_never_see_them() -> None:
    async def main() -> None:
        engines = [StandIn(), StandIn()]
        async with router_with_tenants(engines) as url, \
                httpx.AsyncClient(timeout=30) as client:
            async def chat(key: str, headers: dict[str, str], **extra: Any) -> dict[str, Any]:
                reply = await client.post(f"{url}/v1/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2, **extra},
                    headers={"Authorization": f"Bearer {key}", **headers})
                assert reply.status_code == 200, reply.text
                return dict(reply.json()["turnkv"])

            for turn in (1, 2):
                stats = await chat("sk-a", {"X-Session-ID": "conv-1"},
                                   conversation_id="conv-1")
                assert (stats["session_id"], stats["session_source"], stats["turn"]) == (
                    "conv-1", "vllm", turn)
            claude = await chat("sk-a", {"x-claude-code-session-id": "claude-9"})
            assert (claude["session_id"], claude["session_source"]) == ("claude-9", "agent")
            codex = await chat("sk-a", {"session_id": "codex-3", **CODEX},
                               prompt_cache_key="codex-3")
            assert (codex["session_id"], codex["session_source"]) == ("codex-3", "agent")
            # Another tenant's same ID: its own session, from its first turn.
            other = await chat("sk-b", {"X-Session-ID": "conv-1"})
            assert (other["session_id"], other["turn"]) == ("conv-1", 1)
            seen = [body for engine in engines for body in engine.seen]
            assert len(seen) == 5
            for body in seen:
                assert not {"session_id", "conversation_id", "prompt_cache_key"} & body.keys()
                sent = orjson.dumps(body)
                assert b"conv-1" not in sent and b"claude-9" not in sent
    asyncio.run(main())


def test_the_sdk_reads_stats_with_any_session_source_or_none() -> None:
    """Backward compatible both ways: stats of a router before `session_source` parse (None),
    and so do a later router's that names a source this SDK does not know."""
    from turnkv.protocol import RouterTurnStats as WireStats
    from turnkv.stats import TurnStats

    earlier = {"session_id": "s", "turn": 1, "mode": "turnkv"}
    assert TurnStats.from_wire(earlier).session_source is None
    assert TurnStats.from_wire({**earlier, "session_source": "a-later-key"}
                               ).session_source == "a-later-key"
    # An SDK before the field ignores it: the wire model drops fields it does not know.
    assert WireStats.model_config.get("extra", "ignore") == "ignore"
