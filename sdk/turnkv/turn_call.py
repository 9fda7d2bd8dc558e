"""One turn of `Session.chat` / `stream` and their async twins: what it sends and how it is
retried, decided once in a frozen `TurnCall`, then carried out by `send()` or `asend()`.

The turn's index is allocated once and pinned (`turnkv.context.pinning`) for every attempt,
so a retried turn keeps it and the router counts the turn once; a turn no attempt got through
gives its index back. Retries follow the session's `RetryPolicy`, with openai's own retries
off (`SessionCore.openai_client`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from turnkv.context import pinning
from turnkv.core import PendingTurn, SessionCore
from turnkv.turn import Turn


@dataclass(frozen=True)
class TurnCall:
    session: SessionCore
    create: Callable[..., Any]  # the client's `chat.completions.create`, without its retries
    kwargs: Mapping[str, Any]  # every argument of `create`

    @classmethod
    def chat(cls, session: SessionCore, messages: Any, model: str,
             openai_kwargs: dict[str, Any]) -> TurnCall:
        """A non-streamed turn; `stream=True` is refused (that is `stream()`)."""
        if openai_kwargs.get("stream"):
            name = type(session).__name__
            raise TypeError(f"{name}.chat() does not stream: use {name}.stream()")
        return cls._of(session, messages, model, openai_kwargs)

    @classmethod
    def stream(cls, session: SessionCore, messages: Any, model: str,
               openai_kwargs: dict[str, Any]) -> TurnCall:
        """A streamed turn. Asks for `stream_options.include_usage` unless given, so that
        plain servers' streams have usage-based stats too."""
        kwargs = {**openai_kwargs, "stream": True}
        kwargs.setdefault("stream_options", {"include_usage": True})
        return cls._of(session, messages, model, kwargs)

    @classmethod
    def _of(cls, session: SessionCore, messages: Any, model: str, kwargs: dict[str, Any]
            ) -> TurnCall:
        create = session.openai_client().chat.completions.create
        if session.timeout is not None:
            kwargs = {"timeout": session.timeout, **kwargs}  # an explicit timeout wins
        return cls(session, create, {"messages": messages, "model": model, **kwargs})

    def send(self) -> tuple[PendingTurn, Any]:
        """The turn and openai's answer (a `ChatCompletion`, or the chunk stream)."""
        with self._turn() as pending:
            return pending, self.session.retry.call(self.create, **self.kwargs)

    async def asend(self) -> tuple[PendingTurn, Any]:
        with self._turn() as pending:
            return pending, await self.session.retry.acall(self.create, **self.kwargs)

    @contextlib.contextmanager
    def _turn(self) -> Iterator[PendingTurn]:
        pending = self.session.begin_turn(managed=True)
        try:
            with pinning(pending):
                yield pending
        except BaseException:
            pending.give_up()
            raise


def finish_chat(pending: PendingTurn, response: Any) -> Turn:
    """The `Turn` of a non-streamed turn, with openai's parsed response and message."""
    turn = pending.turn
    if turn is None:  # not watched on its way in: record from the parsed response
        usage = response.usage.model_dump() if getattr(response, "usage", None) else None
        extra = getattr(response, "model_extra", None) or {}
        turn = pending.settle(extra.get("turnkv"), usage)
    turn.response = response
    if getattr(response, "choices", None):
        turn.message = response.choices[0].message
        turn.text = turn.message.content or ""
    return turn
