"""The engines behind the router: which prefill/decode pair serves a turn, and HTTP to them.

Placement: a session's turns stay on the pair that holds its KV while both engines are healthy
and not overloaded; a new session goes where its prefix ID is warm, else to the least loaded
pair. In the `standard` mode (the baseline) there is no affinity at all: plain round robin.
An `affinity` router's pool has no prefill engines, only aggregated ones that serve turns
whole: its "pair" is one engine in both places, placed the same way.

HTTP: aiohttp rather than httpx here, for cost: on this project's 2-core test machine an
`httpx.AsyncClient` request to a local server took 2.6 ms of CPU, aiohttp 0.5 ms
(scratch measurement, 1,000 requests each), and the router makes two or three of them per
turn on cores the engines also need. JSON goes through orjson for the same reason.

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
import itertools
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import orjson

from turnkv_server.engine.metrics import parse_cache_config
from turnkv_server.engine.requests import tokenize_request

# "engine": an aggregated engine (affinity mode), which computes prompts and decodes.
Role = Literal["prefill", "decode", "engine"]

PlacementReason = Literal["affinity", "prefix_warm", "least_loaded", "round_robin", "moved"]


@dataclass
class Engine:
    name: str
    url: str
    role: Role
    healthy: bool = True
    in_flight: int = 0
    consecutive_failures: int = 0
    # Its KV block size once a health probe has read it (stats explain reuse in whole blocks).
    block_size: int | None = None


@dataclass(frozen=True)
class Placement:
    prefill: Engine
    decode: Engine
    reason: PlacementReason


@dataclass
class EnginePool:
    prefill: list[Engine]
    decode: list[Engine]
    # A pair is overloaded when one of its engines has this many turns in flight.
    max_in_flight: int = 64
    max_prefixes: int = 4096
    _warm_prefixes: OrderedDict[str, tuple[str, str]] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if not self.decode or (not self.prefill and not self.aggregated):
            raise ValueError("the router needs at least one prefill and one decode engine, "
                             "or aggregated engines")
        self._prefill_rr = itertools.cycle(self.prefill)
        self._decode_rr = itertools.cycle(self.decode)
        # Ties of least loaded aggregated engines go round: sessions that arrive while every
        # engine is idle spread instead of piling onto the first (a session stays for good).
        self._tie_rr = itertools.count()

    @property
    def aggregated(self) -> bool:
        """Aggregated engines only (affinity mode): each serves its turns whole."""
        return not self.prefill and all(e.role == "engine" for e in self.decode)

    @classmethod
    def from_urls(cls, prefill: list[str], decode: list[str], max_in_flight: int = 64,
                  engines: list[str] | None = None) -> EnginePool:
        """`engines`: aggregated engines (affinity mode), instead of prefill and decode ones;
        they serve turns where a decode engine serving alone would."""
        if engines:
            if prefill or decode:
                raise ValueError("aggregated engines go without prefill and decode engines")
            return cls(prefill=[], decode=[Engine(f"engine-{i}", u.rstrip("/"), "engine")
                                           for i, u in enumerate(engines)],
                       max_in_flight=max_in_flight)
        return cls(
            prefill=[Engine(f"prefill-{i}", u.rstrip("/"), "prefill")
                     for i, u in enumerate(prefill)],
            decode=[Engine(f"decode-{i}", u.rstrip("/"), "decode")
                    for i, u in enumerate(decode)],
            max_in_flight=max_in_flight,
        )

    def engines(self) -> list[Engine]:
        return [*self.prefill, *self.decode]

    def by_name(self, name: str | None) -> Engine | None:
        return next((e for e in self.engines() if e.name == name), None)

    def round_robin(self) -> Placement:
        if self.aggregated:
            engine = self._next_healthy(self._decode_rr, self.decode)
            return Placement(engine, engine, "round_robin")
        return Placement(self._next_healthy(self._prefill_rr, self.prefill),
                         self._next_healthy(self._decode_rr, self.decode), "round_robin")

    def place(
        self, *, prefill: str | None, decode: str | None, prefix_id: str | None
    ) -> Placement:
        """Placement for a session turn; ``prefill``/``decode`` are where it ran last."""
        if self.aggregated:
            return self._place_alone(decode, prefix_id)
        home_p, home_d = self.by_name(prefill), self.by_name(decode)
        if home_p and home_d and self._usable(home_p) and self._usable(home_d):
            return Placement(home_p, home_d, "affinity")
        had_home = prefill is not None or decode is not None
        if not had_home and prefix_id and prefix_id in self._warm_prefixes:
            p_name, d_name = self._warm_prefixes[prefix_id]
            warm_p, warm_d = self.by_name(p_name), self.by_name(d_name)
            if warm_p and warm_d and self._usable(warm_p) and self._usable(warm_d):
                return Placement(warm_p, warm_d, "prefix_warm")
        p = self._least_loaded(self.prefill, prefer=home_p)
        d = self._least_loaded(self.decode, prefer=home_d)
        return Placement(p, d, "moved" if had_home else "least_loaded")

    def _place_alone(self, home_name: str | None, prefix_id: str | None) -> Placement:
        """An aggregated engine for a session turn: its home while usable (its prefix cache
        holds the session), else where its prefix ID is warm (a new session), else the least
        loaded engine."""
        home = self.by_name(home_name)
        if home is not None and self._usable(home):
            return Placement(home, home, "affinity")
        if home_name is None and prefix_id and prefix_id in self._warm_prefixes:
            warm = self.by_name(self._warm_prefixes[prefix_id][1])
            if warm is not None and self._usable(warm):
                return Placement(warm, warm, "prefix_warm")
        healthy = [e for e in self.decode if e.healthy] or self.decode
        least = min(e.in_flight for e in healthy)
        tied = [e for e in healthy if e.in_flight == least]
        engine = tied[next(self._tie_rr) % len(tied)]
        return Placement(engine, engine, "moved" if home_name is not None else "least_loaded")

    def unhealthy(self, *names: str | None) -> list[str]:
        """Those of the named engines that are down, each once (an affinity session names its
        engine twice)."""
        return [e.name for e in map(self.by_name, dict.fromkeys(names))
                if e is not None and not e.healthy]

    def remember_prefix(self, prefix_id: str, placement: Placement) -> None:
        self._warm_prefixes[prefix_id] = (placement.prefill.name, placement.decode.name)
        self._warm_prefixes.move_to_end(prefix_id)
        while len(self._warm_prefixes) > self.max_prefixes:
            self._warm_prefixes.popitem(last=False)

    def _usable(self, engine: Engine) -> bool:
        return engine.healthy and engine.in_flight < self.max_in_flight

    def _least_loaded(self, engines: list[Engine], prefer: Engine | None) -> Engine:
        # A healthy home engine keeps its role even when its partner moved: it holds KV.
        if prefer is not None and self._usable(prefer):
            return prefer
        healthy = [e for e in engines if e.healthy] or engines
        return min(healthy, key=lambda e: e.in_flight)

    @staticmethod
    def _next_healthy(cycle: itertools.cycle[Engine], engines: list[Engine]) -> Engine:
        for _ in range(len(engines)):
            engine = next(cycle)
            if engine.healthy:
                return engine
        return next(cycle)


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

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EngineConnectionError(self.engine, _describe(exc)) from exc

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's lines, without their line ends. No line-length limit: a stream's first
        chunk carries the prompt's token IDs, which can be long."""
        pending = b""
        try:
            async for data in self._response.content.iter_any():
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
        async for line in self.lines():
            if line.startswith(b"data:"):
                yield line[5:].strip()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # Closing before the end drops the connection, which makes vLLM abort the request
        # and free its KV.
        self._response.close()
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
        try:
            response = await self._http().post(
                f"{engine.url}{path}", data=orjson.dumps(body),
                headers={**JSON_HEADERS, **(headers or {})}, timeout=_timeout(timeout))
        except BaseException as exc:
            # aiohttp closes the connection of a request it did not finish.
            engine.in_flight -= 1
            if isinstance(exc, (aiohttp.ClientError, asyncio.TimeoutError)):
                raise EngineConnectionError(engine, _describe(exc)) from exc
            raise
        return Stream(response, engine)

    async def tokenize(self, engine: Engine, body: dict[str, Any]) -> list[int]:
        """The prompt of a turn's `body` as `engine` will see it (chat template applied)."""
        response = await self.post(engine, "/tokenize", tokenize_request(body), timeout=30.0)
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
        reply = await self.get(engine, "/metrics", timeout=10.0)
        size = parse_cache_config(reply.content.decode()).block_size
        if size is None:
            raise RuntimeError(f"{engine.name} does not report its block size")
        return size

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
