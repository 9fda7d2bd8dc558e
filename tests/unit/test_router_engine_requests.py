"""The router's requests to its engines end exactly once, on every path.

The engines here are stand-ins (aiohttp servers) that answer like vLLM where the router looks
(headers, SSE chunks, token IDs) and misbehave on cue: a prefill that fails after the decode
engine's headers are in, a client that leaves during the prefill, a push back that is refused.
This is the router's own logic, so nothing needs a real engine; the router runs under uvicorn,
as deployed. After each turn the stand-ins must have seen every connection closed and every
engine's `in_flight` must be back at 0 (placement stops sending turns to an engine whose count
reaches its limit, so a leak there excludes it for good).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from tests.support.local_servers import serving, start_engine_app
from turnkv_server.router.app import Router, create_app
from turnkv_server.router.config import RouterConfig

Handler = Callable[["StandIn", web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]
# A decode stand-in's slow stream: a chunk this often, this many times (longer than any test).
CHUNK_EVERY_S = 0.05
CHUNKS = 100


@dataclass
class Seen:
    """One request a stand-in received."""

    path: str
    body: dict[str, Any]
    # Set when the stand-in finds the router has closed the connection before the end.
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: bool = False  # the stand-in sent its whole answer


class StandIn:
    """An engine stand-in: `handlers` answer POSTs by path; GET /health is 200."""

    def __init__(self, handlers: dict[str, Handler]) -> None:
        self.handlers = handlers
        self.seen: list[Seen] = []
        self.headers_sent = asyncio.Event()  # a streamed answer's headers went out
        self.partner: StandIn | None = None  # the other engine of the pair
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        self._runner, self.url = await start_engine_app(self._handle)
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def requests(self, path: str) -> list[Seen]:
        return [s for s in self.seen if s.path == path]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.seen.append(Seen(request.path, body))
        handler = self.handlers.get(request.path)
        if handler is None:
            return _ok()
        return await handler(self, request, body)


def _ok(payload: dict[str, Any] | None = None, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload or {}), status=status,
                        content_type="application/json")


def _seen(engine: StandIn, request: web.Request) -> Seen:
    return next(s for s in reversed(engine.seen) if s.path == request.path)


def _chunk(token: int) -> bytes:
    event = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": {"content": f"t{token}"},
                          "token_ids": [token]}]}
    return b"data: " + orjson.dumps(event) + b"\n\n"


async def slow_decode(engine: StandIn, request: web.Request, body: dict[str, Any]
                      ) -> web.StreamResponse:
    """vLLM's decode engine: a streamed answer's headers at once, then a token every
    `CHUNK_EVERY_S` (a non-streamed answer comes whole, after a few tokens' time)."""
    seen = _seen(engine, request)
    if not body.get("stream"):
        await asyncio.sleep(3 * CHUNK_EVERY_S)
        seen.ended = True
        return _ok({"choices": [{"index": 0, "message": {"content": "t1 t2 t3"},
                                 "token_ids": [1, 2, 3]}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 3}})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    engine.headers_sent.set()
    try:
        for token in range(1, CHUNKS + 1):
            await response.write(_chunk(token))
            await asyncio.sleep(CHUNK_EVERY_S)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        seen.ended = True
    except ConnectionError:
        seen.closed.set()
    return response


def failing_prefill(how: str) -> Handler:
    """A prefill engine that fails `how` (an HTTP status, or "reset": the connection drops)
    once the decode engine's headers are in."""

    async def handler(engine: StandIn, request: web.Request, body: dict[str, Any]
                      ) -> web.StreamResponse:
        decode = engine.partner
        assert decode is not None
        await asyncio.wait_for(decode.headers_sent.wait(), 5.0)
        await asyncio.sleep(2 * CHUNK_EVERY_S)  # a token or two on its way to the client
        if how == "reset":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        return _ok({"error": {"message": "no"}}, status=int(how))

    return handler


async def prefill_ok(engine: StandIn, request: web.Request, body: dict[str, Any]
                     ) -> web.StreamResponse:
    return _ok({"choices": [{"index": 0, "message": {"content": "t1"}, "token_ids": [1]}],
                "prompt_token_ids": [7, 8, 9],
                "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}})


async def tokenize_ok(engine: StandIn, request: web.Request, body: dict[str, Any]
                      ) -> web.StreamResponse:
    return _ok({"tokens": [7, 8, 9]})


@dataclass
class Cluster:
    prefill: StandIn
    decode: StandIn
    router: Router
    url: str


def free_port() -> int:
    """A port nobody listens on (for an engine that refuses connections)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def cluster(prefill: dict[str, Handler] | None, decode: dict[str, Handler],
                  short_delta_tokens: int = 0, itl_target_ms: float | None = None,
                  **settings: Any) -> AsyncIterator[Cluster]:
    """Stand-in engines (`prefill` None: nothing listens there) behind a `turnkv` router (with
    more of its `settings`), in fixed pools unless they say otherwise: the P/D form's requests
    are what most tests here read (the planner's: tests/unit/test_router_turnkv_planned.py)."""
    settings.setdefault("fixed_pools", True)
    # (A prompt of three tokens, as `prefill_ok` renders it.)
    p, d = StandIn(prefill or {}), StandIn({"/tokenize": tokenize_ok, **decode})
    p.partner, d.partner = d, p
    d_url = await d.start()
    p_url = await p.start() if prefill is not None else f"http://127.0.0.1:{free_port()}"
    config = RouterConfig(prefill=[p_url], decode=[d_url], mode="turnkv",
                          prefill_nixl=["p@127.0.0.1:5601"], decode_nixl=["d@127.0.0.1:5602"],
                          short_delta_tokens=short_delta_tokens, itl_target_ms=itl_target_ms,
                          health_interval=60.0, **settings)
    app = create_app(config)
    try:
        async with serving(app) as url:
            yield Cluster(p, d, app.state.router, url)
    finally:
        await d.stop()
        await p.stop()


async def settle(c: Cluster, what: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            engines = {e.name: e.in_flight for e in c.router.pool.engines()}
            seen = [(s.path, s.closed.is_set(), s.ended) for s in c.decode.seen]
            raise AssertionError(f"not within {timeout} s; in flight: {engines}; "
                                 f"decode saw (path, closed, ended): {seen}")
        await asyncio.sleep(0.02)


def all_over(c: Cluster) -> Callable[[], bool]:
    """Every engine request ended: nothing in flight, every decode stream closed or whole."""
    def over() -> bool:
        streams = c.decode.requests("/v1/chat/completions")
        return all(e.in_flight == 0 for e in c.router.pool.engines()) and all(
            s.closed.is_set() or s.ended for s in streams)
    return over


def chat(stream: bool, session: str | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 8, "stream": stream, **extra}
    if session is not None:
        body["turnkv"] = {"session_id": session}
    return body


# -- the decode request of a turn whose prefill failed -------------------------------------

@pytest.mark.parametrize("how", ["503", "400", "reset", "refused"])
def test_a_streamed_turn_whose_prefill_fails_closes_its_decode_request(how: str) -> None:
    """The decode request goes out with the prefill; a streamed one has its headers in before
    the prefill fails. Its engine request must still be closed (the engine would wait for KV
    that never comes) and its in-flight count given back. (The turn is then replayed with the
    only prefill engine out of service: the decode engine serves it alone, and the client
    leaves after its first token; a 400 is the client's own, passed through.)"""

    async def main() -> None:
        prefill = None if how == "refused" else {"/v1/chat/completions": failing_prefill(how)}
        async with cluster(prefill, {"/v1/chat/completions": slow_decode}) as c, \
                httpx.AsyncClient(timeout=30) as client:
            async with client.stream("POST", f"{c.url}/v1/chat/completions",
                                     json=chat(stream=True)) as reply:
                assert reply.status_code == (400 if how == "400" else 200)
                async for line in reply.aiter_lines():
                    if line.startswith("data: {"):
                        break
            decodes = c.decode.requests("/v1/chat/completions")
            # The turn (and its retry, after a 5xx or a reset) reached the decode engine,
            # except where the refusal came first.
            assert decodes or how == "refused"
            await settle(c, all_over(c))
            # Closed by the router, not run to the end into a buffer nobody reads.
            assert all(s.closed.is_set() for s in decodes)

    asyncio.run(main())


def test_while_the_prefill_engine_is_down_the_decode_engine_serves_turns_alone() -> None:
    """The soak killed the prefill engine: within seconds every session was at a turn that
    needs it (a first turn) and got 503 until it was back, while the decode engine sat idle.
    The turn that finds it down is replayed on the decode engine alone, and so are the turns
    after it; nothing is kept for a push back it cannot take."""

    async def main() -> None:
        async with cluster(None, {"/v1/chat/completions": slow_decode},
                           short_delta_tokens=512) as c, \
                httpx.AsyncClient(timeout=30) as client:
            for number in (1, 2):
                reply = await client.post(f"{c.url}/v1/chat/completions",
                                          json=chat(stream=False, session="s"))
                assert reply.status_code == 200, reply.text
                stats = reply.json()["turnkv"]
                assert stats["prefill_node"] is None and stats["decode_node"] == "decode-0"
                assert stats["fallback"] == "engine_unavailable", stats
                served = c.decode.requests("/v1/chat/completions")[-1]
                params = served.body["kv_transfer_params"]["turnkv"]
                assert "receive" not in params and "send" not in params
                assert stats["turn"] == number
            await settle(c, lambda: all(e.in_flight == 0 for e in c.router.pool.engines()))
            assert abandoned(c.decode) == [] and not c.router.pool.prefill[0].healthy
            # Still serving: a load balancer must keep the router.
            health = await client.get(f"{c.url}/health")
            assert (health.status_code, health.json()["status"]) == (200, "degraded")

    asyncio.run(main())


def test_a_client_that_leaves_during_the_prefill_ends_the_decode_request() -> None:
    """The response to a streamed turn starts once the prefill is over; a client that left
    meanwhile never reads a byte, so the relay never starts: the decode request must end
    anyway."""

    async def slow_prefill(engine: StandIn, request: web.Request, body: dict[str, Any]
                           ) -> web.StreamResponse:
        await asyncio.sleep(0.5)
        return await prefill_ok(engine, request, body)

    async def main() -> None:
        async with cluster({"/v1/chat/completions": slow_prefill},
                           {"/v1/chat/completions": slow_decode}) as c:
            with contextlib.suppress(httpx.TimeoutException):
                async with httpx.AsyncClient(timeout=0.2) as client:
                    await client.post(f"{c.url}/v1/chat/completions", json=chat(stream=True))
            await settle(c, lambda: len(c.prefill.seen) == 1 and bool(c.decode.seen))
            await settle(c, all_over(c))
            assert c.decode.requests("/v1/chat/completions")[0].closed.is_set()

    asyncio.run(main())


def test_whole_turns_end_their_requests() -> None:
    """Streamed and not: the engine requests end when the turn does, and a streamed turn the
    client stops reading is closed upstream too."""

    async def main() -> None:
        async with cluster({"/v1/chat/completions": prefill_ok},
                           {"/v1/chat/completions": slow_decode}) as c, \
                httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(f"{c.url}/v1/chat/completions", json=chat(stream=False))
            assert reply.status_code == 200 and reply.json()["choices"]
            await settle(c, all_over(c))
            async with client.stream("POST", f"{c.url}/v1/chat/completions",
                                     json=chat(stream=True)) as streamed:
                assert streamed.status_code == 200
                async for line in streamed.aiter_lines():
                    if line.startswith("data: {"):
                        break  # the client leaves after its first token
            await settle(c, all_over(c))
            assert c.decode.requests("/v1/chat/completions")[-1].closed.is_set()

    asyncio.run(main())


# -- the decode engine's send back to the prefill engine, when the push back will not come --

def sends_to_prefill(decode: StandIn) -> list[str]:
    """The transfer IDs of the decode engine's sends back to the prefill engine, per turn."""
    return [s.body["kv_transfer_params"]["turnkv"]["send"]["transfer_id"]
            for s in decode.requests("/v1/chat/completions")
            if "send" in s.body["kv_transfer_params"]["turnkv"]]


def abandoned(engine: StandIn) -> list[str]:
    return [transfer_id for s in engine.requests("/v1/completions")
            for transfer_id in s.body["kv_transfer_params"]["turnkv"].get("abandon", [])]


def push_back(how: str) -> Handler:
    """The prefill engine's answer to a push back: an HTTP status, "reset" (the connection
    drops) or "hang" (no answer until the router gives up on it)."""

    async def handler(engine: StandIn, request: web.Request, body: dict[str, Any]
                      ) -> web.StreamResponse:
        if "receive" not in body["kv_transfer_params"]["turnkv"]:
            return _ok()  # not a push back (a lease released)
        if how == "hang":
            await asyncio.sleep(60)
        if how == "reset":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        return _ok({"choices": [{"index": 0, "text": "x"}]}, status=int(how))

    return handler


def turnkv_pair(push: str) -> tuple[dict[str, Handler], dict[str, Handler]]:
    return ({"/v1/chat/completions": prefill_ok, "/v1/completions": push_back(push)},
            {"/v1/chat/completions": slow_decode})


@pytest.mark.parametrize("how", ["400", "500", "reset"])
def test_a_push_back_that_does_not_land_gives_the_decode_engines_send_up(how: str) -> None:
    """Refused (a history at the model's max length gets a 400), failed, or cut off: nobody
    will register for the decode engine's send, which would hold the turn's blocks for its
    whole timeout. The router tells it to give the send up."""

    async def main() -> None:
        async with cluster(*turnkv_pair(how)) as c, httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(f"{c.url}/v1/chat/completions",
                                      json=chat(stream=False, session="s"))
            assert reply.status_code == 200, reply.text
            await settle(c, lambda: bool(abandoned(c.decode)))
            assert abandoned(c.decode) == sends_to_prefill(c.decode) != []
            assert abandoned(c.prefill) == []
            await settle(c, all_over(c))

    asyncio.run(main())


def test_a_push_back_that_lands_or_a_final_turn_gives_nothing_up() -> None:
    async def main() -> None:
        async with cluster(*turnkv_pair("200")) as c, httpx.AsyncClient(timeout=30) as client:
            for hints in ({}, {"final": True}):
                body = chat(stream=False)
                body["turnkv"] = {"session_id": "s", "hints": hints}
                reply = await client.post(f"{c.url}/v1/chat/completions", json=body)
                assert reply.status_code == 200, reply.text
            await settle(c, all_over(c))
            assert len(c.prefill.requests("/v1/completions")) >= 1  # the push back
            assert len(sends_to_prefill(c.decode)) == 1  # the final turn sends nothing back
            assert abandoned(c.decode) == abandoned(c.prefill) == []

    asyncio.run(main())


def test_the_next_turn_hint_reaches_every_engine_that_keeps_the_session() -> None:
    """`next_turn_in`, in the body or a header, goes to both engines in the turn's
    `kv_transfer_params` (prefill, decode, push back): each orders its evictions by it."""

    def hints_sent(engine: StandIn) -> list[float | None]:
        return [s.body["kv_transfer_params"]["turnkv"].get("next_turn_in_s")
                for s in engine.seen if s.path in ("/v1/chat/completions", "/v1/completions")]

    async def main() -> None:
        async with cluster(*turnkv_pair("200")) as c, httpx.AsyncClient(timeout=30) as client:
            body = chat(stream=False)
            body["turnkv"] = {"session_id": "s", "hints": {"next_turn_in": 12}}
            reply = await client.post(f"{c.url}/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            await settle(c, lambda: len(c.prefill.requests("/v1/completions")) == 1)
            await settle(c, all_over(c))
            assert hints_sent(c.prefill) == [12, 12]  # the prefill, then the push back
            assert hints_sent(c.decode) == [12]
            reply = await client.post(f"{c.url}/v1/chat/completions",
                                      json=chat(stream=False, session="s"),
                                      headers={"X-TurnKV-Next-Turn-In": "2.5"})
            assert reply.status_code == 200, reply.text
            await settle(c, lambda: len(c.prefill.requests("/v1/completions")) == 2)
            await settle(c, all_over(c))
            assert hints_sent(c.prefill)[2:] == [2.5, 2.5] and hints_sent(c.decode)[1:] == [2.5]
            # Without a hint, none is sent.
            reply = await client.post(f"{c.url}/v1/chat/completions",
                                      json=chat(stream=False, session="s"))
            assert reply.status_code == 200, reply.text
            await settle(c, lambda: len(c.prefill.requests("/v1/completions")) == 3)
            await settle(c, all_over(c))
            assert hints_sent(c.prefill)[4:] == [None, None]
            assert hints_sent(c.decode)[2:] == [None]

    asyncio.run(main())


def test_a_cut_stream_gives_the_decode_engines_send_up() -> None:
    """The client leaves mid-stream: no whole reply, no push back."""

    async def main() -> None:
        async with cluster(*turnkv_pair("200")) as c, httpx.AsyncClient(timeout=30) as client:
            async with client.stream("POST", f"{c.url}/v1/chat/completions",
                                     json=chat(stream=True, session="s")) as streamed:
                async for line in streamed.aiter_lines():
                    if line.startswith("data: {"):
                        break
            await settle(c, lambda: bool(abandoned(c.decode)))
            assert abandoned(c.decode) == sends_to_prefill(c.decode) != []
            assert c.prefill.requests("/v1/completions") == []  # no push back
            await settle(c, all_over(c))

    asyncio.run(main())


def test_an_empty_reply_gives_the_decode_engines_send_up() -> None:
    async def empty(engine: StandIn, request: web.Request, body: dict[str, Any]
                    ) -> web.StreamResponse:
        return _ok({"choices": [{"index": 0, "message": {"content": ""}, "token_ids": []}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 0}})

    async def main() -> None:
        prefill, _ = turnkv_pair("200")
        async with cluster(prefill, {"/v1/chat/completions": empty}) as c, \
                httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(f"{c.url}/v1/chat/completions",
                                      json=chat(stream=False, session="s"))
            assert reply.status_code == 200, reply.text
            await settle(c, lambda: bool(abandoned(c.decode)))
            assert abandoned(c.decode) == sends_to_prefill(c.decode) != []
            assert c.prefill.requests("/v1/completions") == []

    asyncio.run(main())


def test_ending_a_session_during_its_push_back_gives_the_send_up() -> None:
    async def main() -> None:
        async with cluster(*turnkv_pair("hang")) as c, httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(f"{c.url}/v1/chat/completions",
                                      json=chat(stream=False, session="s"))
            assert reply.status_code == 200, reply.text
            await settle(c, lambda: bool(c.prefill.requests("/v1/completions")))
            assert (await client.delete(f"{c.url}/v1/turnkv/sessions/s")).status_code == 200
            await settle(c, lambda: bool(abandoned(c.decode)))
            assert abandoned(c.decode) == sends_to_prefill(c.decode) != []
            # Both leases released too, and the push back's request closed.
            await settle(c, lambda: [e for e in (c.prefill, c.decode)
                                     for s in e.requests("/v1/completions")
                                     if s.body["kv_transfer_params"]["turnkv"].get("release")]
                         == [c.prefill, c.decode])
            await settle(c, lambda: all(e.in_flight == 0 for e in c.router.pool.engines()))

    asyncio.run(main())


@pytest.mark.parametrize("how", ["400", "500"])
def test_a_refused_decode_request_gives_the_prefill_engines_send_up(how: str) -> None:
    """The decode engine refuses a body the prefill engine accepted (the prefill request has
    `max_tokens: 1`; the decode request the client's, which may be over the model's length):
    nobody will register for the prefill engine's send, which would keep the prompt's blocks
    for its whole timeout. The router tells the prefill engine to give it up."""

    async def refuse(engine: StandIn, request: web.Request, body: dict[str, Any]
                     ) -> web.StreamResponse:
        return _ok({"error": {"message": "max_tokens too large"}}, status=int(how))

    async def main() -> None:
        prefill = {"/v1/chat/completions": prefill_ok}
        async with cluster(prefill, {"/v1/chat/completions": refuse}) as c, \
                httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(f"{c.url}/v1/chat/completions",
                                      json=chat(stream=False, session="s"))
            assert reply.status_code == (400 if how == "400" else 503), reply.text
            sent = [s.body["kv_transfer_params"]["turnkv"]["send"]["transfer_id"]
                    for s in c.prefill.requests("/v1/chat/completions")]
            await settle(c, lambda: len(abandoned(c.prefill)) == len(sent))
            assert abandoned(c.prefill) == sent != []
            await settle(c, lambda: all(e.in_flight == 0 for e in c.router.pool.engines()))

    asyncio.run(main())


def test_a_stream_cut_before_its_first_token_gives_the_prefill_engines_send_up() -> None:
    """The decode engine answered with headers but never produced a token (it had not got
    its KV, or the request never reached its engine core) when the client left: it may never
    register for the prefill engine's send, so that send is given up rather than kept for its
    whole timeout."""

    async def waiting_decode(engine: StandIn, request: web.Request, body: dict[str, Any]
                             ) -> web.StreamResponse:
        seen = _seen(engine, request)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:  # no token: waiting for KV
                await asyncio.sleep(CHUNK_EVERY_S)
                await response.write(b": waiting\n\n")
        except ConnectionError:
            seen.closed.set()
        return response

    async def main() -> None:
        async with cluster({"/v1/chat/completions": prefill_ok},
                           {"/v1/chat/completions": waiting_decode}) as c, \
                httpx.AsyncClient(timeout=30) as client:
            async with client.stream("POST", f"{c.url}/v1/chat/completions",
                                     json=chat(stream=True)) as streamed:
                assert streamed.status_code == 200
            sent = [s.body["kv_transfer_params"]["turnkv"]["send"]["transfer_id"]
                    for s in c.prefill.requests("/v1/chat/completions")]
            await settle(c, lambda: abandoned(c.prefill) == sent != [])
            await settle(c, lambda: all(e.in_flight == 0 for e in c.router.pool.engines()))

    asyncio.run(main())


def test_a_prompt_the_engine_cannot_tokenize_is_the_clients_error() -> None:
    """Deciding whether a turn is a short delta asks the decode engine's /tokenize; a prompt it
    refuses (an empty one, say) gets that 4xx, and the engine stays in service."""

    async def tokenize(engine: StandIn, request: web.Request, body: dict[str, Any]
                       ) -> web.StreamResponse:
        if not body.get("messages", [{}])[-1].get("content"):
            return _ok({"error": {"message": "empty prompt"}}, status=400)
        return _ok({"tokens": [7, 8, 9, 10]})

    async def main() -> None:
        prefill = {"/v1/chat/completions": prefill_ok}
        decode = {"/v1/chat/completions": slow_decode, "/tokenize": tokenize}
        async with cluster(prefill, decode, short_delta_tokens=512) as c, \
                httpx.AsyncClient(timeout=30) as client:
            first = await client.post(f"{c.url}/v1/chat/completions",
                                      json=chat(stream=False, session="s"))
            assert first.status_code == 200, first.text
            body = chat(stream=False, session="s")
            body["messages"] = [{"role": "user", "content": ""}]
            reply = await client.post(f"{c.url}/v1/chat/completions", json=body)
            assert reply.status_code == 400, reply.text
            assert "empty prompt" in reply.text
            assert all(e.healthy for e in c.router.pool.engines())
            await settle(c, lambda: all(e.in_flight == 0 for e in c.router.pool.engines()))

    asyncio.run(main())


# -- the ITL target: a short delta the decode engine's other requests would wait too long on --

def conversation_tokens(body: dict[str, Any]) -> list[int]:
    """How the stand-ins render a conversation: "hi" is 3 tokens, a reply the 3 the decode
    stand-in answers, "<n> new" n tokens."""
    tokens: list[int] = []
    for message in body.get("messages") or []:
        content = str(message.get("content"))
        if message.get("role") == "assistant":
            tokens += [1, 2, 3]
        elif content.endswith(" new"):
            tokens += [5] * int(content.split()[0])
        else:
            tokens += [7, 8, 9]
    return tokens


async def tokenize_conversation(engine: StandIn, request: web.Request, body: dict[str, Any]
                                ) -> web.StreamResponse:
    return _ok({"tokens": conversation_tokens(body)})


async def prefill_conversation(engine: StandIn, request: web.Request, body: dict[str, Any]
                               ) -> web.StreamResponse:
    tokens = conversation_tokens(body)
    return _ok({"choices": [{"index": 0, "message": {"content": "t1"}, "token_ids": [1]}],
                "prompt_token_ids": tokens,
                "usage": {"prompt_tokens": len(tokens),
                          "prompt_tokens_details": {"cached_tokens": 0}}})


async def timed_decode(engine: StandIn, request: web.Request, body: dict[str, Any]
                       ) -> web.StreamResponse:
    """`slow_decode`, with the usage and per-request metrics of an engine that holds the
    history up to the last user message and computes that message at 1 ms a token."""
    if body.get("stream"):
        return await slow_decode(engine, request, body)
    _seen(engine, request).ended = True
    messages = body.get("messages") or []
    total = len(conversation_tokens(body))
    computed = len(conversation_tokens({"messages": messages[-1:]}))
    return _ok({"choices": [{"index": 0, "message": {"content": "t1 t2 t3"},
                             "token_ids": [1, 2, 3]}],
                "usage": {"prompt_tokens": total, "completion_tokens": 3,
                          "prompt_tokens_details": {"cached_tokens": total - computed}},
                "metrics": {"time_to_first_token_ms": float(computed), "queue_time_ms": 0.0}})


def test_the_itl_target_sends_a_long_enough_delta_to_the_prefill_engine() -> None:
    """With a 50 ms target and a decode engine measured at 1 ms a token: while another turn
    is decoding there, a delta of 100 tokens (100 ms of its steps) is computed by the prefill
    engine, one of 20 by the decode engine; with the decode engine idle again, 100 stay."""

    async def main() -> None:
        prefill = {"/v1/chat/completions": prefill_conversation}
        decode = {"/v1/chat/completions": timed_decode, "/tokenize": tokenize_conversation}
        async with cluster(prefill, decode, short_delta_tokens=512, itl_target_ms=50.0) as c, \
                httpx.AsyncClient(timeout=30) as client:
            messages: list[dict[str, str]] = []

            async def turn(content: str) -> dict[str, Any]:
                messages.append({"role": "user", "content": content})
                body = {**chat(stream=False, session="s"), "messages": messages}
                reply = await client.post(f"{c.url}/v1/chat/completions", json=body)
                assert reply.status_code == 200, reply.text
                messages.append({"role": "assistant", "content": "t1 t2 t3"})
                stats: dict[str, Any] = reply.json()["turnkv"]
                return stats

            assert (await turn("hi"))["prefill_node"] == "prefill-0"  # a first turn
            # The decode engine is idle: its delta stays, and teaches it 1 ms a token.
            taught = await turn("20 new")
            assert taught["prefill_node"] is None and taught["note"] is None, taught
            assert taught["times"]["engine_prefill_ms"] == 20.0
            async with client.stream("POST", f"{c.url}/v1/chat/completions",
                                     json=chat(stream=True)) as busy:
                # Another turn is decoding on the decode engine. (Its lines are read from one
                # iterator, kept: an iterator left behind is closed, and the stream with it.)
                lines = busy.aiter_lines()
                while not (await anext(lines)).startswith("data: {"):
                    pass
                prefills = len(c.prefill.requests("/v1/chat/completions"))
                long = await turn("100 new")
                assert long["prefill_node"] == "prefill-0", long
                assert "ITL target 50 ms" in long["note"] and "100 tokens" in long["note"]
                assert len(c.prefill.requests("/v1/chat/completions")) == prefills + 1
                short = await turn("20 new")
                assert short["prefill_node"] is None and short["note"] is None, short
            await settle(c, all_over(c))
            idle = await turn("100 new")
            assert idle["prefill_node"] is None and idle["note"] is None, idle
            assert len(c.prefill.requests("/v1/chat/completions")) == prefills + 1
            await settle(c, all_over(c))

    asyncio.run(main())
