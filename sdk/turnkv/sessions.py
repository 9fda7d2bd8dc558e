"""`Session`: a multi-turn conversation with a turnkv router, for sync code; and
`turnkv.session(...)`, the ambient session that tags whatever is sent inside it.

Every decision lives in the shared core (`core`, `turn_call`, `session_api`); the methods
here only choose the sync form of each call.
"""

from __future__ import annotations

from typing import Any

from turnkv.context import AmbientSession
from turnkv.openai_patch import install
from turnkv.retry import RetryPolicy
from turnkv.streams import TurnStream
from turnkv.turn import Turn
from turnkv.turn_call import TurnCall, finish_chat


class Session(AmbientSession):
    """A session: `with client.session() as s:` (or `with turnkv.session() as s:`).

    Inside the `with` block the session is also the ambient one: requests sent by turnkv,
    stock openai and `turnkv.http_client()` clients are tagged with it. On exit it is
    released on the router (`DELETE /v1/turnkv/sessions/{id}`) unless `keep=True`; a failed
    release is logged, never raised. It also works with `async with` (release is then
    asynchronous): `turnkv.session()` is the ambient session of async code too, which is why
    this sync class has the async forms `ahint_now`, `arelease` and `aclose` as well.
    """

    def chat(self, *, messages: Any, model: str, **openai_kwargs: Any) -> Turn:
        """One non-streamed turn; every openai `chat.completions.create` argument passes
        through."""
        return finish_chat(*TurnCall.chat(self, messages, model, openai_kwargs).send())

    def stream(self, *, messages: Any, model: str, **openai_kwargs: Any) -> TurnStream:
        """One streamed turn: iterate the returned `TurnStream` for the chunks. Asks for
        `stream_options.include_usage` unless given (usage-based stats on plain servers)."""
        return TurnStream(*TurnCall.stream(self, messages, model, openai_kwargs).send())

    def hint_now(self, *, ttl: float | None = None, next_turn_in: float | None = None,
                 final: bool | None = None, priority: int | None = None) -> dict[str, Any]:
        """Send hints now (`POST /v1/turnkv/sessions/{id}/hints`), e.g. `next_turn_in` before
        a long tool call; returns the router's view of the session."""
        return self._hints_call(ttl=ttl, next_turn_in=next_turn_in, final=final,
                                priority=priority).send()

    async def ahint_now(self, *, ttl: float | None = None, next_turn_in: float | None = None,
                        final: bool | None = None, priority: int | None = None
                        ) -> dict[str, Any]:
        return await self._hints_call(ttl=ttl, next_turn_in=next_turn_in, final=final,
                                      priority=priority).asend()

    def release(self) -> bool:
        """Release the session on the router now. True if the router held it."""
        return self._release_call().send()

    async def arelease(self) -> bool:
        return await self._release_call().asend()

    def close(self, final: bool = True) -> None:
        """No more turns. `final=True` releases the session on the router (errors logged);
        `final=False` leaves it to its lease."""
        self._closing(final).send()

    async def aclose(self, final: bool = True) -> None:
        await self._closing(final).asend()


def session(id: str | None = None, *, ttl: float | None = None, priority: int | None = None,
            prefix_id: str | None = None, keep: bool = False, retry: RetryPolicy | None = None,
            timeout: float | None = None) -> Session:
    """An ambient session, bound to no client: `with turnkv.session() as s:` (or
    `async with`) tags every turn request sent inside it by a turnkv or stock openai client
    or a `turnkv.http_client()`. It releases itself on exit through the base URL of the
    first request it tagged."""
    made = Session(id, ttl=ttl, priority=priority, prefix_id=prefix_id, keep=keep, retry=retry,
                   timeout=timeout)
    install()  # stock openai clients are tagged through a patch of openai's request building
    return made
