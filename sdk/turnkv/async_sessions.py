"""`AsyncSession`: the `Session` of `turnkv.AsyncOpenAI`, for async code.

Every decision lives in the shared core (`core`, `turn_call`, `session_api`); the methods
here only choose the async form of each call.
"""

from __future__ import annotations

from typing import Any

from turnkv.context import AmbientSession
from turnkv.streams import AsyncTurnStream
from turnkv.turn import Turn
from turnkv.turn_call import TurnCall, finish_chat


class AsyncSession(AmbientSession):
    """`async with client.session() as s:`; see `Session`."""

    async def chat(self, *, messages: Any, model: str, **openai_kwargs: Any) -> Turn:
        return finish_chat(*await TurnCall.chat(self, messages, model, openai_kwargs).asend())

    async def stream(self, *, messages: Any, model: str, **openai_kwargs: Any
                     ) -> AsyncTurnStream:
        return AsyncTurnStream(*await TurnCall.stream(self, messages, model, openai_kwargs)
                               .asend())

    async def hint_now(self, *, ttl: float | None = None, next_turn_in: float | None = None,
                       final: bool | None = None, priority: int | None = None
                       ) -> dict[str, Any]:
        return await self._hints_call(ttl=ttl, next_turn_in=next_turn_in, final=final,
                                      priority=priority).asend()

    async def release(self) -> bool:
        return await self._release_call().asend()

    async def close(self, final: bool = True) -> None:
        await self._closing(final).asend()
