"""One turn through the router: place it, prefill, decode, measure, remember.

The pipeline is the same in every mode; the mode object decides what `kv_transfer_params`
each engine gets. Engine trouble before the client has received a byte (connection refused,
reset, a 5xx) marks the engine unhealthy and replays the turn on another pair, which is
correct by construction: the new pair recomputes whatever it lacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from turnkv.protocol import FallbackReason, TurnStats, TurnTag, TurnTimes
from turnkv_server.router.history import prefix_break
from turnkv_server.router.modes import PREFILL_FOR_REMOTE_DECODE, Mode, PrefillResult
from turnkv_server.router.placement import Engine, EnginePool, Placement
from turnkv_server.router.sessions import Session
from turnkv_server.router.upstream import (
    EngineConnectionError,
    EngineRejected,
    Stream,
    Upstream,
)


class EngineUnavailable(Exception):
    def __init__(self, engine: Engine, detail: str) -> None:
        super().__init__(f"{engine.name} ({engine.url}) unavailable: {detail}")
        self.engine = engine
        self.detail = detail


class ReuseFailed(Exception):
    """The prefill engine failed while reading a session's KV back: replay without reuse."""


@dataclass
class Turn:
    path: str
    body: dict[str, Any]
    tag: TurnTag | None
    session: Session | None
    mode: Mode
    want_token_ids: bool
    accepted_at: float = field(default_factory=time.perf_counter)
    request_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    stats: TurnStats | None = None
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # Set by the mode when the prefill request carries KV to read back.
    reuse_params: bool = False
    reuse_note: tuple[FallbackReason, str] | None = None
    # After a failed read-back the turn is replayed without reuse.
    skip_reuse: bool = False
    # The decode engine serves this attempt alone: no prefill request (a short delta).
    decode_alone: bool = False

    def new_attempt(self) -> None:
        self.request_id = str(uuid.uuid4())
        self.stats = None
        self.prompt_token_ids = None
        self.output_token_ids = []
        self.reuse_params = False
        self.reuse_note = None
        self.decode_alone = False

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.accepted_at) * 1000


def prefill_request(turn: Turn, transfer_params: dict[str, Any]) -> dict[str, Any]:
    body = {k: v for k, v in turn.body.items()
            if k not in ("stream_options", "min_tokens", "max_completion_tokens")}
    body["max_tokens"] = 1
    body["stream"] = False
    body["return_token_ids"] = True
    body["kv_transfer_params"] = transfer_params
    return body


async def run_prefill(
    upstream: Upstream, engine: Engine, turn: Turn, transfer_params: dict[str, Any]
) -> PrefillResult:
    started = time.perf_counter()
    try:
        response = await upstream.post(engine, turn.path, prefill_request(turn, transfer_params),
                                       headers={"X-Request-Id": turn.request_id})
    except EngineConnectionError as exc:
        # Connection refused or reset, a timeout, a truncated body: the engine cannot serve
        # now. The same test applies to the decode request.
        raise EngineUnavailable(engine, str(exc)) from exc
    if response.status >= 500 and turn.reuse_params:
        raise ReuseFailed(f"{engine.name} failed reading the session's KV back: "
                          f"HTTP {response.status}")
    if response.status >= 500:
        raise EngineUnavailable(engine, f"HTTP {response.status}")
    if response.status != 200:
        raise EngineRejected(response.status, response.content)
    data = response.json()
    usage = data.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return PrefillResult(
        transfer_params=data.get("kv_transfer_params"),
        prompt_token_ids=data.get("prompt_token_ids"),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
        elapsed_ms=(time.perf_counter() - started) * 1000,
    )


@dataclass
class Decode:
    """One attempt's decode request once its headers are in: the engine's response and the
    transfer params the request carried.

    It ends exactly once, one of two ways: `complete` (the reply was read whole: the mode's
    `after_turn` runs) or `cut` (anything else: the stream broke or the client left, the turn
    failed elsewhere, the request is no longer wanted: the mode gives up what it arranged for
    after the turn). The response itself is closed by `close` (or `cut`), which also gives
    back the engine's in-flight count; both are idempotent, so every path may call them.
    """

    turn: Turn
    placement: Placement
    stream: Stream
    params: dict[str, Any] | None
    state: Literal["open", "complete", "cut"] = "open"

    def complete(self, reply_params: dict[str, Any] | None) -> None:
        if self.state == "open":
            self.state = "complete"
            self.turn.mode.after_turn(self.turn, self.placement, reply_params)

    def cut(self) -> None:
        self.stream.close()
        if self.state == "open":
            self.state = "cut"
            self.turn.mode.decode_cut(self.turn, self.placement, self.params)

    def close(self) -> None:
        self.stream.close()


async def drop_decode(task: asyncio.Task[Decode]) -> None:
    """Cancel a decode request the turn no longer wants (its prefill failed, or the turn was
    cancelled).

    A streamed response's headers come at once, so the task may have returned its `Decode`
    already, and cancelling a finished task closes nothing: the engine would keep the request
    (waiting for KV that never comes) and its in-flight count for good. Cut what it returned.
    """
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


def decode_request(turn: Turn, transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    body = dict(turn.body)
    body["kv_transfer_params"] = transfer_params
    if turn.session is not None or turn.want_token_ids:
        body["return_token_ids"] = True
    return body


def begin_stats(turn: Turn, placement: Placement, prefill: PrefillResult,
                fallback: FallbackReason | None, fallback_detail: str | None) -> TurnStats:
    session = turn.session
    break_at = None
    if session is not None and session.tokens and prefill.prompt_token_ids is not None:
        break_at = prefix_break(session.tokens, prefill.prompt_token_ids)
    moved = bool(session and session.decode and
                 (session.prefill, session.decode) != (placement.prefill.name,
                                                       placement.decode.name))
    if fallback is None and turn.reuse_note is not None:
        fallback, fallback_detail = turn.reuse_note
    return TurnStats(
        session_id=session.key.session_id if session else None,
        turn=_turn_number(turn),
        mode=turn.mode.name,
        prefill_node=None if turn.decode_alone else placement.prefill.name,
        decode_node=placement.decode.name,
        moved=moved,
        prompt_tokens=turn.mode.prompt_tokens(turn, prefill),
        times=TurnTimes(prefill_ms=prefill.elapsed_ms),
        prefix_break_at=break_at,
        fallback=fallback,
        fallback_detail=fallback_detail,
    )


def _turn_number(turn: Turn) -> int:
    if turn.tag is not None and turn.tag.turn is not None:
        return turn.tag.turn
    return (turn.session.turns + 1) if turn.session else 1


def finish_stats(turn: Turn, completion_tokens: int, first_token_ms: float | None,
                 usage: dict[str, Any] | None = None) -> TurnStats:
    assert turn.stats is not None
    stats = turn.stats
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    if turn.decode_alone and cached is not None:
        # With no remote prefill, the decode engine's cached_tokens are its own prefix hits
        # (in P/D it reports the prefill engine's, so they are not read there).
        stats.prompt_tokens.decode_cached = int(cached)
        stats.prompt_tokens.decode_computed = stats.prompt_tokens.total - int(cached)
    stats.completion_tokens = completion_tokens
    stats.times.first_token_ms = first_token_ms
    stats.times.total_ms = turn.elapsed_ms()
    return stats


def strip_token_ids(data: dict[str, Any]) -> None:
    data.pop("prompt_token_ids", None)
    for choice in data.get("choices") or []:
        choice.pop("token_ids", None)


async def sse_events(response: Stream) -> AsyncIterator[bytes]:
    """The `data:` payloads of an SSE stream, in order."""
    async for line in response.lines():
        if line.startswith(b"data:"):
            yield line[5:].strip()


def stats_chunk(turn: Turn, stats: TurnStats, template: dict[str, Any] | None) -> bytes:
    chunk: dict[str, Any] = {
        "id": (template or {}).get("id", turn.request_id),
        "object": (template or {}).get("object", "chat.completion.chunk"),
        "created": (template or {}).get("created", int(time.time())),
        "model": (template or {}).get("model", turn.body.get("model")),
        "choices": [],
        "turnkv": stats.model_dump(),
    }
    return sse(chunk)


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


def has_output(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or choice.get("text") \
                or delta.get("reasoning") or choice.get("token_ids"):
            return True
    return False


async def decode_alone(turn: Turn, placement: Placement) -> list[int] | None:
    """The prompt's token IDs if the mode has the decode engine serve this turn alone."""
    if turn.skip_reuse:
        return None
    try:
        return await turn.mode.decode_alone(turn, placement)
    except EngineConnectionError as exc:
        # Deciding asks the decode engine first (/tokenize).
        raise EngineUnavailable(placement.decode, str(exc)) from exc


async def prefill_params(turn: Turn, placement: Placement) -> dict[str, Any]:
    if turn.skip_reuse:
        return dict(PREFILL_FOR_REMOTE_DECODE)
    try:
        return await turn.mode.prefill_transfer_params(turn, placement)
    except EngineConnectionError as exc:
        # Preparing reuse asks the prefill engine first (bidirectional: /tokenize).
        raise EngineUnavailable(placement.prefill, str(exc)) from exc


def route(pool: EnginePool, mode: Mode, session: Session | None, prefix_id: str | None
          ) -> Placement:
    if not mode.affinity or session is None:
        return pool.round_robin()
    return pool.place(prefill=session.prefill, decode=session.decode, prefix_id=prefix_id)
