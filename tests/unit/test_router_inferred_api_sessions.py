"""Conversations nobody tagged on the Responses and Messages APIs (`inferred_sessions`, on the
digests of `conversations`): a Responses turn with `store: false` and the whole history, no
key at all, and a Messages turn without a session header, that continue an earlier turn's
conversation, are that conversation's inferred session, as untagged chat turns are. First as
pure logic, the reply as each API's answer carries it and the history as clients send it
back; then through the router in front of stand-in engines in vLLM's shapes.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import httpx

from tests.unit.test_router_apis import ENGINES, read_events
from tests.unit.test_router_engine_requests import cluster, settle
from turnkv_server.router.apis.messages import MESSAGES
from turnkv_server.router.apis.responses import RESPONSES_ERRORS
from turnkv_server.router.inferred_sessions import INFERRED_PREFIX, InferredSessions
from turnkv_server.router.sessions import SessionKey

RESPONSES = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
INSTRUCTIONS = "You are a coding agent. " * 30
SYSTEM = [{"type": "text", "text": "You are Claude Code. " * 30,
           "cache_control": {"type": "ephemeral"}}]
TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]


def table() -> InferredSessions:
    return InferredSessions(1000, 900.0, lambda: 0.0)


def turn(inferred: InferredSessions, path: str, body: dict[str, Any], answer: dict[str, Any],
         tenant: str = "t") -> tuple[str, str]:
    """One keyless turn of `body` answered `answer` (the API's answer object): its session
    and how it was found."""
    tag = inferred.tag_for(path, copy.deepcopy(body), tenant, None)
    assert tag is not None and tag.session_id is not None, path
    api = RESPONSES_ERRORS if path == RESPONSES else MESSAGES
    inferred.served(SessionKey(tenant, tag.session_id), api.reply(answer).message())
    return tag.session_id, tag.prefix_id or ""


def response(*items: dict[str, Any]) -> dict[str, Any]:
    """vLLM's response object with these output items (ids and status as it writes them)."""
    return {"id": "resp_x", "object": "response", "status": "completed", "output": list(items)}


def said(text: str, n: int = 0) -> dict[str, Any]:
    return {"id": f"msg_{n}", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": None}]}


def called(name: str, arguments: str, call_id: str) -> dict[str, Any]:
    return {"id": f"fc_{call_id}", "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed"}


def thought() -> dict[str, Any]:
    return {"id": "rs_1", "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": "think"}]}


def test_responses_with_store_false_and_the_whole_history_are_one_session() -> None:
    """Codex's way without its keys (no `prompt_cache_key`, no session header): instructions,
    input items, the output items sent back as they came (reasoning, a function call), the
    tool's output, then more; a second conversation sharing the instructions is its own."""
    inferred = table()
    sessions: list[list[str]] = [[], []]
    histories: list[list[dict[str, Any]]] = [[], []]
    for number in range(2):
        histories[number].append({"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": f"Fix the bug in conversation {number}."}]})
    for step in range(3):
        for number in range(2):
            history = histories[number]
            body = {"model": "m", "instructions": INSTRUCTIONS, "input": history,
                    "store": False, "tools": TOOLS, "stream": True}
            if step == 0:
                answer = response(thought(), called("read_file", '{"path": "a.py"}',
                                                    f"call_{number}"))
            else:
                answer = response(thought(), said(f"done {step} of {number}"))
            session, _ = turn(inferred, RESPONSES, body, answer)
            sessions[number].append(session)
            history += answer["output"]
            if step == 0:
                history.append({"type": "function_call_output", "call_id": f"call_{number}",
                                "output": "print('hi')"})
            else:
                history.append({"role": "user", "content": f"and then {step}?"})
    for found in sessions:
        assert found[0].startswith(INFERRED_PREFIX)
        assert len(set(found)) == 1, found
    assert sessions[0][0] != sessions[1][0]


def test_responses_clients_echo_a_reply_in_their_own_form() -> None:
    """The reply sent back as the client library keeps it: output items without ids or status
    (LangChain), or a plain assistant message with text content."""
    inferred = table()
    first = {"model": "m", "input": "hello", "store": False}
    session, _ = turn(inferred, RESPONSES, first, response(said("Hi there.")))
    echoes = [{"type": "message", "role": "assistant",
               "content": [{"type": "output_text", "text": "Hi there."}]},
              {"role": "assistant", "content": "Hi there. "}]
    for echo in echoes:
        body = {"model": "m", "store": False,
                "input": [{"role": "user", "content": "hello"}, echo,
                          {"role": "user", "content": "more"}]}
        tag = inferred.tag_for(RESPONSES, body, "t", None)
        assert tag is not None and tag.session_id == session, echo
        inferred.abandon(SessionKey("t", session))


def test_messages_without_a_session_header_are_one_session() -> None:
    """An Anthropic client without Claude Code's header: system blocks, tools, the reply's
    content blocks sent back (thinking, text, tool_use), tool results, `cache_control` moved
    from turn to turn as Claude Code moves it."""
    inferred = table()
    tools = [{"name": "read_file", "input_schema": {"type": "object"},
              "cache_control": {"type": "ephemeral"}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": [
        {"type": "text", "text": "Fix the bug.", "cache_control": {"type": "ephemeral"}}]}]
    sessions = []
    answers = [
        [{"type": "thinking", "thinking": "look", "signature": "s"},
         {"type": "text", "text": "Reading it."},
         {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.py"}}],
        [{"type": "text", "text": "Fixed."}],
        [{"type": "text", "text": "Done."}],
    ]
    for step, content in enumerate(answers):
        body = {"model": "m", "max_tokens": 64, "system": SYSTEM, "tools": tools,
                "messages": messages}
        session, _ = turn(inferred, MESSAGES_PATH, body, {
            "id": "msg_1", "type": "message", "role": "assistant", "content": content})
        sessions.append(session)
        for message in messages:  # the marker moves to the newest message
            for block in message["content"] if isinstance(message["content"], list) else []:
                block.pop("cache_control", None)
        messages = [*messages, {"role": "assistant", "content": copy.deepcopy(content)}]
        if step == 0:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "print('hi')",
                 "cache_control": {"type": "ephemeral"}}]})
        else:
            messages.append({"role": "user", "content": f"next {step}"})
    assert sessions[0].startswith(INFERRED_PREFIX) and len(set(sessions)) == 1, sessions
    # Another conversation under the same system prompt and first question is its own.
    other = {"model": "m", "max_tokens": 64, "system": SYSTEM, "tools": tools,
             "messages": [{"role": "user", "content": "Fix the bug."},
                          {"role": "assistant", "content": "Something else."},
                          {"role": "user", "content": "go on"}]}
    tag = inferred.tag_for(MESSAGES_PATH, other, "t", None)
    assert tag is not None and tag.session_id not in sessions


def test_a_streamed_messages_reply_is_gathered_as_the_client_keeps_it() -> None:
    """The reply read from a Messages stream (text and tool_use deltas) matches the content
    blocks the client sends back."""
    relay_events = [
        {"type": "message_start", "message": {"role": "assistant", "content": []}},
        {"type": "content_block_start", "index": 0,
         "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "text_delta", "text": "Reading "}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "text_delta", "text": "it."}},
        {"type": "content_block_start", "index": 1, "content_block": {
            "type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {}}},
        {"type": "content_block_delta", "index": 1,
         "delta": {"type": "input_json_delta", "partial_json": '{"path": '}},
        {"type": "content_block_delta", "index": 1,
         "delta": {"type": "input_json_delta", "partial_json": '"a.py"}'}},
        {"type": "message_delta", "usage": {"output_tokens": 9}},
    ]
    gathered = MESSAGES.reply({"content": []})
    for event in relay_events:
        gathered.feed_anthropic(event)
    whole = MESSAGES.reply({"content": [
        {"type": "text", "text": "Reading it."},
        {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.py"}}]})
    assert gathered.message() is not None
    from turnkv_server.router.conversations import canonical
    assert canonical(gathered.message() or {}) == canonical(whole.message() or {})


# -- through the router ----------------------------------------------------------------------


def stats_of(reply: httpx.Response) -> dict[str, Any]:
    assert reply.status_code == 200, reply.text
    if reply.headers["content-type"].startswith("application/json"):
        return dict(reply.json()["turnkv"])
    for _, data in read_events(reply.text):
        stats = data.get("turnkv") or (data.get("response") or {}).get("turnkv")
        if stats:
            return dict(stats)
    raise AssertionError(f"no stats in {reply.text[:500]}")


def test_keyless_responses_and_messages_through_the_router_are_inferred_sessions() -> None:
    async def main() -> None:
        async with cluster(ENGINES, ENGINES) as c, httpx.AsyncClient(timeout=30) as client:
            for stream in (False, True):
                history: list[Any] = [{"role": "user", "content": f"hi {stream}"}]
                sessions = []
                for n in range(3):
                    reply = await client.post(f"{c.url}/v1/responses", json={
                        "model": "m", "input": history, "store": False, "stream": stream})
                    stats = stats_of(reply)
                    assert stats["session_source"] == "inferred", stats
                    assert stats["turn"] == n + 1, stats
                    sessions.append(stats["session_id"])
                    output = (reply.json() if not stream else next(
                        d["response"] for _, d in read_events(reply.text)
                        if d.get("type") == "response.completed"))["output"]
                    history += [*output, {"role": "user", "content": f"more {n}"}]
                assert len(set(sessions)) == 1, sessions

                messages: list[Any] = [{"role": "user", "content": f"hello {stream}"}]
                sessions = []
                for n in range(3):
                    reply = await client.post(f"{c.url}/v1/messages", json={
                        "model": "m", "max_tokens": 8, "messages": messages,
                        "stream": stream})
                    stats = stats_of(reply)
                    assert stats["session_source"] == "inferred", stats
                    sessions.append(stats["session_id"])
                    # (The stand-in answers "a b c", as the client keeps it.)
                    messages += [{"role": "assistant", "content": [
                        {"type": "text", "text": "a b c"}]},
                        {"role": "user", "content": f"more {n}"}]
                assert len(set(sessions)) == 1, sessions
            await settle(c, lambda: all(e.in_flight == 0 for e in c.router.pool.engines()))
            # The engines never see the router's inference: no tag in their requests.
            assert not any("turnkv" in s.body for s in c.decode.seen)

    asyncio.run(main())


def test_a_keyless_root_is_inferred_and_its_chain_stays_in_that_session() -> None:
    """`store` on, no key: the root response opens an inferred session (as a keyless chat turn
    does), and a continuation by `previous_response_id` goes on in it by its lineage."""
    async def main() -> None:
        async with cluster(ENGINES, ENGINES) as c, httpx.AsyncClient(timeout=30) as client:
            one = (await client.post(f"{c.url}/v1/responses", json={
                "model": "m", "input": "hi"})).json()
            two = (await client.post(f"{c.url}/v1/responses", json={
                "model": "m", "input": "more", "previous_response_id": one["id"]})).json()
            first, second = one["turnkv"], two["turnkv"]
            assert first["session_source"] == "inferred"
            assert first["session_id"].startswith(INFERRED_PREFIX)
            assert (second["session_id"], second["session_source"], second["turn"]) == (
                first["session_id"], "lineage", 2)
            await settle(c, lambda: all(e.in_flight == 0 for e in c.router.pool.engines()))

    asyncio.run(main())
