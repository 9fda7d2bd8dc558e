"""The engines behind the router: which serve a turn (the pool of engines and their placement)
and HTTP to them.

A session's turns stay on the pair that holds its KV while both engines are healthy
and not overloaded; a new session goes where its prefix ID is warm, else to the least loaded
pair. Warmth yields to balance: a shared system prompt is worth a few hundred tokens of
prefill, while the sessions an engine is home to decide how much KV it must hold as they
grow, so a new session leaves its warm engine when that engine is home to more than
`balance_sessions` sessions beyond the lightest one (SGLang's cache-aware router makes the same
trade with its balance thresholds). In the `standard` mode (the baseline) there is no affinity
at all: plain round robin. An `affinity` router's aggregated engines: `aggregated`.

HTTP: aiohttp and orjson rather than httpx and json, for cost: an aiohttp request takes a
fraction of the CPU of an `httpx.AsyncClient` one (docs/architecture.md, "What the router
costs"), and the router makes two or three per turn on cores the engines also need.

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
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import orjson

# "engine": an aggregated engine (affinity mode), which computes prompts and decodes.
Role = Literal["prefill", "decode", "engine"]

PlacementReason = Literal["affinity", "prefix_warm", "least_loaded", "round_robin", "moved",
                          "balanced"]


@dataclass
class Engine:
    name: str
    url: str
    role: Role
    healthy: bool = True
    in_flight: int = 0
    # Of those, the requests that have not sent a byte of their answer yet: prompts it is
    # computing, or queued to (a streamed answer starts with the first token).
    prefilling: int = 0
    answered_at: float = float("-inf")  # when its latest answer began (`time.monotonic`)
    consecutive_failures: int = 0
    # Its KV block size once a health probe has read it (stats explain reuse in whole blocks).
    block_size: int | None = None
    # Its KV cache's capacity in tokens, read with the block size.
    kv_tokens: int | None = None


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
    # A new session leaves its warm engine for the engine home to the fewest live sessions
    # when the warm one is home to more than this many beyond it.
    balance_sessions: int = 1
    _warm_prefixes: OrderedDict[str, tuple[str, str]] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if not self.decode or (not self.prefill and not self.aggregated):
            raise ValueError("the router needs at least one prefill and one decode engine, "
                             "or aggregated engines")
        self._prefill_rr = itertools.cycle(self.prefill)
        # Every engine by name, prefill engines first (the pool's engines never change).
        self.named: dict[str, Engine] = {e.name: e for e in (*self.prefill, *self.decode)}
        self._decode_rr = itertools.cycle(self.decode)

    @property
    def aggregated(self) -> bool:
        """Aggregated engines only (affinity mode): each serves its turns whole."""
        return not self.prefill and all(e.role == "engine" for e in self.decode)

    @classmethod
    def from_urls(cls, prefill: list[str], decode: list[str], max_in_flight: int = 64
                  ) -> EnginePool:
        """Prefill and decode engines (aggregated ones: `aggregated.AggregatedPool`)."""
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
        return self.named.get(name) if name is not None else None

    def round_robin(self) -> Placement:
        return Placement(self._next_healthy(self._prefill_rr, self.prefill),
                         self._next_healthy(self._decode_rr, self.decode), "round_robin")

    def place(
        self, *, prefill: str | None, decode: str | None, prefix_id: str | None,
        homed: Mapping[str, int] | None = None,
    ) -> Placement:
        """Placement for a session turn; ``prefill``/``decode`` are where it ran last;
        ``homed``: how many live sessions each decode (or aggregated) engine is home to."""
        homed = homed or {}
        home_p, home_d = self.by_name(prefill), self.by_name(decode)
        if home_p and home_d and self._usable(home_p) and self._usable(home_d):
            return Placement(home_p, home_d, "affinity")
        had_home = prefill is not None or decode is not None
        balanced = False
        if not had_home and prefix_id and prefix_id in self._warm_prefixes:
            p_name, d_name = self._warm_prefixes[prefix_id]
            warm_p, warm_d = self.by_name(p_name), self.by_name(d_name)
            if warm_p and warm_d and self._usable(warm_p) and self._usable(warm_d):
                if not self._crowded(warm_d, homed):
                    return Placement(warm_p, warm_d, "prefix_warm")
                balanced = True
        p = self._least_loaded(self.prefill, prefer=home_p)
        d = self._least_loaded(self.decode, prefer=home_d, homed=homed)
        return Placement(p, d, "moved" if had_home else "balanced" if balanced
                         else "least_loaded")

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

    def _crowded(self, engine: Engine, homed: Mapping[str, int]) -> bool:
        """Whether `engine` is home to more than `balance_sessions` live sessions beyond the
        healthy engine (of its role) home to the fewest."""
        peers = [e for e in self.decode if e.healthy and self._usable(e)]
        fewest = min((homed.get(e.name, 0) for e in peers), default=0)
        return homed.get(engine.name, 0) > fewest + self.balance_sessions

    def _least_loaded(self, engines: list[Engine], prefer: Engine | None,
                      homed: Mapping[str, int] | None = None) -> Engine:
        # A healthy home engine keeps its role even when its partner moved: it holds KV.
        if prefer is not None and self._usable(prefer):
            return prefer
        healthy = [e for e in engines if e.healthy] or engines
        return min(healthy, key=lambda e: load_of(e, homed or {}))

    @staticmethod
    def _next_healthy(cycle: itertools.cycle[Engine], engines: list[Engine]) -> Engine:
        for _ in range(len(engines)):
            engine = next(cycle)
            if engine.healthy:
                return engine
        return next(cycle)


def load_of(engine: Engine, homed: Mapping[str, int]) -> tuple[int, int]:
    """Turns in flight first (now), then the live sessions it is home to (what it will hold)."""
    return engine.in_flight, homed.get(engine.name, 0)


# -- HTTP to the engines ---------------------------------------------------------------------
JSON_HEADERS = {"Content-Type": "application/json"}


class EngineConnectionError(Exception):
    """The engine could not be reached, or the connection broke mid-response."""

    def __init__(self, engine: Engine, detail: str) -> None:
        super().__init__(detail)
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
    """A response whose headers are in and whose body the caller reads and closes. It owns
    the engine request: the in-flight count taken when it was sent goes back at `close()`."""

    def __init__(self, response: aiohttp.ClientResponse, engine: Engine,
                 computed: bool = True) -> None:
        self._response = response
        self.engine = engine
        self.status = response.status
        self.closed = False
        self._prefilling = computed  # in `engine.prefilling` until its answer begins

    def _answer_began(self) -> None:
        if self._prefilling:
            self._prefilling = False
            self.engine.prefilling -= 1
            self.engine.answered_at = time.monotonic()

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
        # Closing early drops the connection: vLLM aborts the request and frees its KV.
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
        computed = not path.endswith("tokenize")  # its steps' (a /tokenize is its server's)
        engine.in_flight += 1
        engine.prefilling += int(computed)
        try:
            response = await self._http().post(
                f"{engine.url}{path}", data=orjson.dumps(body),
                headers={**JSON_HEADERS, **(headers or {})}, timeout=_timeout(timeout))
        except BaseException as exc:
            # aiohttp closes the connection of a request it did not finish.
            engine.in_flight -= 1
            engine.prefilling -= int(computed)
            if isinstance(exc, (aiohttp.ClientError, asyncio.TimeoutError)):
                raise EngineConnectionError(engine, _describe(exc)) from exc
            raise
        return Stream(response, engine, computed=computed)

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
