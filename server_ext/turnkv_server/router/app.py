"""The router's HTTP front: its state, the turns' routes, authentication and reading a request;
a turn itself is `turn.Turns.serve`'s, the other routes are `routes`'.

Tenants (`tenants`): with API keys configured, a request needs `Authorization: Bearer <key>`,
and each tenant's turns get a `cache_salt`: vLLM hashes it into the first block's hash, so two
tenants never hit each other's cached prefixes even for identical prompts, and timing cannot
reveal another tenant's prompts. Every hint a tenant's clients send (in a turn's tag, or
between turns) is held to the tenant's caps before anything orders leases by it.

A request's keys: turnkv's own tag (the body's `turnkv` field, the `X-TurnKV-*`
headers under it), then the session keys of other stacks in one order (docs/protocol.md,
"Session keys"): Dynamo's, vLLM's, the Responses lineage, the coding agents' headers
(`peer_sessions`), Codex's `prompt_cache_key`. A request none of them names is left
to the content (`inferred_sessions`). And what the router refuses to serve.

The turnkv tag wins field by field; the first key that names a session names it, and the
tag's hints go with that session. Either way the tag is validated by the same pydantic models
the SDK uses, and every key is removed before the request reaches an engine.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from starlette.types import Message, Receive, Scope, Send

from turnkv import protocol as p
from turnkv_server.router.admission import Admission, ClientLeft
from turnkv_server.router.aggregated import engine_pool
from turnkv_server.router.apis.base import Api, Prepared, Resolve
from turnkv_server.router.apis.chat import CHAT, COMPLETIONS
from turnkv_server.router.apis.messages import MESSAGES
from turnkv_server.router.apis.responses import RESPONSES_ERRORS
from turnkv_server.router.apis.responses_state import ResponsesService
from turnkv_server.router.config import RouterConfig
from turnkv_server.router.engines import EngineRejected, Upstream
from turnkv_server.router.errors import (
    RETRY_AFTER_S,
    BadRequest,
    install_error_handlers,
    internal_error,
)
from turnkv_server.router.inferred_sessions import InferredSessions
from turnkv_server.router.modes import make_mode
from turnkv_server.router.modes.base import ModeContext
from turnkv_server.router.peer_sessions import (
    BODY_FIELDS,
    HEADER_FIELDS,
    DialectError,
    Dialects,
    PeerSessions,
    foreign_id,
    read_dialects,
    read_peer_sessions,
)
from turnkv_server.router.responses_store import ResponsesGauges, responses_store
from turnkv_server.router.routes import add_routes, upkeep
from turnkv_server.router.session_store import RedisStore, StoredSessions, StoreUnavailable
from turnkv_server.router.sessions import LeasePolicy, SessionService, SessionTable
from turnkv_server.router.stats import RouterMetrics
from turnkv_server.router.tenants import DEFAULT_TENANT, Tenants
from turnkv_server.router.turn import Relayed, TurnFailed, Turns

# What a request without peers' fields names by them: nothing.
NO_DIALECTS, NO_PEERS = Dialects(), PeerSessions()

_HEADER_FIELDS: dict[str, tuple[str, ...]] = {name.lower(): path for name, path in {
    p.HEADER_SESSION: ("session_id",),
    p.HEADER_TURN: ("turn",),
    p.HEADER_PREFIX: ("prefix_id",),
    p.HEADER_TTL: ("hints", "ttl"),
    p.HEADER_NEXT_TURN_IN: ("hints", "next_turn_in"),
    p.HEADER_FINAL: ("hints", "final"),
    p.HEADER_PRIORITY: ("hints", "priority"),
}.items()}


class Headers(dict[str, str]):
    """A request's headers, read once: each name's first value, under the name in lower case,
    where its readers look it up (`dict.get`, in C: a turn looks up a dozen names among its
    keys, and Starlette's own mapping scans every header for each)."""

    @classmethod
    def of_raw(cls, raw: list[tuple[bytes, bytes]]) -> Headers:
        # Reversed: a name sent twice keeps its first value, as Starlette's `get` does.
        return cls({name.decode("latin-1").lower(): value.decode("latin-1")
                    for name, value in reversed(raw)})

    @classmethod
    def of(cls, headers: Mapping[str, str]) -> Headers:
        """`headers` under lower-case names (a caller's mapping of any case)."""
        if isinstance(headers, Headers):
            return headers
        return cls({name.lower(): value for name, value in headers.items()})


@dataclass(frozen=True)
class RequestKeys:
    """What a request names: its tag (the session and hints, from whichever key named it),
    which key that was, and for a request with no session the prefix that places it."""

    tag: p.TurnTag | None
    source: p.SessionSource | None  # None: no key named a session
    prefix_id: str | None  # a sessionless request's (`prompt_cache_key`)
    # turnkv's own tag came (the body's field or an `X-TurnKV-*` header): its client reads
    # the stats chunk of a stream.
    native: bool = False
    # `prompt_cache_retention: 24h`: the TTL asked for, for a session named later (inferred).
    retention_ttl: float | None = None


def extract_tag(body: dict[str, Any], headers: Mapping[str, str],
                tenant: str = DEFAULT_TENANT) -> p.TurnTag | None:
    """Pop the tag from ``body`` (mutates it), merge the headers under it and peers' keys
    under both; raises `DialectError` for a peer's field it cannot read."""
    return read_keys(body, headers, tenant).tag


def read_keys(body: dict[str, Any], headers: Mapping[str, str],
              tenant: str = DEFAULT_TENANT, lineage: str | None = None) -> RequestKeys:
    """The request's keys, in the documented order (docs/protocol.md, "Session keys"); pops
    every one from `body` (mutates it). `lineage`: the session a chain of Responses names (its
    root response's ID, or its `conversation`), from the Responses route; None elsewhere."""
    headers = Headers.of(headers)
    raw = body.pop("turnkv", None)
    if raw is not None and not isinstance(raw, dict):
        raise BadRequest("'turnkv' must be an object", param="turnkv")
    merged: dict[str, Any] = {}
    for header, path in _HEADER_FIELDS.items():
        value = headers.get(header)
        if value is None:
            continue
        target = merged
        for part in path[:-1]:
            target = target.setdefault(part, {})
        target[path[-1]] = value
    if raw:
        for key, value in raw.items():
            if key == "hints" and isinstance(value, dict):
                merged.setdefault("hints", {}).update(value)
            else:
                merged[key] = value
    native = bool(merged)
    # Peers' fields are read where the request carries one: most carry none. (Codex's
    # `originator` and `User-Agent` alone name nothing: they say what its cache key is.)
    peered = not (BODY_FIELDS.isdisjoint(body) and HEADER_FIELDS.isdisjoint(headers))
    dialects = read_dialects(body, headers, tenant) if peered else NO_DIALECTS
    peers = read_peer_sessions(body, headers) if peered else NO_PEERS
    source: p.SessionSource | None = "tag" if "session_id" in merged else None
    if source is None:
        # Codex sends its conversation ID as the key; anyone else's names a shared prefix.
        codex_key = foreign_id(dialects.cache_key) if peers.from_codex and dialects.cache_key \
            else None
        named: tuple[tuple[p.SessionSource, str | None], ...] = (
            ("dynamo", dialects.session_id), ("vllm", peers.vllm),
            ("lineage", foreign_id(lineage) if lineage else None), ("agent", peers.agent),
            ("prompt_cache_key", codex_key))
        source, session_id = next(((s, i) for s, i in named if i is not None), (None, None))
        if session_id is not None:
            merged["session_id"] = session_id
    if peered:
        merged = dialects.under(merged)
    if not merged:
        return RequestKeys(None, None, dialects.prefix_id, retention_ttl=peers.retention_ttl)
    if peers.retention_ttl is not None and "session_id" in merged \
            and isinstance(merged.get("hints", {}), dict):
        merged["hints"] = {"ttl": peers.retention_ttl, **merged.get("hints", {})}
    try:
        return RequestKeys(p.TurnTag.model_validate(merged), source, None, native,
                           peers.retention_ttl)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise BadRequest(f"invalid turnkv.{where}: {first['msg']}",
                         param=f"turnkv.{where}") from exc


def check_supported(body: dict[str, Any]) -> None:
    n = body.get("n", 1)
    if n not in (1, None):
        raise BadRequest("n > 1 is not supported: each choice would need its own KV transfer",
                         param="n")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        # vLLM serves a list of prompts as one request per prompt, all with the same
        # kv_transfer_params: they would share one KV transfer.
        raise BadRequest("a batch of prompts is not supported: send one request per prompt",
                         param="prompt")
    if "kv_transfer_params" in body:
        raise BadRequest("kv_transfer_params is set by the router, not by clients",
                         param="kv_transfer_params")
    for name in ("model", "cache_salt"):
        if not isinstance(body.get(name, ""), str):
            raise BadRequest(f"{name} must be a string", param=name)


class Router:
    """The router's state; one instance per app, touched only from the event loop."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pool = engine_pool(config.prefill, config.decode, engines=config.engine)
        self.tenants = Tenants(config.api_keys, config.admin_key, caps_for=config.caps_for)
        self.metrics = RouterMetrics()
        self.upstream = Upstream(read_timeout=config.engine_read_timeout)
        table = SessionTable(LeasePolicy(config.default_ttl, config.max_ttl),
                             max_sessions=config.max_sessions)
        self.mode = make_mode(config.mode, ModeContext.of(
            config, self.upstream, self.pool, clock=table.clock,
            count_renewal=self.metrics.count_renewal))
        self.store = RedisStore(config.redis_url) if config.redis_url else None
        self.admission = None if config.admission_tokens is None else Admission(
            table, config.admission_tokens, config.admission_max_wait_s, self.metrics)
        hooks = (self.mode.drop_session, self.admission.recheck if self.admission else None,
                 self.mode.forget_session)
        self.sessions = SessionService(table, *hooks) if self.store is None else \
            StoredSessions(table, self.store, *hooks)
        # Boundaries of every live session's conversation and a few of their forks, on the
        # session table's clock, for as long as the longest lease.
        self.inferred = None if config.no_inferred_sessions else InferredSessions(
            4 * config.max_sessions, config.max_ttl, table.clock,
            on_infer=self.metrics.count_inferred)
        self.responses = ResponsesService(responses_store(config))
        self.metrics.registry.register(ResponsesGauges(self.responses.store))
        self.turns = Turns(pool=self.pool, mode=self.mode, mode_name=config.mode,
                           upstream=self.upstream, sessions=self.sessions,
                           admission=self.admission, metrics=self.metrics,
                           retries=config.retries, inferred=self.inferred)

    async def serve(self, request: Request, api: Api, resolve: Resolve | None = None
                    ) -> Response:
        """A turn that came in on `api`; `resolve` (an API's with state of its own) reads that
        state before the request's keys are read (the session its lineage names is one of
        them) and makes the request one turn of its API after. Errors come in the API's
        shape."""
        headers = Headers.of_raw(request.headers.raw)
        tenant = self.tenants.sole_tenant or self.tenants.tenant_of(headers, api.key_header)
        if tenant is None:
            return api.error_response(401, "missing or unknown API key")
        try:
            body = await self._read_body(request)
            resolved = await resolve(body, tenant) if resolve is not None else None
            keys = read_keys(body, headers, tenant,
                             lineage=resolved.lineage if resolved is not None else None)
            check_supported(body)
        except (BadRequest, DialectError) as exc:
            self.metrics.errors.labels(str(exc.status)).inc()
            return api.error_response(exc.status, exc.message, param=exc.param)
        except StoreUnavailable as exc:
            self.metrics.errors.labels("503").inc()
            return api.error_response(503, f"the shared store did not answer: {exc}",
                                      headers={"Retry-After": RETRY_AFTER_S})
        tag, source, ticket = keys.tag, keys.source, None
        if tag is None and self.inferred is not None:
            # No key names a session: a conversation this router served may (its content).
            found = self.inferred.infer_turn(api.path, body, tenant, keys.prefix_id,
                                             keys.retention_ttl)
            tag, ticket = found if found is not None else (None, None)
            source = "inferred" if tag is not None else None
        if self.tenants.caps_hints:
            tag = self.tenants.capped_tag(tenant, tag)
        prepared = (Prepared(api, body, tag, keys.prefix_id) if resolved is None
                    else resolved.prepare(body, tag, keys.prefix_id))
        body = prepared.body
        if self.tenants.enforced:
            body["cache_salt"] = self.tenants.cache_salt(tenant, body.get("cache_salt"))
        try:
            answer = await self.turns.serve(prepared.api, body, prepared.tag, tenant,
                                            prepared.prefix_id, gone=lambda: disconnected(request),
                                            home=prepared.home, source=source,
                                            inferred_ticket=ticket, stats_in_stream=keys.native)
            return answer if isinstance(answer, Response) else RelayResponse(answer)
        except ClientLeft:
            return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
        except TurnFailed as exc:
            self.metrics.errors.labels("503").inc()
            return api.error_response(503, str(exc), headers={"Retry-After": RETRY_AFTER_S})
        except EngineRejected as exc:
            self.metrics.errors.labels(str(exc.status)).inc()
            return prepared.api.rejected(exc.status, exc.content)

    async def _read_body(self, request: Request) -> dict[str, Any]:
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > self.config.max_body_bytes:
            raise BadRequest(f"request body over {self.config.max_body_bytes} bytes", status=413)
        # A chunked body has no length to check first: read it, up to the limit.
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.config.max_body_bytes:
                raise BadRequest(f"request body over {self.config.max_body_bytes} bytes",
                                 status=413)
            chunks.append(chunk)
        try:
            body = orjson.loads(b"".join(chunks))
        except ValueError as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body


class RelayResponse(StreamingResponse):
    """A streamed turn's response, which ends its relay (`Relayed.on_end`) however it ends."""

    def __init__(self, relayed: Relayed) -> None:
        super().__init__(relayed.body, media_type="text/event-stream", headers=relayed.headers)
        self._on_end = relayed.on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()


async def disconnected(request: Request) -> None:
    """Returns once the client has closed its connection: its body has been read whole, so the
    next ASGI message is the disconnect. (uvicorn cancels no handler whose client has gone: a
    turn waiting for admission would wait on, and then be served to nobody.)"""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class RouterApp(FastAPI):
    """The router's ASGI app: FastAPI, with a turn's POST served ahead of its middleware stack
    and route matching. Turns are nearly every request, and Starlette's error and exception
    middleware and FastAPI's exit stack are calls each turn pays for little; the turn routes
    answer their failures in the API's shape themselves, so all those layers add to a turn
    is the answer to what the router did not expect, which `_serve_turn` gives the same way.
    Any other request (another method on a turn's path included) goes through FastAPI."""

    turn_routes: dict[str, Callable[[Request], Awaitable[Response]]]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.turn_routes.get(scope["path"])
            if endpoint is not None:
                await _serve_turn(self, endpoint, scope, receive, send)
                return
        await super().__call__(scope, receive, send)


async def _serve_turn(app: RouterApp, endpoint: Callable[[Request], Awaitable[Response]],
                      scope: Scope, receive: Receive, send: Send) -> None:
    scope["app"] = app
    started = False

    async def send_noting_start(message: Message) -> None:
        nonlocal started
        started = started or message["type"] == "http.response.start"
        await send(message)

    try:
        response = await endpoint(Request(scope, receive, send))
        await response(scope, receive, send_noting_start)
    except Exception as exc:
        # As Starlette's error middleware does: a 500 in the API's shape if nothing was sent
        # yet, and the exception raised on for the server to log.
        if not started:
            await internal_error(scope["path"], exc)(scope, receive, send)
        raise


def create_app(config: RouterConfig) -> RouterApp:
    router = Router(config)
    # No redirects for a trailing slash: a session ID ending in an encoded "/" would be
    # redirected to, and acted on as, another session's route.
    app = RouterApp(title="turnkv router", lifespan=lambda _: upkeep(router),
                    redirect_slashes=False)
    app.state.router = router
    install_error_handlers(app)

    # The turn routes read the request themselves: no FastAPI dependencies to solve.
    async def chat(request: Request) -> Response:
        return await router.serve(request, CHAT)

    async def completions(request: Request) -> Response:
        return await router.serve(request, COMPLETIONS)

    async def responses(request: Request) -> Response:
        return await router.serve(request, RESPONSES_ERRORS, router.responses.resolve)

    async def messages(request: Request) -> Response:
        return await router.serve(request, MESSAGES)

    app.turn_routes = {"/v1/chat/completions": chat, "/v1/completions": completions,
                       "/v1/responses": responses, "/v1/messages": messages}
    # Registered as routes too, so that another method on their paths is a 405, not a 404.
    for path, endpoint in app.turn_routes.items():
        app.add_route(path, endpoint, methods=["POST"])
    add_routes(app, router)
    return app
