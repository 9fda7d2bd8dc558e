"""The router's routes other than a turn's (those are `app`'s): its health (and the loop that
probes the engines for it), metrics and engines' models, the Responses API's stored responses,
the Messages API's token count, a session's view, release and hints between turns, and the
operator's stats. Each authenticates its own caller
(`tenants`); the admin routes need the admin key.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from turnkv import protocol as p
from turnkv_server.router.apis.messages import MESSAGES
from turnkv_server.router.apis.responses_state import ResponsesService
from turnkv_server.router.config import RouterConfig
from turnkv_server.router.engine_queries import cache_config
from turnkv_server.router.engines import Engine, EngineConnectionError, EnginePool, Upstream
from turnkv_server.router.errors import RETRY_AFTER_S, BadRequest, error_response
from turnkv_server.router.modes.base import Mode
from turnkv_server.router.session_store import RedisStore, StoreUnavailable
from turnkv_server.router.sessions import Session, SessionKey, SessionService
from turnkv_server.router.stats import RouterMetrics
from turnkv_server.router.tenants import Tenants
from turnkv_server.router.turn import Turns


class Served(Protocol):
    """What these routes read of the router (`app.Router`)."""

    config: RouterConfig
    pool: EnginePool
    tenants: Tenants
    metrics: RouterMetrics
    upstream: Upstream
    sessions: SessionService
    store: RedisStore | None  # shared with other routers (`--redis`)
    responses: ResponsesService
    mode: Mode
    turns: Turns

    async def _read_body(self, request: Request) -> dict[str, Any]: ...


@contextlib.asynccontextmanager
async def upkeep(router: Served) -> AsyncIterator[None]:
    """The router's life beside its turns: the shared store opened (and the tenants' secret
    read from it), the health loop run, and everything closed at the end."""
    store = router.store
    if store is not None:
        router.tenants.use_secret(await store.start())
    health = asyncio.create_task(health_loop(router))
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


async def health_loop(router: Served) -> None:
    """The engines' health, probed every `health_interval` (what `/health` reports), and the
    sessions' upkeep: their count in the metrics, the expired ones ended."""
    while True:
        await asyncio.gather(*(_probe(router, e) for e in router.pool.engines()))
        router.metrics.sessions.set(len(router.sessions.table))
        await router.sessions.expire()
        await asyncio.sleep(router.config.health_interval)


async def _probe(router: Served, engine: Engine) -> None:
    try:
        ok = (await router.upstream.get(engine, "/health", timeout=2.0)).status == 200
    except EngineConnectionError:
        ok = False
    engine.healthy = ok
    router.metrics.engine_healthy.labels(engine.name).set(1 if ok else 0)
    if ok and engine.block_size is None:
        with contextlib.suppress(EngineConnectionError, RuntimeError, ValueError):
            cache = await cache_config(router.upstream, engine)
            engine.block_size, engine.kv_tokens = cache.block_size, cache.tokens


def add_routes(app: FastAPI, router: Served) -> None:
    """The routes other than a turn's, on `app`, in front of `router`."""
    config = router.config

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
        return JSONResponse(session_view(found, router.sessions.table.clock()))

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
        return JSONResponse(session_view(found, router.sessions.table.clock()))

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


def session_view(session: Session, now: float) -> dict[str, Any]:
    """A session as the session API shows it."""
    return {
        "session_id": session.key.session_id,
        "turns": session.turns,
        "prefill_node": session.prefill,
        "decode_node": session.decode,
        "prefix_id": session.prefix_id,
        "priority": session.priority,
        "tokens_held": len(session.tokens),
        "expires_in_s": round(max(0.0, session.expires_at - now), 3),
        "totals": vars(session.totals),
        "last_turn": session.last_stats,
    }
