"""A turn's decode request once its headers are in (`Decode`), who ends it however the turn
goes (`drop_decode`), and the streamed response that ends it when the client's stream ends
(`RelayResponse`). The turn pipeline that makes and relays it is `turn`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from turnkv import protocol as p
from turnkv_server.router.modes.base import Mode, Turn, TurnEnd, TurnPlan
from turnkv_server.router.upstream import Stream


class RelayResponse(StreamingResponse):
    """A streamed turn's response. The relay generator ends its decode request in its
    `finally`, but a generator that never started (the client left before the first byte) has
    no `finally` to run, and one left at a `yield` runs it only when it is collected: `on_end`
    runs as soon as the response is over, however it ended."""

    def __init__(self, content: AsyncIterator[bytes], on_end: Callable[[], None],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()


@dataclass
class Decode:
    """One attempt's decode request once its headers are in.

    It ends exactly once, one of two ways: `complete` (the reply was read whole) or `cut`
    (anything else: the stream broke or the client left, the turn failed elsewhere, the
    request is no longer wanted); either way the mode's `finish` learns which. The response
    itself is closed by `close` (or `cut`), which also gives back the engine's in-flight
    count; both are idempotent, so every path may call them.
    """

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
