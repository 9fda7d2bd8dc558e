"""What a streamed turn sends its client besides the answer: nothing a stock client does not
expect. The stats chunk (`"choices": []`) goes out only to a client that asked for it (turnkv's
own tag, as the SDK sends it, or `stream_options.include_usage`, and then merged into vLLM's
own usage chunk); otherwise the stats stay in the response headers and the session API.

Through the router in front of stand-in engines that stream as vLLM 0.32 does: a usage chunk
with `"choices": []` only when asked (`chat_completion/serving.py`,
`chat_completion_stream_generator`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from tests.unit.test_router_affinity import StandIn, affinity_router


@dataclass
class VllmLike(StandIn):
    """Streams a usage chunk only for `stream_options.include_usage`, as vLLM does."""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        if not body.get("stream") or request.path == "/tokenize":
            return await super()._handle(request)  # (aiohttp keeps the body it read)
        self.paths.append(request.path)
        self.seen.append(body)
        usage = {"prompt_tokens": self.prompt, "completion_tokens": 2,
                 "prompt_tokens_details": {"cached_tokens": self.cached}}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        events: list[dict[str, Any]] = [
            {"id": "c", "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"id": "c", "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [1]}]},
            {"id": "c", "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": {"content": " b"}, "token_ids": [2],
                          "finish_reason": "stop"}]}]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({"id": "c", "object": "chat.completion.chunk", "choices": [],
                           "usage": usage})
        for event in events:
            await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def stock_stream_client(text: str) -> str:
    """Reads a stream as vLLM's `benchmarks/multi_turn` client does: `choices[0]` of every
    chunk but `[DONE]` (an IndexError on a chunk with no choices)."""
    answer = ""
    for line in text.splitlines():
        chunk = line.strip().removeprefix("data: ")
        if not chunk or chunk == "[DONE]":
            continue
        data = json.loads(chunk)
        delta = data["choices"][0]["delta"]
        answer += delta.get("content") or ""
    return answer


def events_of(text: str) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def conversation(turns: int) -> list[list[dict[str, str]]]:
    messages: list[dict[str, str]] = []
    out = []
    for i in range(turns):
        messages = [*messages, {"role": "user", "content": f"question {i}"}]
        out.append(messages)
        messages = [*messages, {"role": "assistant", "content": "a b"}]
    return out


@pytest.mark.parametrize("headers", [{}, {"X-Session-ID": "CONV_ID_0"}],
                         ids=["untagged", "x-session-id"])
def test_a_stock_streaming_client_reads_choices_of_every_chunk(headers: dict[str, str]
                                                                ) -> None:
    async def main() -> None:
        engine = VllmLike()
        async with affinity_router([engine]) as (_, url), \
                httpx.AsyncClient(timeout=30) as client:
            for messages in conversation(3):
                # As vLLM's multi-turn client sends it: include_usage false.
                reply = await client.post(f"{url}/v1/chat/completions", headers=headers, json={
                    "model": "m", "messages": messages, "stream": True,
                    "stream_options": {"include_usage": False}})
                assert reply.status_code == 200, reply.text
                assert stock_stream_client(reply.text) == "a b"
                # The stats are in the headers.
                assert reply.headers["x-turnkv-decode-node"] == "engine-0"
            # The router asked the engine for usage all the same (its stats count tokens).
            assert all(b["stream_options"]["include_usage"] for b in engine.seen)
    asyncio.run(main())


def test_include_usage_gets_one_usage_chunk_that_carries_the_stats() -> None:
    async def main() -> None:
        async with affinity_router([VllmLike()]) as (_, url), \
                httpx.AsyncClient(timeout=30) as client:
            for headers in ({}, {"X-Session-ID": "s"}, {"X-TurnKV-Session": "t"}):
                reply = await client.post(f"{url}/v1/chat/completions", headers=headers, json={
                    "model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "stream": True, "stream_options": {"include_usage": True}})
                empty = [e for e in events_of(reply.text) if not e["choices"]]
                assert len(empty) == 1, (headers, empty)
                assert empty[0]["usage"]["prompt_tokens"] == 300
                assert empty[0]["turnkv"]["mode"] == "affinity"
                assert empty[0]["id"] == "c"  # the engine's own chunk
    asyncio.run(main())


def test_turnkvs_own_tag_gets_the_stats_chunk_without_usage() -> None:
    async def main() -> None:
        async with affinity_router([VllmLike()]) as (_, url), \
                httpx.AsyncClient(timeout=30) as client:
            tags: list[tuple[dict[str, str], dict[str, Any]]] = [
                ({"X-TurnKV-Session": "t"}, {}), ({}, {"turnkv": {"session_id": "u"}})]
            for headers, tag in tags:
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                        "stream": True, **tag}
                reply = await client.post(f"{url}/v1/chat/completions", json=body,
                                          headers=headers)
                empty = [e for e in events_of(reply.text) if not e["choices"]]
                assert len(empty) == 1 and "usage" not in empty[0], empty
                assert empty[0]["turnkv"]["session_source"] == "tag"
                # The totals came from the usage the router asked for.
                assert empty[0]["turnkv"]["prompt_tokens"]["total"] == 300
    asyncio.run(main())
