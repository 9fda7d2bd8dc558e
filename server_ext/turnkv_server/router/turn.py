"""One turn through the router, top to bottom.

`Turns.serve` takes a request the app has read (`app`) and the API it came in on (`apis`: how
its requests and answers are written): opens its session (`sessions`) and admits it
(`admission`, with a budget); lets the mode `begin` it; places it (`engines.EnginePool`) and
asks the mode for the attempt's plan (`modes`); sends the prefill request (unless the decode
engine serves alone) and the decode request; relays the answer, whole or streamed, with the
turn's stats (`stats`); tells the mode how the decode request ended (`Mode.finish`) and
remembers the turn.

Engine trouble before the client has a byte (refused, reset, a 5xx) marks the engine unhealthy
and replays the turn on another pair; a failed read-back of held KV is replayed without reuse.
Every engine request is owned from its sending until it is closed (`engines.Stream`), the
decode request by a `Decode`, which ends exactly once on every path.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from fastapi.responses import Response

from turnkv import protocol as p
from turnkv_server.router import stats
from turnkv_server.router.admission import Admission, ClientGone
from turnkv_server.router.apis.base import Api
from turnkv_server.router.apis.chat import ask_usage
from turnkv_server.router.conversations import RelayedReply
from turnkv_server.router.engines import (
    EngineConnectionError,
    EnginePool,
    EngineRejected,
    Placement,
    Stream,
    Upstream,
)
from turnkv_server.router.errors import EngineUnavailable
from turnkv_server.router.inferred_sessions import InferredSessions
from turnkv_server.router.modes.base import Mode, Turn, TurnEnd, TurnPlan
from turnkv_server.router.sessions import SessionKey, SessionService


class TurnFailed(Exception):
    """No engine could serve the turn: the client gets a 503 to retry later."""


class ReuseFailed(Exception):
    """The prefill engine failed while reading a session's KV back: replay without reuse."""


@dataclass
class Turns:
    """The turn pipeline, one per router."""

    pool: EnginePool
    mode: Mode
    mode_name: str
    upstream: Upstream
    sessions: SessionService
    admission: Admission | None  # None: no budget, every turn goes at once
    metrics: stats.RouterMetrics
    retries: int  # a turn that fails on an unavailable engine is replayed this many times
    # Sessions recognised from their content (None: turns no key names have none).
    inferred: InferredSessions | None = None

    async def serve(self, api: Api, body: dict[str, Any], tag: p.TurnTag | None, tenant: str,
                    prefix_id: str | None = None, gone: ClientGone | None = None, *,
                    home: tuple[str | None, str] | None = None,
                    source: p.SessionSource | None = "tag",
                    inferred_ticket: int | None = None,
                    stats_in_stream: bool = True) -> Response | Relayed:
        """The turn's response (`api`: the API it came in on; `prefix_id`: a sessionless
        turn's; `home`: the (prefill, decode) engines a session the turn opens starts on;
        `source`: which key named the session; `inferred_ticket`: an inferred session's turn
        (`InferredSessions.infer_turn`); `stats_in_stream`: the client reads a stats chunk);
        raises `TurnFailed`, `EngineRejected` (the engine's 4xx, passed on) or `ClientLeft`."""
        session, opened = None, False
        if tag is not None:
            session, opened = await self.sessions.begin_turn(SessionKey(tenant, tag.session_id),
                                                             home)
            prefix_id = tag.prefix_id
        turn = Turn(path=api.path, body=body, tag=tag, session=session,
                    want_token_ids=api.wants_token_ids(body), stream=bool(body.get("stream")),
                    prefix_id=prefix_id, api=api,
                    session_source=source if session is not None else None,
                    inferred_ticket=inferred_ticket)
        if turn.stream:
            turn.usage_in_stream = ask_usage(api.path, body)
            turn.stats_in_stream = stats_in_stream or turn.usage_in_stream
        response: Response | Relayed | None = None
        try:
            if self.admission is not None:
                turn.queued_ms = await self.admission.admit(session, gone)
            await self.mode.begin(turn)  # once: a replayed attempt plans again, not this
            response = await self._attempts(turn)
            return response
        finally:
            # A streamed turn stays in flight until its relay ends.
            if session is not None and not isinstance(response, Relayed):
                self._inferred_turn_over(turn)
                failed = response is None or response.status_code >= 400
                await self.sessions.end_turn(session, opened, failed)

    async def _attempts(self, turn: Turn) -> Response | Relayed:
        # A session whose engines are down must move: name the fallback before routing.
        lost = self.pool.unhealthy(turn.session.prefill, turn.session.decode) \
            if turn.session else []
        fallback: p.FallbackReason | None = "engine_unavailable" if lost else None
        detail = f"{', '.join(lost)} unhealthy; session moved" if lost else None
        for attempt in range(self.retries + 2):
            placement = self._place(turn)
            turn.request_id = str(uuid.uuid4())
            turn.prompt_token_ids, turn.output_token_ids = None, []
            try:
                return await self._attempt(turn, placement, fallback, detail)
            except ReuseFailed as exc:
                # Reading the session's KV back failed: the mode's offer is spent, and the
                # replay recomputes, on the same engines.
                fallback, detail = "transfer_failed", str(exc)
            except EngineUnavailable as exc:
                exc.engine.healthy = False
                fallback, detail = "engine_unavailable", str(exc)
                if attempt >= self.retries:
                    raise TurnFailed(f"no engine could serve the turn: {exc}") from exc
        raise TurnFailed(f"the turn failed: {detail}")

    def _place(self, turn: Turn) -> Placement:
        session = turn.session
        if not self.mode.affinity or (session is None and turn.prefix_id is None):
            return self.pool.round_robin()
        prefill, decode = (session.prefill, session.decode) if session else (None, None)
        # No home yet: where the live sessions live, or will (the table keeps the count).
        homed = self.sessions.table.counts.homes if decode is None else Counter[str]()
        placement = self.pool.place(prefill=prefill, decode=decode, prefix_id=turn.prefix_id,
                                    homed=homed)
        if session is not None:
            self.sessions.placed(session, placement.decode.name)
        return placement

    async def _attempt(self, turn: Turn, placement: Placement, fallback: p.FallbackReason | None,
                       detail: str | None) -> Response | Relayed:
        started = time.perf_counter()
        try:
            plan = await self.mode.plan(turn, placement)
        except EngineConnectionError as exc:
            # Planning may ask an engine first (/tokenize, /metrics).
            raise EngineUnavailable(exc.engine, str(exc)) from exc
        turn.planned_ms = (time.perf_counter() - started) * 1000.0
        if plan.alone is not None:
            turn.prompt_token_ids = plan.alone.prompt_token_ids
            turn_stats = stats.begin(turn, plan, None, self.mode_name, fallback, detail)
            decode = await self._open_decode(turn, plan, plan.decode_params)
        else:
            decode, turn_stats = await self._prefill_then_decode(turn, plan, fallback, detail)
        if turn.stream:
            try:
                return Relayed(self._relay(turn, decode, turn_stats),
                               on_end=lambda: self._end_relay(decode),
                               headers=stats.headers(turn_stats))
            except BaseException:
                self._end_relay(decode)
                raise
        return await self._complete(turn, decode, turn_stats)

    async def _prefill_then_decode(self, turn: Turn, plan: TurnPlan,
                                   fallback: p.FallbackReason | None, detail: str | None
                                   ) -> tuple[Decode, p.RouterTurnStats]:
        decode: asyncio.Task[Decode] | None = None
        if plan.concurrent:
            decode = asyncio.create_task(self._open_decode(turn, plan, plan.decode_params))
        try:
            prefill = await self._prefill(turn, plan)
            self.mode.prefilled(turn)
            turn.prompt_token_ids = prefill.prompt_token_ids
            turn_stats = stats.begin(turn, plan, prefill, self.mode_name, fallback, detail)
            if decode is None:
                # vLLM's pull P/D: the decode request carries what the prefill returned. (No
                # task: a request cancelled before its headers are in is over when `open`
                # raises, and none is left open after.)
                return await self._open_decode(turn, plan, prefill.transfer_params), turn_stats
            return await decode, turn_stats
        except BaseException:
            if decode is not None:
                await drop_decode(decode)
            raise

    async def _prefill(self, turn: Turn, plan: TurnPlan) -> stats.PrefillResult:
        engine = plan.placement.prefill
        assert plan.prefill_params is not None
        started = time.perf_counter()
        try:
            response = await self.upstream.post(
                engine, turn.path, api_of(turn).prefill_request(turn.body, plan.prefill_params),
                headers={"X-Request-Id": turn.request_id})
        except EngineConnectionError as exc:
            # Connection refused or reset, a timeout, a truncated body: the engine cannot serve
            # now. The same test applies to the decode request.
            raise EngineUnavailable(engine, str(exc)) from exc
        if response.status >= 500 and plan.reuse:
            raise ReuseFailed(f"{engine.name} failed reading the session's KV back: "
                              f"HTTP {response.status}")
        if response.status >= 500:
            raise EngineUnavailable(engine, f"HTTP {response.status}")
        if response.status != 200:
            raise EngineRejected(response.status, response.content)
        return stats.PrefillResult.read(api_of(turn).prefill_answer(response.json()),
                                        (time.perf_counter() - started) * 1000)

    async def _open_decode(self, turn: Turn, plan: TurnPlan,
                           params: dict[str, Any] | None) -> Decode:
        """The decode request, once its headers are in: a `Decode` the caller must end."""
        engine = plan.placement.decode
        request = api_of(turn).decode_request(
            turn.body, params, token_ids=turn.session is not None or turn.want_token_ids)
        try:
            upstream = await self.upstream.open(engine, turn.path, request,
                                                headers={"X-Request-Id": turn.request_id})
        except EngineConnectionError as exc:
            self.mode.finish(turn, plan, TurnEnd("refused"))
            raise EngineUnavailable(engine, str(exc)) from exc
        if upstream.status != 200:
            try:
                content = await upstream.read()
            except EngineConnectionError:
                content = b""
            finally:
                upstream.close()
            self.mode.finish(turn, plan, TurnEnd("refused"))
            if upstream.status >= 500:
                raise EngineUnavailable(engine, f"HTTP {upstream.status}")
            raise EngineRejected(upstream.status, content)
        return Decode(turn, plan, upstream, self.mode)

    async def _complete(self, turn: Turn, decode: Decode, turn_stats: p.RouterTurnStats
                        ) -> Response:
        try:
            data = orjson.loads(await decode.stream.read())
        except BaseException as exc:
            decode.cut()
            if isinstance(exc, EngineConnectionError):
                raise EngineUnavailable(exc.engine, str(exc)) from exc
            raise
        finally:
            decode.close()
        answer = api_of(turn).read_whole(data)
        turn.output_token_ids = answer.output_token_ids
        stats.finish(turn, decode.plan, turn_stats, 0, None, answer.usage, answer.reply,
                     answer.metrics)
        decode.complete(answer.reply, turn_stats)
        await self._remember(turn, decode.plan, turn_stats,
                             api_of(turn).reply(data) if self._infers(turn) else None)
        api_of(turn).write_whole(data, turn, decode.plan, turn_stats)
        if api_of(turn).keeps_answers:
            await api_of(turn).answered(data)
        return Response(orjson.dumps(data), media_type="application/json",
                        headers=stats.headers(turn_stats))

    async def _relay(self, turn: Turn, decode: Decode, turn_stats: p.RouterTurnStats
                     ) -> AsyncIterator[bytes]:
        first_token_ms: float | None = None
        relay = api_of(turn).relay(turn, decode.plan, turn_stats)
        try:
            async for event in decode.stream.sse():
                seen = relay.read(event)
                if first_token_ms is None and seen.output:
                    first_token_ms = (time.perf_counter() - turn.accepted_at) * 1000
                    self.mode.first_token(turn)
                if seen.last and decode.state == "open":
                    answer = relay.answer
                    stats.finish(turn, decode.plan, turn_stats, len(turn.output_token_ids),
                                 first_token_ms, answer.usage, answer.reply, answer.metrics)
                    decode.complete(answer.reply, turn_stats)
                    await self._remember(turn, decode.plan, turn_stats, relay.message)
                    written = relay.write(turn_stats)
                    # Kept before the client has it all: its next request may follow at once.
                    if api_of(turn).keeps_answers:
                        await api_of(turn).answered(relay.whole)
                    for out in written:
                        yield out
                    continue
                for out in relay.write(turn_stats):
                    yield out
        except EngineConnectionError as exc:
            # Mid-stream loss of the decode engine: the client gets an error event, never a
            # silently truncated answer.
            exc.engine.healthy = False
            yield relay.error(f"decode engine lost mid-stream: {exc!r}")
        finally:
            self._end_relay(decode)

    def _end_relay(self, decode: Decode) -> None:
        """The end of a streamed turn, however it came; idempotent (the relay and `on_end`)."""
        self._inferred_turn_over(decode.turn)
        if decode.stream.closed:
            return
        if decode.state != "complete":
            self.metrics.errors.labels("incomplete_stream").inc()
        decode.cut()  # closes the response; gives up the mode's plans unless complete
        if decode.turn.session is not None:
            self.sessions.relay_ended(decode.turn.session)

    async def _remember(self, turn: Turn, plan: TurnPlan, turn_stats: p.RouterTurnStats,
                        reply: RelayedReply | None = None) -> None:
        """The turn, served: its stats counted, its prefix warm, its session's history (and
        for an inferred session, `reply` as its conversation's latest boundary)."""
        self.metrics.record(turn_stats, tagged=turn.session is not None
                            and turn.session_source != "inferred")
        if turn.prefix_id:
            self.pool.remember_prefix(turn.prefix_id, plan.placement)
        if turn.session is None:
            return
        history = (None if turn.prompt_token_ids is None
                   else [*turn.prompt_token_ids, *turn.output_token_ids])
        await self.sessions.remember(turn.session, turn.tag, plan.placement, turn_stats, history)
        if reply is not None and self.inferred is not None:
            self.inferred.served(turn.session.key, reply.message(), turn.inferred_ticket)

    def _infers(self, turn: Turn) -> bool:
        return self.inferred is not None and turn.session_source == "inferred"

    def _inferred_turn_over(self, turn: Turn) -> None:
        """However the turn ended: a turn that did not come to `_remember` leaves its
        conversation's latest boundary as it was (after `served`, this does nothing)."""
        if self._infers(turn) and turn.session is not None:
            assert self.inferred is not None
            self.inferred.abandon(turn.session.key, turn.inferred_ticket)


@dataclass(frozen=True)
class Relayed:
    """A streamed turn's answer, which the app streams: `on_end` must run as soon as the
    response is over, however it ended (a relay that never started runs no `finally`, and one
    left at a `yield` runs it only when it is collected)."""

    body: AsyncIterator[bytes]
    on_end: Callable[[], None]
    headers: dict[str, str]


@dataclass
class Decode:
    """One attempt's decode request once its headers are in. It ends exactly once: `complete`
    (the reply was read whole) or `cut` (anything else), and the mode's `finish` learns which.
    `close` (or `cut`) closes the response and gives back the engine's in-flight count; both
    are idempotent, so every path may call them."""

    turn: Turn
    plan: TurnPlan
    stream: Stream
    mode: Mode
    state: Literal["open", "complete", "cut"] = "open"

    def complete(self, reply: dict[str, Any] | None, turn_stats: p.RouterTurnStats) -> None:
        if self.state == "open":
            self.state = "complete"
            self.mode.finish(self.turn, self.plan, TurnEnd("complete", reply, turn_stats))

    def cut(self) -> None:
        self.stream.close()
        if self.state == "open":
            self.state = "cut"
            self.mode.finish(self.turn, self.plan, TurnEnd("cut"))

    def close(self) -> None:
        self.stream.close()


async def drop_decode(task: asyncio.Task[Decode]) -> None:
    """Cancel a decode request the turn no longer wants (its prefill failed, or the turn was
    cancelled). A streamed response's headers come at once, so the task may be done already,
    and cancelling it closes nothing (the engine would keep the request, waiting for KV that
    never comes, and its in-flight count): cut what it returned."""
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    if task.done():
        _cut_result(task)
    else:
        # This task was cancelled while awaiting: cut the request whenever it opens.
        task.add_done_callback(_cut_result)


def _cut_result(task: asyncio.Task[Decode]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().cut()


def api_of(turn: Turn) -> Api:
    """The turn's API description (`serve` sets it on every turn)."""
    assert isinstance(turn.api, Api), turn.api
    return turn.api
