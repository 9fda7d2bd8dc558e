"""`TurnStream` and `AsyncTurnStream`: the chunks of a streamed turn, and the turn it records
once it ends. Both share `StreamState`: what has arrived and how the turn ends."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from turnkv.core import PendingTurn
from turnkv.errors import TurnKVError
from turnkv.stats import TurnStats
from turnkv.turn import Turn


class StreamState:
    """What a streamed turn has received so far; shared by `TurnStream` and its async twin."""

    def __init__(self, pending: PendingTurn, raw: Any) -> None:
        self._pending = pending
        self._raw = raw
        self._text: list[str] = []
        self._extras: dict[str, Any] = {}
        self._turn: Turn | None = None
        self._ended = False

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def turn(self) -> Turn | None:
        return self._turn

    @property
    def stats(self) -> TurnStats | None:
        return self._turn.stats if self._turn else None

    @property
    def early_headers(self) -> dict[str, str]:
        """The router's `X-TurnKV-*` response headers: what it knew before the first token."""
        return dict(self._pending.early_headers)

    def _take(self, chunk: Any) -> bool:
        """Collect a chunk; False for chunks without choices (usage, turnkv stats)."""
        extra = getattr(chunk, "model_extra", None) or {}
        if isinstance(extra.get("turnkv"), dict):
            self._extras["turnkv"] = extra["turnkv"]
        usage = getattr(chunk, "usage", None)
        if usage is not None:
            self._extras["usage"] = usage.model_dump()
        if not chunk.choices:
            return False
        delta = chunk.choices[0].delta
        if getattr(delta, "content", None):
            self._text.append(delta.content)
        return True

    def _ending(self) -> bool:
        """True the first time the stream ends (the raw stream is then to be closed)."""
        ended, self._ended = self._ended, True
        return not ended

    def _record(self) -> None:
        """The turn, once the raw stream is closed: as the transport recorded it, else from
        what the chunks carried, else none (cut short: nothing says the turn happened)."""
        pending = self._pending
        if pending.turn is not None:
            self._turn = pending.turn
        elif "turnkv" not in self._extras and "usage" not in self._extras:
            pending.give_up()
        else:
            self._turn = pending.settle(self._extras.get("turnkv"), self._extras.get("usage"),
                                        self.text)

    def _finished(self) -> Turn:
        if self._turn is None:
            raise TurnKVError("the stream ended without a complete turn")
        return self._turn


class TurnStream(StreamState):
    """The chunks of a streamed turn (openai `ChatCompletionChunk`s with at least one choice;
    the usage and stats chunks go into `stats`). `text` grows as chunks arrive; `stats` and
    `turn` are set once the stream has ended."""

    def __iter__(self) -> Iterator[Any]:
        try:
            for chunk in self._raw:
                if self._take(chunk):
                    yield chunk
        finally:
            self.close()

    def finish(self) -> Turn:
        """Read the rest of the stream; returns the finished turn."""
        for _ in self:
            pass
        return self._finished()

    def close(self) -> None:
        if self._ending():
            self._raw.close()
            self._record()

    def __enter__(self) -> TurnStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncTurnStream(StreamState):
    """`async for chunk in stream`; see `TurnStream`."""

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            async for chunk in self._raw:
                if self._take(chunk):
                    yield chunk
        finally:
            await self.close()

    async def finish(self) -> Turn:
        async for _ in self:
            pass
        return self._finished()

    async def close(self) -> None:
        if self._ending():
            await self._raw.close()
            self._record()

    async def __aenter__(self) -> AsyncTurnStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
