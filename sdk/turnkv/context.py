"""The ambient session and the turn being sent, as context variables.

`with turnkv.session(...)` sets the ambient session for the code inside it (threads started
with `contextvars.copy_context()` and asyncio tasks inherit it). `Session.chat` / `stream`
pin the exact pending turn for the request they send, so that retries reuse its turn index.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TypeVar

from turnkv.core import PendingTurn, SessionCore
from turnkv.errors import SessionClosedError

_session: ContextVar[SessionCore | None] = ContextVar("turnkv_session", default=None)
_turn: ContextVar[PendingTurn | None] = ContextVar("turnkv_turn", default=None)

S = TypeVar("S", bound="AmbientSession")


def current_session() -> SessionCore | None:
    """The session of the innermost active `with turnkv.session(...)` / `client.session()`."""
    return _session.get()


def pinned_turn() -> PendingTurn | None:
    return _turn.get()


@contextlib.contextmanager
def pinning(pending: PendingTurn) -> Iterator[None]:
    token = _turn.set(pending)
    try:
        yield
    finally:
        _turn.reset(token)


def pending_for(bound: SessionCore | None) -> PendingTurn | None:
    """The turn a request should carry: the one `Session.chat` pinned, else a new turn of the
    bound or ambient session, else None (the request goes out untagged)."""
    pinned = pinned_turn()
    if pinned is not None and (bound is None or pinned.session is bound):
        return pinned
    session = bound or current_session()
    if session is None:
        return None
    return session.begin_turn(managed=False)


class AmbientSession(SessionCore):
    """A session that `with` and `async with` make the ambient one for the code inside; on
    exit it is closed and released on the router unless `keep` (a failed release is logged,
    never raised). Both forms exist on both sessions: `turnkv.session()` serves sync and async
    code alike."""

    def _enter(self) -> None:
        if self.closed:
            raise SessionClosedError(f"session {self.id} is closed")
        self._tokens.append(_session.set(self))

    def _leave(self) -> None:
        if self._tokens:
            _session.reset(self._tokens.pop())

    def __enter__(self: S) -> S:
        self._enter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._leave()
        self._closing(final=not self.keep).send()

    async def __aenter__(self: S) -> S:
        self._enter()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._leave()
        await self._closing(final=not self.keep).asend()

