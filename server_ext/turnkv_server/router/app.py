"""The session-aware, OpenAI-compatible router in front of the prefill and decode pools."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from turnkv import protocol as p
from turnkv_server.router.config import RouterConfig
from turnkv_server.router.metrics import RouterMetrics
from turnkv_server.router.modes import Mode, ModeContext, NixlPeer, PrefillResult
from turnkv_server.router.placement import EnginePool, Placement
from turnkv_server.router.registry import make_mode
from turnkv_server.router.session_store import StoreUnavailable, apply_record, make_store
from turnkv_server.router.sessions import Session, SessionKey, SessionTable
from turnkv_server.router.tenants import Tenants
from turnkv_server.router.turn import (
    Decode,
    EngineRejected,
    EngineUnavailable,
    ReuseFailed,
    Turn,
    begin_stats,
    decode_alone,
    decode_request,
    drop_decode,
    finish_stats,
    has_output,
    prefill_params,
    route,
    run_prefill,
    sse,
    sse_events,
    stats_chunk,
    strip_token_ids,
)
from turnkv_server.router.upstream import EngineConnectionError, Upstream
from turnkv_server.router.wire import BadRequest, error_response, extract_tag

RETRY_AFTER_S = "2"


class RelayResponse(StreamingResponse):
    """A streamed turn's response.

    The relay generator ends its decode request in its `finally`, but a generator that never
    started (the client left before the first byte) has no `finally` to run, and one left at a
    `yield` runs it only when it is collected: `on_end` runs as soon as the response is over,
    however it ended.
    """

    def __init__(self, content: AsyncIterator[bytes], on_end: Callable[[], None],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()


class Router:
    """The router's state; one instance per app, touched only from the event loop."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pool = EnginePool.from_urls(config.prefill, config.decode)
        self.sessions = SessionTable(config.lease, max_sessions=config.max_sessions)
        self.store = make_store(config.redis_url)
        self.tenants = Tenants(config.api_keys, config.admin_key)
        self.metrics = RouterMetrics()
        self.upstream = Upstream(read_timeout=config.engine_read_timeout)
        peers = {engine.name: NixlPeer.parse(spec)
                 for engine, spec in zip(self.pool.prefill, config.prefill_nixl, strict=False)}
        decode_peers = {engine.name: NixlPeer.parse(spec)
                        for engine, spec in zip(self.pool.decode, config.decode_nixl,
                                                strict=False)}
        side_channels = {name: f"{peer.host}:{peer.port}"
                         for name, peer in {**peers, **decode_peers}.items()}
        self.mode: Mode = make_mode(config.mode, ModeContext(
            upstream=self.upstream, prefill_peers=peers, decoder_kv_ttl=config.decoder_kv_ttl,
            clock=self.sessions.clock, side_channels=side_channels, pool=self.pool,
            short_delta_tokens=config.short_delta_tokens))

    async def health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(e) for e in self.pool.engines()))
            self.metrics.sessions.set(len(self.sessions))
            for gone in self.sessions.sweep():
                # Expired here; with a shared store, another router may have renewed it.
                if not await self._alive_elsewhere(gone.key):
                    self.mode.drop_session(gone)
            await asyncio.sleep(self.config.health_interval)

    async def _probe(self, engine: Any) -> None:
        try:
            ok = (await self.upstream.get(f"{engine.url}/health", timeout=2.0)).status == 200
        except EngineConnectionError:
            ok = False
        engine.healthy = ok
        self.metrics.engine_healthy.labels(engine.name).set(1 if ok else 0)

    # -- a turn ----------------------------------------------------------------------------

    async def serve(self, request: Request, path: str) -> Response:
        tenant = self.tenants.tenant_for(request.headers.get("authorization"))
        if tenant is None:
            return error_response(401, "missing or unknown API key")
        try:
            body = await self._read_body(request)
            tag = extract_tag(body, request.headers)
            _check_supported(body)
        except BadRequest as exc:
            self.metrics.errors.labels(str(exc.status)).inc()
            return error_response(exc.status, exc.message, param=exc.param)

        want_ids = bool(body.get("return_token_ids"))
        if self.tenants.enforced:
            body["cache_salt"] = self.tenants.cache_salt(tenant, body.get("cache_salt"))
        key = SessionKey(tenant, tag.session_id) if tag else None
        if key is not None:
            await self.sync_session(key)
        opened = key is not None and self.sessions.get(key) is None
        session = self.sessions.open(key) if key is not None else None
        turn = Turn(path=path, body=body, tag=tag, session=session, mode=self.mode,
                    want_token_ids=want_ids)
        if session is not None:
            session.in_flight = True
        response: Response | None = None
        try:
            response = await self._serve_turn(turn)
            return response
        finally:
            # A streamed turn stays in flight until its relay ends.
            if session is not None and not isinstance(response, StreamingResponse):
                session.in_flight = False
                # A session whose first turn failed holds nothing worth a table entry.
                failed = response is None or response.status_code >= 400
                if opened and failed and session.turns == 0:
                    await self.release(session)

    async def _serve_turn(self, turn: Turn) -> Response:
        fallback, detail = _home_lost(self.pool, turn.session)
        prefix_id = turn.tag.prefix_id if turn.tag else None
        for attempt in range(self.config.retries + 2):
            placement = route(self.pool, self.mode, turn.session, prefix_id)
            turn.new_attempt()
            try:
                return await self._run(turn, placement, fallback, detail)
            except ReuseFailed as exc:
                # Reading the session's KV back failed: recompute, on the same engines.
                turn.skip_reuse = True
                fallback, detail = "transfer_failed", str(exc)
            except EngineUnavailable as exc:
                exc.engine.healthy = False
                fallback, detail = "engine_unavailable", str(exc)
                if attempt >= self.config.retries:
                    self.metrics.errors.labels("503").inc()
                    return error_response(
                        503, f"no engine could serve the turn: {exc}",
                        headers={"Retry-After": RETRY_AFTER_S})
            except EngineRejected as exc:
                self.metrics.errors.labels(str(exc.status)).inc()
                return Response(exc.content, exc.status, media_type="application/json")
        self.metrics.errors.labels("503").inc()
        return error_response(503, f"the turn failed: {detail}",
                              headers={"Retry-After": RETRY_AFTER_S})

    async def _run(self, turn: Turn, placement: Placement, fallback: p.FallbackReason | None,
                   detail: str | None) -> Response:
        prompt_ids = await decode_alone(turn, placement)
        if prompt_ids is not None:
            turn.decode_alone = True
            turn.prompt_token_ids = prompt_ids
            turn.stats = begin_stats(turn, placement, PrefillResult.skipped(prompt_ids),
                                     fallback, detail)
            decode = await self._open_decode(
                turn, placement, self.mode.decode_transfer_params(turn, placement, None))
        else:
            decode = await self._prefill_then_decode(turn, placement, fallback, detail)
        if turn.stream:
            try:
                assert turn.stats is not None
                return RelayResponse(self._relay(turn, decode),
                                     on_end=lambda: self._end_relay(decode),
                                     media_type="text/event-stream",
                                     headers=_early_headers(turn.stats))
            except BaseException:
                self._end_relay(decode)
                raise
        return await self._complete(turn, decode)

    async def _prefill_then_decode(self, turn: Turn, placement: Placement,
                                   fallback: p.FallbackReason | None, detail: str | None
                                   ) -> Decode:
        params = await prefill_params(turn, placement)
        decode: asyncio.Task[Decode] | None = None
        if self.mode.concurrent:
            decode = asyncio.create_task(self._open_decode(
                turn, placement, self.mode.decode_transfer_params(turn, placement, None)))
        try:
            prefill = await run_prefill(self.upstream, placement.prefill, turn, params)
            turn.prompt_token_ids = prefill.prompt_token_ids
            turn.stats = begin_stats(turn, placement, prefill, fallback, detail)
            if decode is None:
                decode = asyncio.create_task(self._open_decode(
                    turn, placement, self.mode.decode_transfer_params(turn, placement, prefill)))
            return await decode
        except BaseException:
            if decode is not None:
                await drop_decode(decode)
            raise

    async def _open_decode(self, turn: Turn, placement: Placement,
                           params: dict[str, Any] | None) -> Decode:
        """Send the decode request; returns once its headers are in. The caller owns the
        returned `Decode` and must end it."""
        engine = placement.decode
        try:
            upstream = await self.upstream.open(engine, turn.path, decode_request(turn, params),
                                                headers={"X-Request-Id": turn.request_id})
        except EngineConnectionError as exc:
            self.mode.decode_refused(turn, placement, params)
            raise EngineUnavailable(engine, str(exc)) from exc
        if upstream.status != 200:
            try:
                content = await upstream.read()
            except EngineConnectionError:
                content = b""
            finally:
                upstream.close()
            self.mode.decode_refused(turn, placement, params)
            if upstream.status >= 500:
                raise EngineUnavailable(engine, f"HTTP {upstream.status}")
            raise EngineRejected(upstream.status, content)
        return Decode(turn, placement, upstream, params)

    async def _complete(self, turn: Turn, decode: Decode) -> Response:
        placement = decode.placement
        try:
            data = orjson.loads(await decode.stream.read())
        except BaseException as exc:
            decode.cut()
            if isinstance(exc, EngineConnectionError):
                raise EngineUnavailable(placement.decode, str(exc)) from exc
            raise
        finally:
            decode.close()
        choices = data.get("choices") or [{}]
        turn.output_token_ids = list(choices[0].get("token_ids") or [])
        usage = data.get("usage") or {}
        stats = finish_stats(turn, int(usage.get("completion_tokens") or 0), None, usage)
        decode.complete(data.pop("kv_transfer_params", None))
        await self._remember(turn, placement)
        if not turn.want_token_ids:
            strip_token_ids(data)
        data["turnkv"] = stats.model_dump()
        return Response(orjson.dumps(data), media_type="application/json",
                        headers=_early_headers(stats))

    async def _relay(self, turn: Turn, decode: Decode) -> AsyncIterator[bytes]:
        placement = decode.placement
        first_token_ms: float | None = None
        completion_tokens = 0
        template: dict[str, Any] | None = None
        usage: dict[str, Any] | None = None
        try:
            async for payload in sse_events(decode.stream):
                if payload == b"[DONE]":
                    stats = finish_stats(turn, completion_tokens or len(turn.output_token_ids),
                                         first_token_ms, usage)
                    decode.complete(None)
                    await self._remember(turn, placement)
                    yield stats_chunk(turn, stats, template)
                    yield b"data: [DONE]\n\n"
                    continue
                try:
                    chunk = orjson.loads(payload)
                except ValueError:
                    yield b"data: " + payload + b"\n\n"
                    continue
                template = template or chunk
                if first_token_ms is None and has_output(chunk):
                    first_token_ms = turn.elapsed_ms()
                for choice in chunk.get("choices") or []:
                    turn.output_token_ids.extend(choice.get("token_ids") or [])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    completion_tokens = int(usage.get("completion_tokens") or 0)
                if not turn.want_token_ids:
                    strip_token_ids(chunk)
                    if not chunk.get("choices") and not chunk.get("usage") \
                            and "error" not in chunk:
                        continue
                yield sse(chunk)
        except EngineConnectionError as exc:
            # Mid-stream loss of the decode engine: the client gets an error event, never a
            # silently truncated answer.
            placement.decode.healthy = False
            error = {"error": {"message": f"decode engine lost mid-stream: {exc!r}",
                               "type": "service_unavailable", "code": 503}}
            yield sse(error)
        finally:
            self._end_relay(decode)

    def _end_relay(self, decode: Decode) -> None:
        """The end of a streamed turn, however it came: idempotent (the relay's `finally` and
        the response's `on_end` both call it)."""
        if decode.stream.closed:
            return
        if decode.state != "complete":
            self.metrics.errors.labels("incomplete_stream").inc()
        decode.cut()  # closes the response; gives up the mode's plans unless complete
        if decode.turn.session is not None:
            decode.turn.session.in_flight = False

    async def _remember(self, turn: Turn, placement: Placement) -> None:
        stats = turn.stats
        assert stats is not None
        tagged = turn.session is not None
        self.metrics.record(stats, tagged)
        session = turn.session
        if session is None:
            return
        is_new_turn = turn.tag is None or turn.tag.turn is None or turn.tag.turn > session.turns
        if is_new_turn:
            session.turns = stats.turn
            totals = session.totals
            totals.turns += 1
            totals.prompt_tokens += stats.prompt_tokens.total
            totals.completion_tokens += stats.completion_tokens
            tokens = stats.prompt_tokens
            totals.prefill_computed += tokens.prefill_computed or 0
            totals.decode_computed += tokens.decode_computed or 0
            totals.reused_tokens += max(0, tokens.total - (tokens.prefill_computed or 0)
                                        - (tokens.decode_computed or 0))
            totals.fallbacks += 1 if stats.fallback else 0
            totals.prefix_breaks += 1 if stats.prefix_break_at is not None else 0
        session.prefill, session.decode = placement.prefill.name, placement.decode.name
        if turn.prompt_token_ids is not None:
            session.tokens = [*turn.prompt_token_ids, *turn.output_token_ids]
        session.mode_state["last_stats"] = stats.model_dump()
        if turn.tag and turn.tag.prefix_id:
            session.prefix_id = turn.tag.prefix_id
            self.pool.remember_prefix(turn.tag.prefix_id, placement)
        hints = turn.tag.hints if turn.tag else p.CacheHints()
        if hints.final:
            await self.release(session)
        else:
            await self.renew(session, hints)

    async def sync_session(self, key: SessionKey) -> None:
        """With a shared store, take the session as the routers last left it: another router
        may have served its last turn, or ended it."""
        if not self.store.shared:
            return
        try:
            record = await self.store.load(key)
        except StoreUnavailable:
            return  # serve from this router's copy, if any
        local = self.sessions.get(key)
        if local is not None and local.in_flight:
            return  # a turn of it is under way here; it writes the record when it ends
        if record is None:
            if local is not None:
                self.sessions.release(key)
            return
        session = self.sessions.open(key)
        apply_record(session, record)

    async def _alive_elsewhere(self, key: SessionKey) -> bool:
        if not self.store.shared:
            return False
        try:
            return await self.store.load(key) is not None
        except StoreUnavailable:
            return False

    async def renew(self, session: Session, hints: p.CacheHints) -> None:
        self.sessions.renew(session, hints)
        await self.store.save(session, session.expires_at - self.sessions.clock())

    async def release(self, session: Session) -> None:
        self.sessions.release(session.key)
        await self.store.delete(session.key)
        self.mode.drop_session(session)

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
        raw = b"".join(chunks)
        try:
            body = orjson.loads(raw)
        except ValueError as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    # -- session API -----------------------------------------------------------------------

    def session_view(self, session: Session) -> dict[str, Any]:
        now = self.sessions.clock()
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
            "last_turn": session.mode_state.get("last_stats"),
        }


def _home_lost(pool: EnginePool, session: Session | None
               ) -> tuple[p.FallbackReason | None, str | None]:
    """A session whose engines are down must move: name the fallback before routing."""
    if session is None:
        return None, None
    lost = [e.name for e in (pool.by_name(session.prefill), pool.by_name(session.decode))
            if e is not None and not e.healthy]
    if not lost:
        return None, None
    return "engine_unavailable", f"{', '.join(lost)} unhealthy; session moved"


def _check_supported(body: dict[str, Any]) -> None:
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


def _early_headers(stats: p.TurnStats) -> dict[str, str]:
    headers = {
        p.HEADER_PREFILL_NODE: stats.prefill_node or "",
        p.HEADER_DECODE_NODE: stats.decode_node or "",
    }
    if stats.session_id:
        headers[p.HEADER_SESSION] = stats.session_id
        headers[p.HEADER_TURN] = str(stats.turn)
    tokens = stats.prompt_tokens
    if tokens.prefill_computed is not None:
        headers[p.HEADER_PREFILL_COMPUTED] = str(tokens.prefill_computed)
    if tokens.prefill_cached is not None:
        headers[p.HEADER_PREFILL_CACHED] = str(tokens.prefill_cached)
    if stats.prefix_break_at is not None:
        headers[p.HEADER_PREFIX_BREAK_AT] = str(stats.prefix_break_at)
    if stats.fallback:
        headers[p.HEADER_FALLBACK] = stats.fallback
    return headers


def create_app(config: RouterConfig) -> FastAPI:
    router = Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        secret = await router.store.start()
        if secret is not None:
            router.tenants.use_secret(secret)
        health = asyncio.create_task(router.health_loop())
        try:
            yield
        finally:
            health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await health
            await router.upstream.close()
            await router.store.close()

    # No redirects for a trailing slash: a session ID ending in an encoded "/" would be
    # redirected to, and acted on as, another session's route.
    app = FastAPI(title="turnkv router", lifespan=lifespan, redirect_slashes=False)
    app.state.router = router

    @app.get("/health")
    async def health() -> Response:
        ok = any(e.healthy for e in router.pool.prefill) and any(
            e.healthy for e in router.pool.decode)
        return JSONResponse({"status": "ok" if ok else "degraded", "mode": router.mode.name},
                            status_code=200 if ok else 503)

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
                upstream = await router.upstream.get(f"{engine.url}/v1/models", timeout=5.0)
            except EngineConnectionError:
                continue
            return Response(upstream.content, upstream.status, media_type="application/json")
        return error_response(503, "no decode engine answers", headers={"Retry-After": "2"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.serve(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.serve(request, "/v1/completions")

    async def _session_or_error(request: Request, session_id: str) -> Session | JSONResponse:
        tenant = router.tenants.tenant_for(request.headers.get("authorization"))
        if tenant is None:
            return error_response(401, "missing or unknown API key")
        if not p.is_valid_id(session_id):
            return error_response(400, "invalid session id", param="session_id")
        await router.sync_session(SessionKey(tenant, session_id))
        session = router.sessions.get(SessionKey(tenant, session_id))
        if session is None:
            return error_response(404, f"no live session {session_id!r}")
        return session

    @app.get("/v1/turnkv/sessions/{session_id}")
    async def get_session(request: Request, session_id: str) -> Response:
        found = await _session_or_error(request, session_id)
        if isinstance(found, Response):
            return found
        return JSONResponse(router.session_view(found))

    @app.delete("/v1/turnkv/sessions/{session_id}")
    async def release_session(request: Request, session_id: str) -> Response:
        found = await _session_or_error(request, session_id)
        if isinstance(found, Response):
            return found
        await router.release(found)
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
            await router.release(found)
            return JSONResponse({"session_id": session_id, "released": True})
        await router.renew(found, hints)
        return JSONResponse(router.session_view(found))

    @app.get("/v1/turnkv/stats")
    async def stats(request: Request) -> Response:
        if not router.tenants.is_admin(request.headers.get("authorization")):
            return error_response(403, "the stats route needs the admin key")
        sessions = list(router.sessions)
        return JSONResponse({
            "mode": router.mode.name,
            "sessions": len(sessions),
            "sessions_expired": router.sessions.expired_total,
            "sessions_evicted": router.sessions.evicted_total,
            "turns": sum(s.totals.turns for s in sessions),
            "engines": [{"name": e.name, "url": e.url, "healthy": e.healthy,
                         "in_flight": e.in_flight} for e in router.pool.engines()],
            "time": time.time(),
        })

    return app
