"""`AsyncSession`: the `Session` of `turnkv.AsyncOpenAI`, for async code."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from turnkv import context, session_api
from turnkv.core import SessionCore, make_hints
from turnkv.errors import TurnKVError
from turnkv.sessions import StreamState, _take, end_stream, finish_chat
from turnkv.turn import Turn


class AsyncSession(SessionCore):
    """`async with client.session() as s:`; see `Session`."""

    def _openai(self) -> Any:
        if self._client is None:
            raise TurnKVError("this session is bound to no client: use client.session()")
        cached = getattr(self, "_no_retry_client", None)
        if cached is None:
            cached = self._client.with_options(max_retries=0)
            self._no_retry_client = cached
        return cached

    def _kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self.timeout is not None:
            kwargs.setdefault("timeout", self.timeout)
        return kwargs

    async def chat(self, *, messages: Any, model: str, **openai_kwargs: Any) -> Turn:
        if openai_kwargs.get("stream"):
            raise TypeError("AsyncSession.chat() does not stream: use AsyncSession.stream()")
        client = self._openai()
        kwargs = self._kwargs(openai_kwargs)
        pending = self.begin_turn(managed=True)
        try:
            with context.pinning(pending):
                async for attempt in self.retry.async_retrying():
                    with attempt:
                        response = await client.chat.completions.create(
                            messages=messages, model=model, **kwargs)
        except BaseException:
            pending.give_up()
            raise
        return finish_chat(self, pending, response)

    async def stream(self, *, messages: Any, model: str, **openai_kwargs: Any
                     ) -> AsyncTurnStream:
        client = self._openai()
        kwargs = self._kwargs(openai_kwargs)
        kwargs["stream"] = True
        kwargs.setdefault("stream_options", {"include_usage": True})
        pending = self.begin_turn(managed=True)
        try:
            with context.pinning(pending):
                async for attempt in self.retry.async_retrying():
                    with attempt:
                        raw = await client.chat.completions.create(
                            messages=messages, model=model, **kwargs)
        except BaseException:
            pending.give_up()
            raise
        return AsyncTurnStream(self, pending, raw)

    async def hint_now(self, *, ttl: float | None = None, next_turn_in: float | None = None,
                       final: bool | None = None, priority: int | None = None
                       ) -> dict[str, Any]:
        hints = make_hints(ttl=ttl, next_turn_in=next_turn_in, final=bool(final),
                           priority=priority)
        endpoint = self._hints_endpoint(hints)
        if endpoint is None:
            return {}
        return await session_api.apost_hints(endpoint[0], self.id, endpoint[1], hints)

    async def release(self) -> bool:
        return await self._release_async()

    async def close(self, final: bool = True) -> None:
        await self._close_async(final)


class AsyncTurnStream(StreamState):
    """`async for chunk in stream`; see `TurnStream`."""

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            async for chunk in self._raw:
                if _take(chunk, self._text, self._extras):
                    yield chunk
        finally:
            await self._end()

    async def finish(self) -> Turn:
        async for _ in self:
            pass
        if self._turn is None:
            raise TurnKVError("the stream ended without a complete turn")
        return self._turn

    async def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        await self._raw.close()
        self._turn = end_stream(self._session, self._pending, self._extras, "".join(self._text))

    async def close(self) -> None:
        await self._end()

    async def __aenter__(self) -> AsyncTurnStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
