"""The Responses and Messages APIs through the router's pipeline, in front of stand-in engines
that answer in vLLM 0.32's shapes (recorded from its `/v1/responses` and `/v1/messages`):
what the engines are sent (stateless, one-token prefills, token IDs asked for), what the client
gets back (its own echo, corrected usage, the turn's stats, no router fields), the Responses
state (`previous_response_id`, `store`, GET and DELETE), and each API's error shape."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web
from fastapi.testclient import TestClient

from tests.unit.test_router_engine_requests import Handler, StandIn, cluster, settle
from turnkv_server.router.app import create_app
from turnkv_server.router.config import RouterConfig
from turnkv_server.router.sessions import SessionKey

# The stand-ins' prompt: its token IDs, of which the prefill engine had this many cached.
PROMPT = [1, 2484, 201, 42, 533, 337]
CACHED = 4
OUTPUT = [1670, 644, 3642]
TRANSFER = {"turnkv": {"local_tokens": 2}}  # what an engine's connector would reply


def ok(payload: dict[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


async def sse(request: web.Request, events: list[tuple[str, dict[str, Any]]]
              ) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for name, data in events:
        await response.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
    await response.write_eof()
    return response


def response_object(body: dict[str, Any], text: str, usage: dict[str, Any] | None,
                    status: str = "completed") -> dict[str, Any]:
    """vLLM's response object for `body` (as its route echoes the request)."""
    messages = body.get("enable_response_messages")
    return {
        "id": body.get("request_id", "resp_engine"), "object": "response", "model": "m",
        "instructions": body.get("instructions"), "status": status,
        "previous_response_id": body.get("previous_response_id"),
        "output": [] if usage is None else [{
            "id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": None}]}],
        "usage": usage, "kv_transfer_params": TRANSFER if usage is not None else None,
        "input_messages": [{"message": "<prompt>", "tokens": PROMPT,
                            "type": "raw_message_tokens"}] if messages and usage else None,
        "output_messages": [{"message": text, "tokens": OUTPUT[:1] if body.get(
            "max_output_tokens") == 1 else OUTPUT, "type": "raw_message_tokens"}]
        if messages and usage else None,
    }


def responses_usage(cached: int, output: int) -> dict[str, Any]:
    return {"input_tokens": len(PROMPT), "output_tokens": output, "total_tokens": 9,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


async def responses_engine(engine: StandIn, request: web.Request, body: dict[str, Any]
                           ) -> web.StreamResponse:
    """The prefill engine (its own prefix hit: CACHED) or the decode engine (vLLM counts what
    it received as cached: nearly the whole prompt), whole or streamed."""
    if body.get("max_output_tokens") == 1:
        return ok(response_object(body, "x", responses_usage(CACHED, 1)))
    whole = response_object(body, "a b c", responses_usage(len(PROMPT) - 1, len(OUTPUT)))
    if not body.get("stream"):
        return ok(whole)
    start = response_object(body, "", None, status="in_progress")
    return await sse(request, [
        ("response.created", {"type": "response.created", "sequence_number": 0,
                              "response": start}),
        ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "a b c",
                                        "sequence_number": 1}),
        ("response.completed", {"type": "response.completed", "sequence_number": 2,
                                "response": whole})])


def messages_usage(cached: int, output: int) -> dict[str, Any]:
    return {"input_tokens": len(PROMPT) - cached, "output_tokens": output,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


async def messages_engine(engine: StandIn, request: web.Request, body: dict[str, Any]
                          ) -> web.StreamResponse:
    content = [{"type": "text", "text": "a b c"}]
    if body.get("max_tokens") == 1:
        return ok({"id": "chatcmpl-1", "type": "message", "role": "assistant",
                   "content": content, "model": "m", "stop_reason": "max_tokens",
                   "usage": messages_usage(CACHED, 1), "kv_transfer_params": TRANSFER})
    usage = messages_usage(len(PROMPT) - 1, 3)
    if not body.get("stream"):
        return ok({"id": "chatcmpl-2", "type": "message", "role": "assistant",
                   "content": content, "model": "m", "stop_reason": "end_turn", "usage": usage,
                   "kv_transfer_params": TRANSFER})
    return await sse(request, [
        ("message_start", {"type": "message_start", "message": {
            "id": "chatcmpl-2", "type": "message", "role": "assistant", "content": [],
            "model": "m", "usage": {"input_tokens": len(PROMPT), "output_tokens": 0}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "a b c"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "usage": usage,
                           "delta": {"stop_reason": "end_turn", "stop_sequence": None}}),
        ("message_stop", {"type": "message_stop"})])


ENGINES: dict[str, Handler] = {"/v1/responses": responses_engine,
                               "/v1/messages": messages_engine}


def read_events(text: str) -> list[tuple[str | None, dict[str, Any]]]:
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((lines.get("event"), json.loads(lines["data"])))
    return events


# -- the Responses API -----------------------------------------------------------------------

def test_a_chain_is_resolved_by_the_router_and_sent_to_the_engines_whole() -> None:
    async def main() -> None:
        # Inference off: a root no key names opens no session (with it on, the root's is an
        # inferred session: test_router_inferred_api_sessions).
        async with cluster(ENGINES, ENGINES, no_inferred_sessions=True) as c, \
                httpx.AsyncClient(timeout=30) as client:
            first = await client.post(f"{c.url}/v1/responses", json={
                "model": "m", "input": "hi", "instructions": "Be brief.", "stream": False})
            assert first.status_code == 200, first.text
            one = first.json()
            # The engines' request: stateless, named by the response's ID; the prefill one
            # token, whole, asked for the prompt's token IDs (the decode request for its
            # output's too, once there is a session's history to keep).
            prefill = c.prefill.requests("/v1/responses")[-1].body
            decode = c.decode.requests("/v1/responses")[-1].body
            assert one["id"].startswith("resp_") and decode["request_id"] == one["id"]
            assert (prefill["max_output_tokens"], prefill["stream"]) == (1, False)
            assert prefill["enable_response_messages"] is True
            assert "enable_response_messages" not in decode
            for sent in (prefill, decode):
                assert sent["store"] is False
                assert "previous_response_id" not in sent and sent["input"] == "hi"
                assert sent["kv_transfer_params"]["turnkv"]
            # The client's answer: no router fields, cached tokens what the turn reused.
            assert one["kv_transfer_params"] is None and one["input_messages"] is None
            assert one["output_messages"] is None
            assert one["usage"]["input_tokens_details"]["cached_tokens"] == CACHED
            assert one["turnkv"]["prompt_tokens"]["prefill_reused"] == CACHED
            assert one["turnkv"]["session_id"] is None  # a root: nothing named a session

            second = (await client.post(f"{c.url}/v1/responses", json={
                "model": "m", "input": [{"role": "user", "content": "more"}],
                "instructions": "Be briefer.", "previous_response_id": one["id"]})).json()
            decode = c.decode.requests("/v1/responses")[-1].body
            assert decode["enable_response_messages"] is True
            assert decode["input"] == [{"role": "user", "content": "hi"}, *one["output"],
                                       {"role": "user", "content": "more"}]
            assert decode["instructions"] == "Be briefer."  # its own, not the first's
            assert second["previous_response_id"] == one["id"]  # the client's, echoed
            # The chain is a session named by its root, with the turn's token history.
            assert second["turnkv"]["session_id"] == one["id"]
            session = c.router.sessions.table.get(SessionKey("default", one["id"]))
            assert session is not None and session.tokens == PROMPT + OUTPUT

            third = (await client.post(f"{c.url}/v1/responses", json={
                "model": "m", "input": "again", "previous_response_id": second["id"]})).json()
            assert third["turnkv"]["session_id"] == one["id"]
            assert c.decode.requests("/v1/responses")[-1].body["input"] == [
                *decode["input"], *second["output"], {"role": "user", "content": "again"}]

            stored = await client.get(f"{c.url}/v1/responses/{second['id']}")
            assert stored.json() == second
            assert (await client.delete(f"{c.url}/v1/responses/{second['id']}")).json() == {
                "id": second["id"], "object": "response", "deleted": True}
            gone = await client.get(f"{c.url}/v1/responses/{second['id']}")
            assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"
            lost = await client.post(f"{c.url}/v1/responses", json={
                "model": "m", "input": "x", "previous_response_id": second["id"]})
            assert lost.status_code == 404
            assert lost.json()["error"]["param"] == "previous_response_id"
            # Each record stands alone: deleting one breaks no later response of the chain.
            assert (await client.get(f"{c.url}/v1/responses/{third['id']}")).status_code == 200
            await settle(c, lambda: all(e.in_flight == 0 for e in c.router.pool.engines()))

    asyncio.run(main())


def test_a_streamed_response_keeps_its_events_and_carries_the_stats_on_completed() -> None:
    async def main() -> None:
        async with cluster(ENGINES, ENGINES) as c, httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(f"{c.url}/v1/responses", json={
                "model": "m", "input": "hi", "stream": True, "conversation": "conv-1",
                "enable_response_messages": True})
            events = read_events(reply.text)
            assert [name for name, _ in events] == [
                "response.created", "response.output_text.delta", "response.completed"]
            assert [data["sequence_number"] for _, data in events] == [0, 1, 2]
            done = events[-1][1]["response"]
            assert done["turnkv"]["session_id"] == "conv-1"
            assert done["usage"]["input_tokens_details"]["cached_tokens"] == CACHED
            # Asked for by the client: its token IDs stay; the router's params never do.
            assert done["output_messages"][0]["tokens"] == OUTPUT
            assert done["kv_transfer_params"] is None
            session = c.router.sessions.table.get(SessionKey("default", "conv-1"))
            assert session is not None and session.tokens == PROMPT + OUTPUT
            # The conversation's items are kept: its next turn's input starts with them.
            await client.post(f"{c.url}/v1/responses", json={
                "model": "m", "input": "more", "conversation": {"id": "conv-1"}})
            assert c.decode.requests("/v1/responses")[-1].body["input"] == [
                {"role": "user", "content": "hi"}, *done["output"],
                {"role": "user", "content": "more"}]

    asyncio.run(main())


def test_a_chains_lineage_takes_its_place_in_the_order_of_session_keys() -> None:
    """A continuation's lineage names the session its previous response was served in (a
    chain whose first turn was named by `X-Session-ID` stays that session), after the keys
    before it in the order (vLLM's session ID) and before those after it (a coding agent's
    header, Codex's `prompt_cache_key`). (Inference off: a root no key named is named by its
    own ID.)"""
    async def main() -> None:
        async with cluster(ENGINES, ENGINES, no_inferred_sessions=True) as c, \
                httpx.AsyncClient(timeout=30) as client:
            async def respond(previous: str | None, headers: dict[str, str] | None = None,
                              **more: Any) -> dict[str, Any]:
                reply = await client.post(f"{c.url}/v1/responses", headers=headers, json={
                    "model": "m", "input": "hi", "previous_response_id": previous, **more})
                assert reply.status_code == 200, reply.text
                return dict(reply.json())

            def named(response: dict[str, Any]) -> tuple[str, str]:
                stats = response["turnkv"]
                return stats["session_id"], stats["session_source"]

            one = await respond(None, {"X-Session-ID": "conv-7"})
            assert named(one) == ("conv-7", "vllm")
            two = await respond(one["id"])
            assert named(two) == ("conv-7", "lineage")
            # Later keys in the order do not move a chain out of its session.
            agent = await respond(two["id"], {"x-claude-code-session-id": "claude-9"})
            assert named(agent) == ("conv-7", "lineage")
            codex = await respond(agent["id"], {"originator": "codex_cli_rs"},
                                  prompt_cache_key="codex-thread-3")
            assert named(codex) == ("conv-7", "lineage")
            # An earlier key does, and the chain goes on in that session.
            moved = await respond(codex["id"], {"X-Session-ID": "conv-8"})
            assert named(moved) == ("conv-8", "vllm")
            assert named(await respond(moved["id"])) == ("conv-8", "lineage")
            # A chain whose root no key named is named by its root.
            root = await respond(None)
            assert root["turnkv"]["session_id"] is None
            assert named(await respond(root["id"])) == (root["id"], "lineage")
            await settle(c, lambda: all(e.in_flight == 0 for e in c.router.pool.engines()))

    asyncio.run(main())


def test_nothing_is_stored_with_store_false_and_background_is_refused() -> None:
    async def main() -> None:
        async with cluster(ENGINES, ENGINES) as c, httpx.AsyncClient(timeout=30) as client:
            reply = (await client.post(f"{c.url}/v1/responses", json={
                "model": "m", "input": "hi", "store": False})).json()
            missing = await client.get(f"{c.url}/v1/responses/{reply['id']}")
            assert missing.status_code == 404
            refused = await client.post(f"{c.url}/v1/responses", json={
                "model": "m", "input": "hi", "background": True})
            assert refused.status_code == 400
            assert refused.json()["error"]["param"] == "background"

    asyncio.run(main())


def test_another_tenants_response_is_not_found(tmp_path: Any) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-a": "acme", "key-b": "globex"}))
    from turnkv_server.router.config import load_api_keys

    async def main() -> None:
        async with cluster(ENGINES, ENGINES, api_keys=load_api_keys(str(keys))) as c, \
                httpx.AsyncClient(timeout=30) as client:
            acme, globex = ({"Authorization": f"Bearer {k}"} for k in ("key-a", "key-b"))
            one = (await client.post(f"{c.url}/v1/responses", headers=acme,
                                     json={"model": "m", "input": "hi"})).json()
            for method in ("GET", "DELETE"):
                other = await client.request(method, f"{c.url}/v1/responses/{one['id']}",
                                             headers=globex)
                assert other.status_code == 404
            chained = await client.post(f"{c.url}/v1/responses", headers=globex, json={
                "model": "m", "input": "x", "previous_response_id": one["id"]})
            assert chained.status_code == 404
            mine = await client.get(f"{c.url}/v1/responses/{one['id']}", headers=acme)
            assert mine.status_code == 200

    asyncio.run(main())


# -- the Messages API ------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_a_message_turn_reads_the_turnkv_tag_and_corrects_anthropic_usage(stream: bool
                                                                           ) -> None:
    async def main() -> None:
        async with cluster(ENGINES, ENGINES) as c, httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(
                f"{c.url}/v1/messages", headers={"X-TurnKV-Session": "claude-1"},
                json={"model": "m", "max_tokens": 8, "stream": stream,
                      "messages": [{"role": "user", "content": "hi"}],
                      "thinking": {"type": "enabled", "budget_tokens": 2048}})
            assert reply.status_code == 200, reply.text
            prefill = c.prefill.requests("/v1/messages")[-1].body
            assert (prefill["max_tokens"], prefill["stream"]) == (1, False)
            assert prefill["thinking"] == {"type": "adaptive"}  # its budget is not under 1
            decode = c.decode.requests("/v1/messages")[-1].body
            assert decode["thinking"]["budget_tokens"] == 2048 and decode["max_tokens"] == 8
            if stream:
                events = read_events(reply.text)
                assert [name for name, _ in events] == [
                    "message_start", "content_block_start", "content_block_delta",
                    "content_block_stop", "message_delta", "message_stop"]
                usage, stats = events[4][1]["usage"], events[4][1]["turnkv"]
            else:
                message = reply.json()
                assert "kv_transfer_params" not in message
                usage, stats = message["usage"], message["turnkv"]
            # What was read from the cache is what the turn reused; the prompt adds up.
            assert usage["cache_read_input_tokens"] == CACHED == \
                stats["prompt_tokens"]["prefill_reused"]
            assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(PROMPT)
            assert stats["session_id"] == "claude-1" and stats["completion_tokens"] == 3
            # No token IDs on this route: no history, and nothing kept for a push back.
            session = c.router.sessions.table.get(SessionKey("default", "claude-1"))
            assert session is not None and session.tokens == []
            assert "send" not in decode["kv_transfer_params"]["turnkv"]

    asyncio.run(main())


def test_anthropic_clients_authenticate_with_x_api_key_and_count_tokens(tmp_path: Any
                                                                      ) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-a": "acme"}))
    from turnkv_server.router.config import load_api_keys

    async def count(engine: StandIn, request: web.Request, body: dict[str, Any]
                    ) -> web.StreamResponse:
        return ok({"input_tokens": len(PROMPT)})

    async def main() -> None:
        engines = {**ENGINES, "/v1/messages/count_tokens": count}
        async with cluster(engines, engines, api_keys=load_api_keys(str(keys))) as c, \
                httpx.AsyncClient(timeout=30) as client:
            body = {"model": "m", "max_tokens": 8,
                    "messages": [{"role": "user", "content": "hi"}]}
            served = await client.post(f"{c.url}/v1/messages", json=body,
                                       headers={"x-api-key": "key-a"})
            assert served.status_code == 200, served.text
            refused = await client.post(f"{c.url}/v1/messages", json=body,
                                        headers={"x-api-key": "key-b"})
            assert refused.status_code == 401
            assert refused.json()["error"]["type"] == "authentication_error"
            counted = await client.post(f"{c.url}/v1/messages/count_tokens", json=body,
                                        headers={"x-api-key": "key-a"})
            assert counted.json() == {"input_tokens": len(PROMPT)}
            unknown = await client.post(f"{c.url}/v1/messages/count_tokens", json=body)
            assert unknown.status_code == 401 and unknown.json()["type"] == "error"

    asyncio.run(main())


def test_errors_on_the_messages_route_are_anthropic_shaped() -> None:
    app = create_app(RouterConfig(prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:9"],
                                  mode="standard", retries=0))
    with TestClient(app) as client:
        body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        down = client.post("/v1/messages", json=body)
        assert down.status_code == 503 and down.headers["retry-after"]
        assert down.json()["type"] == "error"
        assert down.json()["error"]["type"] == "overloaded_error"
        bad = client.post("/v1/messages", content=b"{")
        assert bad.status_code == 400
        assert bad.json()["error"]["type"] == "invalid_request_error"
        assert set(bad.json()) == {"type", "error"}
        # The Responses API's are OpenAI's.
        down = client.post("/v1/responses", json={"model": "m", "input": "hi"})
        assert down.status_code == 503 and down.json()["error"]["code"] == 503


def test_an_engines_refusal_on_the_messages_route_is_anthropic_shaped() -> None:
    """vLLM answers a malformed request in OpenAI's shape on every route (its validation
    handler is the app's), its Messages route's own errors in Anthropic's: the client gets
    Anthropic's either way, the message kept; the Responses route's stay OpenAI's."""
    async def refuse(engine: StandIn, request: web.Request, body: dict[str, Any]
                     ) -> web.StreamResponse:
        if body.get("metadata") == {"own": True}:
            return web.json_response({"type": "error", "error": {
                "type": "invalid_request_error", "message": "anthropic's own"}}, status=400)
        return web.json_response({"error": {
            "message": "body.messages: Input should be a valid list",
            "type": "BadRequestError", "param": "body.messages", "code": 400}}, status=400)

    async def main() -> None:
        engines = {**ENGINES, "/v1/messages": refuse}
        async with cluster(engines, engines) as c, httpx.AsyncClient(timeout=30) as client:
            for own, message in ((False, "body.messages: Input should be a valid list"),
                                 (True, "anthropic's own")):
                for stream in (False, True):
                    reply = await client.post(f"{c.url}/v1/messages", json={
                        "model": "m", "max_tokens": 8, "stream": stream,
                        "messages": "not a list", "metadata": {"own": own}})
                    assert reply.status_code == 400
                    assert reply.json() == {"type": "error", "error": {
                        "type": "invalid_request_error", "message": message}}

    asyncio.run(main())
