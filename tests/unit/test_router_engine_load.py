"""What the router counts of an engine's load as its requests run: requests in flight, and of
those the ones whose answer has not begun (`Engine.prefilling`: prompts the engine is
computing or has queued), against an aiohttp stand-in that answers when told to."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from tests.support.local_servers import start_engine_app
from turnkv_server.router.engines import Engine, Upstream


def test_a_request_counts_as_prefilling_until_its_answer_begins() -> None:
    async def main() -> None:
        first_token, last_token = asyncio.Event(), asyncio.Event()

        async def handle(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)  # headers go out at once, as vLLM's do
            await first_token.wait()
            await response.write(b"data: {}\n\n")
            await last_token.wait()
            await response.write(b"data: [DONE]\n\n")
            return response

        runner, url = await start_engine_app(handle)
        upstream = Upstream()
        engine = Engine("decode-0", url, "decode")
        try:
            stream = await upstream.open(engine, "/v1/chat/completions", {"stream": True})
            assert (engine.in_flight, engine.prefilling) == (1, 1)
            lines = stream.lines()
            first_token.set()
            assert await lines.__anext__() == b"data: {}"
            assert (engine.in_flight, engine.prefilling) == (1, 0)  # decoding now
            last_token.set()
            async for _ in lines:
                pass
            stream.close()
            assert (engine.in_flight, engine.prefilling) == (0, 0)
            # Closed before its answer began (a client that left): both given back.
            first_token.clear()
            stream = await upstream.open(engine, "/v1/chat/completions", {"stream": True})
            assert (engine.in_flight, engine.prefilling) == (1, 1)
            stream.close()
            assert (engine.in_flight, engine.prefilling) == (0, 0)
        finally:
            first_token.set()
            last_token.set()
            await upstream.close()
            await runner.cleanup()

    asyncio.run(main())


def test_an_engine_remembers_when_its_latest_answer_began() -> None:
    """The prompt queued behind an answered one begins then (`TurnsInFlight.prefill_wait_ms`);
    a /tokenize answer is the HTTP server's, not the engine's steps, and says nothing of it."""
    async def main() -> None:
        async def handle(request: web.Request) -> web.StreamResponse:
            return web.json_response({"tokens": [1, 2, 3]})

        runner, url = await start_engine_app(handle)
        upstream = Upstream()
        engine = Engine("decode-0", url, "decode")
        try:
            assert await upstream.tokenize(engine, {"prompt": "hi"}) == [1, 2, 3]
            assert engine.answered_at == float("-inf")
            before = time.monotonic()
            stream = await upstream.open(engine, "/v1/completions", {"max_tokens": 1})
            assert engine.answered_at == float("-inf")  # headers in, no answer read yet
            await stream.read()
            stream.close()
            assert before <= engine.answered_at <= time.monotonic()
        finally:
            await upstream.close()
            await runner.cleanup()

    asyncio.run(main())


def test_a_render_in_flight_is_no_prompt_the_engine_computes() -> None:
    """A /tokenize in flight counts among the engine's requests, not among its prompts: the
    planner reads `prefilling` as that many of its newest planned prompts still ahead."""
    async def main() -> None:
        answer = asyncio.Event()

        async def handle(request: web.Request) -> web.StreamResponse:
            if request.path.endswith("tokenize"):
                await answer.wait()
                return web.json_response({"tokens": [1, 2, 3]})
            response = web.StreamResponse()
            await response.prepare(request)  # headers go out at once, as vLLM's do
            await answer.wait()
            await response.write(b"{}")
            return response

        runner, url = await start_engine_app(handle)
        upstream = Upstream()
        engine = Engine("decode-0", url, "decode")
        try:
            render = asyncio.ensure_future(upstream.tokenize(engine, {"prompt": "hi"}))
            while engine.in_flight == 0:
                await asyncio.sleep(0.001)
            assert (engine.in_flight, engine.prefilling) == (1, 0)
            stream = await upstream.open(engine, "/v1/completions", {"max_tokens": 1})
            assert (engine.in_flight, engine.prefilling) == (2, 1)  # headers in: a prompt
            answer.set()
            assert await render == [1, 2, 3]
            assert (engine.in_flight, engine.prefilling) == (1, 1)
            await stream.read()
            stream.close()
            assert (engine.in_flight, engine.prefilling) == (0, 0)
        finally:
            answer.set()
            await upstream.close()
            await runner.cleanup()

    asyncio.run(main())
