"""The engines behind the router: HTTP to them. Which engines serve a turn is `placement`.

HTTP: aiohttp rather than httpx here, for cost: an aiohttp request takes a fraction of the
CPU of an `httpx.AsyncClient` one (docs/architecture.md, "What the router costs"), and the
router makes two or three of them per turn on cores the engines also need. JSON goes through
orjson for the same reason.

Everything that means "the engine could not be reached or broke the connection" (refused,
reset, a timeout, a truncated body) is raised as one exception, `EngineConnectionError`, naming
the engine, so that the turn pipeline has one test for an unavailable engine.

Every request to an engine (`open`, `post`) is owned by its `Stream` from the moment it is sent
until the Stream is closed: meanwhile it counts in the engine's `in_flight`, which placement
reads to steer turns away from busy engines. `close()` ends the request and that count exactly
once, whoever calls it and however often, so every path (a whole reply, a cut stream, an
error, a cancelled task) only has to make sure the Stream is closed. GETs (health probes,
/metrics, /v1/models) are not engine work and are not counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from turnkv_server.engine.metrics import CacheConfig, parse_cache_config
from turnkv_server.router.placement import Engine

JSON_HEADERS = {"Content-Type": "application/json"}


class EngineConnectionError(Exception):
    """The engine could not be reached, or the connection broke mid-response."""

    def __init__(self, engine: Engine, detail: str) -> None:
        super().__init__(detail)
        self.engine = engine


class EngineUnavailable(Exception):
    """The engine cannot serve the turn now (unreachable, or a 5xx): it is taken out of
    service and the turn replayed elsewhere."""

    def __init__(self, engine: Engine, detail: str) -> None:
        super().__init__(f"{engine.name} ({engine.url}) unavailable: {detail}")
        self.engine = engine


class EngineRejected(Exception):
    """The engine answered with a client error: the request was bad, not the engine. The
    turn passes the answer through unchanged."""

    def __init__(self, status: int, content: bytes) -> None:
        super().__init__(f"engine answered {status}")
        self.status = status
        self.content = content


@dataclass
class Reply:
    """A whole response."""

    status: int
    content: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def json(self) -> Any:
        return orjson.loads(self.content)


@dataclass(frozen=True)
class SseEvent:
    """One server-sent event: its name (`event:`), if any, and its data."""

    name: bytes | None
    data: bytes

    def encode(self) -> bytes:
        head = b"event: " + self.name + b"\n" if self.name else b""
        return head + b"data: " + self.data + b"\n\n"


class Stream:
    """A response whose headers are in and whose body is read by the caller, who closes it.

    It owns the engine request: the engine's in-flight count taken when the request was sent
    is given back by the first `close()`.
    """

    def __init__(self, response: aiohttp.ClientResponse, engine: Engine) -> None:
        self._response = response
        self.engine = engine
        self.status = response.status
        self.closed = False
        self._prefilling = True  # counted in `engine.prefilling` until the answer begins

    def _answer_began(self) -> None:
        if self._prefilling:
            self._prefilling = False
            self.engine.prefilling -= 1

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EngineConnectionError(self.engine, _describe(exc)) from exc
        finally:
            self._answer_began()

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's lines, without their line ends. No line-length limit: a stream's first
        chunk carries the prompt's token IDs, which can be long."""
        pending = b""
        try:
            async for data in self._response.content.iter_any():
                self._answer_began()
                pending += data
                *complete, pending = pending.split(b"\n")
                for line in complete:
                    yield line.rstrip(b"\r")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EngineConnectionError(self.engine, _describe(exc)) from exc
        if pending:
            yield pending

    async def events(self) -> AsyncIterator[bytes]:
        """The `data:` payloads of an SSE body, in order."""
        async for event in self.sse():
            yield event.data

    async def sse(self) -> AsyncIterator[SseEvent]:
        """The events of an SSE body, in order, each with its `event:` name if it has one (the
        Responses and Messages APIs name theirs; Anthropic's clients dispatch on the name)."""
        name: bytes | None = None
        data: list[bytes] = []
        async for line in self.lines():
            if not line:
                if data:
                    yield SseEvent(name, b"\n".join(data))
                name, data = None, []
            elif line.startswith(b"data:"):
                data.append(line[5:].strip())
            elif line.startswith(b"event:"):
                name = line[6:].strip()
        if data:
            yield SseEvent(name, b"\n".join(data))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # Closing before the end drops the connection, which makes vLLM abort the request
        # and free its KV.
        self._response.close()
        self._answer_began()
        self.engine.in_flight -= 1


class Upstream:
    """One connection pool to every engine; created in the event loop on first use."""

    def __init__(self, connect_timeout: float = 5.0, max_connections: int = 1024,
                 read_timeout: float | None = None) -> None:
        self._connect_timeout = connect_timeout
        # The longest an engine may go without sending a byte: a hung engine (stopped, or
        # wedged) fails the turn instead of holding it forever.
        self._read_timeout = read_timeout
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout,
                                              sock_read=self._read_timeout),
                # Engine responses are passed on as they are; no cookies between tenants.
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    async def post(self, engine: Engine, path: str, body: dict[str, Any], *,
                   headers: dict[str, str] | None = None, timeout: float | None = None) -> Reply:
        """POST a JSON body to `engine` and read the whole reply."""
        stream = await self.open(engine, path, body, headers=headers, timeout=timeout)
        try:
            return Reply(stream.status, await stream.read())
        finally:
            stream.close()

    async def get(self, engine: Engine, path: str, *, timeout: float | None = None) -> Reply:
        try:
            async with self._http().get(f"{engine.url}{path}",
                                        timeout=_timeout(timeout)) as response:
                return Reply(response.status, await response.read())
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EngineConnectionError(engine, _describe(exc)) from exc

    async def open(self, engine: Engine, path: str, body: dict[str, Any], *,
                   headers: dict[str, str] | None = None,
                   timeout: float | None = None) -> Stream:
        """POST a JSON body to `engine`; returns once the response headers are in. The caller
        owns the returned Stream and must close it; a request that fails (or is cancelled)
        before its headers are in is over when this raises."""
        engine.in_flight += 1
        engine.prefilling += 1
        try:
            response = await self._http().post(
                f"{engine.url}{path}", data=orjson.dumps(body),
                headers={**JSON_HEADERS, **(headers or {})}, timeout=_timeout(timeout))
        except BaseException as exc:
            # aiohttp closes the connection of a request it did not finish.
            engine.in_flight -= 1
            engine.prefilling -= 1
            if isinstance(exc, (aiohttp.ClientError, asyncio.TimeoutError)):
                raise EngineConnectionError(engine, _describe(exc)) from exc
            raise
        return Stream(response, engine)

    async def tokenize(self, engine: Engine, request: dict[str, Any]) -> list[int]:
        """The prompt of a `/tokenize` request (`engine.requests.tokenize_request`) as `engine`
        will see it (chat template applied)."""
        response = await self.post(engine, "/tokenize", request, timeout=30.0)
        if 400 <= response.status < 500:
            # A prompt the engine cannot render (an empty one, say) is the client's to fix: the
            # same 4xx a whole turn would get, never an engine taken for unavailable.
            raise EngineRejected(response.status, response.content)
        if not response.ok:
            raise EngineConnectionError(
                engine, f"{engine.name} /tokenize answered {response.status}")
        return list(response.json()["tokens"])

    async def block_size(self, engine: Engine) -> int:
        """The engine's KV block size, from its `/metrics`."""
        size = (await self.cache_config(engine)).block_size
        if size is None:
            raise RuntimeError(f"{engine.name} does not report its block size")
        return size

    async def cache_config(self, engine: Engine) -> CacheConfig:
        """The engine's KV cache settings (block size, blocks), from its `/metrics`."""
        reply = await self.get(engine, "/metrics", timeout=10.0)
        return parse_cache_config(reply.content.decode())

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _timeout(seconds: float | None) -> aiohttp.ClientTimeout | Any:
    # aiohttp's sentinel keeps the session's own timeout when none is given.
    return aiohttp.ClientTimeout(total=seconds) if seconds is not None else aiohttp.helpers.sentinel


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
