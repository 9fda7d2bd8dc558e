"""The router's HTTP front: routes, authentication and reading a request; a turn itself is
`turn.Turns.serve`'s.

Tenants (`tenants`): with API keys configured, a request needs `Authorization: Bearer <key>`,
and each tenant's turns get a `cache_salt`: vLLM hashes it into the first block's hash, so two
tenants never hit each other's cached prefixes even for identical prompts, and timing cannot
reveal another tenant's prompts. Every hint a tenant's clients send (in a turn's tag, or
between turns) is held to the tenant's caps before anything orders leases by it.

The turnkv tag travels in the body (`"turnkv": {...}`) or, for clients that cannot change the
body, in `X-TurnKV-*` headers; `tags` reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from turnkv import protocol as p
from turnkv_server.router.apis.base import Api, Prepared, Resolve
from turnkv_server.router.apis.chat import CHAT, COMPLETIONS
from turnkv_server.router.apis.messages import MESSAGES
from turnkv_server.router.apis.responses import RESPONSES_ERRORS
from turnkv_server.router.apis.responses_state import ResponsesService
from turnkv_server.router.config import RouterConfig
from turnkv_server.router.errors import error_response, install_error_handlers
from turnkv_server.router.inferred_sessions import InferredSessions
from turnkv_server.router.modes import make_mode
from turnkv_server.router.modes.base import ModeContext
from turnkv_server.router.peer_sessions import DialectError
from turnkv_server.router.placement import Engine, EnginePool
from turnkv_server.router.responses_store import ResponsesGauges, responses_store
from turnkv_server.router.session_service import Admission, ClientLeft, SessionService
from turnkv_server.router.session_store import RedisStore, StoreUnavailable
from turnkv_server.router.sessions import LeasePolicy, Session, SessionKey, SessionTable
from turnkv_server.router.stats import RouterMetrics
from turnkv_server.router.tags import BadRequest, Headers, check_supported, read_keys
from turnkv_server.router.tenants import Tenants
from turnkv_server.router.turn import Relayed, TurnFailed, Turns
from turnkv_server.router.upstream import EngineConnectionError, EngineRejected, Upstream

RETRY_AFTER_S = "2"


class Router:
    """The router's state; one instance per app, touched only from the event loop."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pool = EnginePool.from_urls(config.prefill, config.decode, engines=config.engine)
        self.tenants = Tenants(config.api_keys, config.admin_key, caps_for=config.caps_for)
        self.metrics = RouterMetrics()
        self.upstream = Upstream(read_timeout=config.engine_read_timeout)
        table = SessionTable(LeasePolicy(config.default_ttl, config.max_ttl),
                             max_sessions=config.max_sessions)
        self.mode = make_mode(config.mode, ModeContext.of(
            config, self.upstream, self.pool, clock=table.clock,
            count_renewal=self.metrics.count_renewal))
        store = RedisStore(config.redis_url) if config.redis_url else None
        self.admission = Admission(table, config.admission_tokens, config.admission_max_wait_s,
                                   self.metrics)
        self.sessions = SessionService(table, store, on_end=self.mode.drop_session,
                                       on_change=self.admission.recheck,
                                       on_forget=self.mode.forget_session)
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

    async def health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(e) for e in self.pool.engines()))
            self.metrics.sessions.set(len(self.sessions.table))
            await self.sessions.expire()
            await asyncio.sleep(self.config.health_interval)

    async def _probe(self, engine: Engine) -> None:
        try:
            ok = (await self.upstream.get(engine, "/health", timeout=2.0)).status == 200
        except EngineConnectionError:
            ok = False
        engine.healthy = ok
        self.metrics.engine_healthy.labels(engine.name).set(1 if ok else 0)
        if ok and engine.block_size is None:
            with contextlib.suppress(EngineConnectionError, RuntimeError, ValueError):
                cache = await self.upstream.cache_config(engine)
                engine.block_size, engine.kv_tokens = cache.block_size, cache.tokens

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


def create_app(config: RouterConfig) -> FastAPI:
    router = Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        store = router.sessions.store
        if store is not None:
            router.tenants.use_secret(await store.start())
        health = asyncio.create_task(router.health_loop())
        try:
            yield
        finally:
            health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await health
            await router.upstream.close()
            await router.responses.close()
            if store is not None:
                await store.close()

    # No redirects for a trailing slash: a session ID ending in an encoded "/" would be
    # redirected to, and acted on as, another session's route.
    app = FastAPI(title="turnkv router", lifespan=lifespan, redirect_slashes=False)
    app.state.router = router
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        pool = router.pool
        whole = pool.aggregated or any(e.healthy for e in pool.prefill)
        serves = any(e.healthy for e in pool.decode) and (
            whole or router.turns.mode.serves_without_prefill)
        # 200 while turns are served, also by the decode engines alone ("degraded"): a load
        # balancer must not take out a router that still answers.
        status = "ok" if serves and whole else "degraded" if serves else "unavailable"
        return JSONResponse({"status": status, "mode": config.mode},
                            status_code=200 if serves else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        # Turn counts and latencies of every tenant together: for the operator only.
        if not router.tenants.is_admin(request.headers.get("authorization")):
            return error_response(403, "the metrics route needs the admin key")
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if router.tenants.tenant_for(request.headers.get("authorization")) is None:
            return error_response(401, "missing or unknown API key")
        for engine in [e for e in router.pool.decode if e.healthy] or router.pool.decode:
            try:
                upstream = await router.upstream.get(engine, "/v1/models", timeout=5.0)
            except EngineConnectionError:
                continue
            return Response(upstream.content, upstream.status, media_type="application/json")
        return error_response(503, "no decode engine answers",
                              headers={"Retry-After": RETRY_AFTER_S})

    # The turn routes are Starlette's own routes, not FastAPI's: they read the request
    # themselves, and FastAPI's per-request dependency solving and exit stacks were a tenth
    # of the router's CPU per turn.
    async def chat(request: Request) -> Response:
        return await router.serve(request, CHAT)

    async def completions(request: Request) -> Response:
        return await router.serve(request, COMPLETIONS)

    app.add_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])

    # -- the Responses and Messages APIs (`router.apis`) ------------------------------------

    async def responses(request: Request) -> Response:
        return await router.serve(request, RESPONSES_ERRORS, router.responses.resolve)

    app.add_route("/v1/responses", responses, methods=["POST"])

    async def on_stored_response(request: Request, response_id: str,
                                 answer: Callable[[str], Awaitable[Response | None]]
                                 ) -> Response:
        """`answer(tenant)` for a stored response of the request's tenant; None from it: no
        such response (404)."""
        tenant = router.tenants.tenant_for(request.headers.get("authorization"))
        if tenant is None:
            return error_response(401, "missing or unknown API key")
        try:
            answered = await answer(tenant)
        except StoreUnavailable as exc:
            return error_response(503, f"the shared store did not answer: {exc}",
                                  headers={"Retry-After": RETRY_AFTER_S})
        if answered is None:
            return error_response(404, f"no stored response {response_id!r}",
                                  param="response_id")
        return answered

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        async def answer(tenant: str) -> Response | None:
            found = await router.responses.get(tenant, response_id)
            return None if found is None else JSONResponse(found.response)
        return await on_stored_response(request, response_id, answer)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        async def answer(tenant: str) -> Response | None:
            if not await router.responses.delete(tenant, response_id):
                return None
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})
        return await on_stored_response(request, response_id, answer)

    async def messages(request: Request) -> Response:
        return await router.serve(request, MESSAGES)

    app.add_route("/v1/messages", messages, methods=["POST"])

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        """Any decode engine counts (Claude Code asks before it sends a long conversation)."""
        if router.tenants.tenant_of(request.headers, MESSAGES.key_header) is None:
            return MESSAGES.error_response(401, "missing or unknown API key")
        try:
            body = await router._read_body(request)
        except BadRequest as exc:
            return MESSAGES.error_response(exc.status, exc.message)
        for engine in [e for e in router.pool.decode if e.healthy] or router.pool.decode:
            try:
                reply = await router.upstream.post(engine, request.url.path, body, timeout=30.0)
            except EngineConnectionError:
                continue
            return Response(reply.content, reply.status, media_type="application/json")
        return MESSAGES.error_response(503, "no decode engine answers",
                                       headers={"Retry-After": RETRY_AFTER_S})

    async def _session_or_error(request: Request, session_id: str) -> Session | JSONResponse:
        tenant = router.tenants.tenant_for(request.headers.get("authorization"))
        if tenant is None:
            return error_response(401, "missing or unknown API key")
        if not p.is_valid_id(session_id):
            return error_response(400, "invalid session id", param="session_id")
        session = await router.sessions.find(SessionKey(tenant, session_id))
        if session is None:
            return error_response(404, f"no live session {session_id!r}")
        return session

    @app.get("/v1/turnkv/sessions/{session_id}")
    async def get_session(request: Request, session_id: str) -> Response:
        found = await _session_or_error(request, session_id)
        if isinstance(found, Response):
            return found
        return JSONResponse(router.sessions.view(found))

    @app.delete("/v1/turnkv/sessions/{session_id}")
    async def release_session(request: Request, session_id: str) -> Response:
        found = await _session_or_error(request, session_id)
        if isinstance(found, Response):
            return found
        await router.sessions.release(found)
        return JSONResponse({"session_id": session_id, "released": True})

    @app.post("/v1/turnkv/sessions/{session_id}/hints")
    async def session_hints(request: Request, session_id: str) -> Response:
        found = await _session_or_error(request, session_id)
        if isinstance(found, Response):
            return found
        try:
            hints = p.CacheHints.model_validate_json(await request.body())
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "body"
            return error_response(400, f"invalid hints.{where}: {first['msg']}", param=where)
        if hints.final:
            await router.sessions.release(found)
            return JSONResponse({"session_id": session_id, "released": True})
        hints = router.tenants.capped(found.key.tenant, hints)
        await router.sessions.renew(found, hints)
        router.mode.hinted(found, hints)  # the engines' leases too, in the background
        return JSONResponse(router.sessions.view(found))

    @app.get("/v1/turnkv/stats")
    async def stats(request: Request) -> Response:
        if not router.tenants.is_admin(request.headers.get("authorization")):
            return error_response(403, "the stats route needs the admin key")
        table = router.sessions.table
        sessions = list(table)
        return JSONResponse({
            "mode": config.mode,
            "sessions": len(sessions),
            "sessions_expired": table.expired_total,
            "sessions_evicted": table.evicted_total,
            "turns": sum(s.totals.turns for s in sessions),
            "engines": [{"name": e.name, "url": e.url, "healthy": e.healthy,
                         "in_flight": e.in_flight} for e in router.pool.engines()],
            "time": time.time(),
        })

    # Starlette tries the routes in order, and turns are nearly every request: theirs first
    # (no other route's path matches theirs).
    turns = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}
    app.router.routes.sort(key=lambda route: getattr(route, "path", None) not in turns)
    return app
